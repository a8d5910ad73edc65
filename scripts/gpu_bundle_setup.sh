# The body of a bundle's setup.sh (scripts/gpu_bundle.sh writes `parts="..."` above it): run on the lent H200 by
# scripts/gpu_setup.sh, it joins the carried parts, checks them, and installs vLLM and the bundle's wheels into the
# site folder that goes first on PYTHONPATH. GPU_PARTS and GPU_SITE move the folders (tests/test_gpu_bundle.py).
set -e
here=$(cd "$(dirname "$0")" && pwd)
g=${GPU_PARTS:-/tmp/g}
site=${GPU_SITE:-/tmp/site}
cd "$g" && cat $parts > bundle.tar
echo "$(cat "$here/bundle.md5")  bundle.tar" | md5sum -c
rm -rf b && mkdir -p b && tar -xf bundle.tar -C b
if [ -f "$here/base.md5" ]; then
  # a delta (gpu_bundle.sh BASE=): its base's set-up, moved aside by gpu_setup, is hard-linked in (pip and
  # compileall replace files rather than write into them, so the base stays as it was) and vLLM replaced
  if [ "$(cat "$site.previous/.bundle-md5" 2>/dev/null)" != "$(cat "$here/base.md5")" ]; then
    echo "a delta bundle: set its base (bundle md5 $(cat "$here/base.md5")) up on this machine first"; exit 1
  fi
  cp -al "$site.previous" "$site"
  rm -rf "$site"/vllm "$site"/vllm-*.dist-info "$site/.bundle-md5"
  # a wheel's older version would leave its dist-info beside the new one's
  for w in b/whl/*.whl; do rm -rf "$site/$(basename "$w" | cut -d- -f1)"-*.dist-info; done
fi
mkdir -p "$site" && tar -xzf b/vllm.tgz -C "$site"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" b/whl/*.whl
echo SETUP_OK
