# The body of a bundle's setup.sh (scripts/gpu_bundle.sh writes `parts="..."`, and for a delta `base="MD5"`, above
# it), run on the H200 machine by scripts/gpu_setup.sh's gpu_setup: joins the carried parts, checks them, and installs
# vLLM and the bundle's wheels into $GPU_SITE, which goes first on PYTHONPATH. It builds in $GPU_SITE.new and moves
# that into place last, so a call cut off half-way leaves no half-made set-up. A delta links its base's set-up in
# from $GPU_SITES/BASE_MD5 (kept there by gpu_setup) and replaces what it carries. GPU_PARTS, GPU_SITE and GPU_SITES
# move the folders (tests/test_gpu_bundle.py).
set -e
here=$(cd "$(dirname "$0")" && pwd)
g=${GPU_PARTS:-/tmp/g}
site=${GPU_SITE:-/tmp/site}
sites=${GPU_SITES:-/tmp/sites}
new=$site.new
# each part from the bundle's own folder, where its carry call left it, else from $g: the last part then needs no
# copy (set-ups that looked in $g alone stopped at "cat: part03: No such file or directory": tests/test_gpu_bundle.py),
# and a same-named part of another release's bundle in $g is not taken
mkdir -p "$g" && cd "$g"
for part in $parts; do
  if [ -f "$here/$part" ]; then cat "$here/$part"; elif [ -f "$part" ]; then cat "$part"; else
    echo "part $part is in neither $here nor $g: carry it (scripts/gpu_bundle.sh)" >&2; exit 1; fi
done > bundle.tar
echo "$(cat "$here/bundle.md5")  bundle.tar" | md5sum -c
rm -rf b "$new" && mkdir -p b && tar -xf bundle.tar -C b
shopt -s nullglob
wheels=(b/whl/*.whl)
norm() { echo "$1" | tr 'A-Z' 'a-z' | sed 's/[-_.][-_.]*/_/g'; }  # a distribution name as pip compares them
if [ -n "${base:-}" ]; then
  # a delta: its base's set-up is hard-linked in (tar, pip and compileall replace files rather than write into
  # them, so the kept base stays as it was)
  if [ "$(cat "$sites/$base/.bundle-md5" 2>/dev/null)" != "$base" ]; then
    echo "a delta bundle: set its base (bundle md5 $base) up on this machine first"; exit 1
  fi
  cp -al "$sites/$base" "$new"
  rm -rf "$new"/vllm "$new"/vllm-*.dist-info "$new/.bundle-md5"
  # each carried wheel's older version goes, file by file from its RECORD: a stale module beside the new version's
  # would mix the two, and pip --upgrade would remove whole shared folders (nvidia/, bin/) with it
  for w in "${wheels[@]}"; do
    for d in "$new"/*.dist-info; do
      [ "$(norm "$(basename "${d%-*.dist-info}")")" = "$(norm "$(basename "$w" | cut -d- -f1)")" ] || continue
      while IFS=, read -r f _; do
        case "$f" in ""|/*|*..*) ;; *) rm -f "$new/$f" ;; esac
      done < "$d/RECORD"
      rm -rf "$d"
    done
  done
fi
mkdir -p "$new" && tar -xzf b/vllm.tgz -C "$new"
if [ ${#wheels[@]} -gt 0 ]; then  # a delta over a base that has every wheel carries none
  rm -rf b/t && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target b/t "${wheels[@]}"
  cp -a --remove-destination b/t/. "$new"/ && rm -rf b/t
fi
rm -rf "$site" && mv "$new" "$site"
echo SETUP_OK
