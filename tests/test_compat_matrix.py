"""The compatibility page is generated from the committed matrix results only."""
from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_compatibility_page_is_generated_from_results():
    sys.path.insert(0, str(ROOT / "compat_matrix"))
    try:
        import render
        assert (ROOT / "docs" / "compatibility.md").read_text() == render.render(render.load()), \
            "run python compat_matrix/render.py"
    finally:
        sys.path.remove(str(ROOT / "compat_matrix"))


def test_every_matrix_cell_is_a_known_check_and_family():
    sys.path.insert(0, str(ROOT / "compat_matrix"))
    try:
        import render
        from cell import classify
        from matrix import CHECKS
        from eagle_compat import tiny_models
        assert {f for _, f in CHECKS} <= set(tiny_models.FAMILIES)
        for result in render.load():
            for key, cell in result["cells"].items():
                assert cell["status"] in ("pass", "fail", "unsupported"), key
                assert tuple(key.split("/")) in CHECKS
                if cell["status"] != "pass":  # every red cell has its reason, classified by today's rule
                    assert cell.get("error") and classify(cell["error"]) == cell["status"], (result["release"], key)
    finally:
        sys.path.remove(str(ROOT / "compat_matrix"))


def _recorded_cells_for_this_release() -> list[tuple[str, str, dict]]:
    import json

    from eagle_compat import detect
    release = str(detect.installed_versions().vllm)
    path = ROOT / "compat_matrix" / "results" / f"vllm-{release}.json"
    if not path.exists():
        return []
    cells = json.loads(path.read_text())["cells"]
    # every red or unsupported cell (its reason must reproduce) and two green ones (shim in bf16, generator in fp32)
    keep = [k for k, c in cells.items() if c["status"] != "pass"] + ["shim/deepseek_v3", "generator/llama"]
    return [(*k.split("/"), cells[k]) for k in dict.fromkeys(keep) if k in cells]


@pytest.mark.engine
@pytest.mark.parametrize("check,family,recorded", _recorded_cells_for_this_release() or [
    pytest.param("", "", {}, marks=pytest.mark.skip(reason="no recorded matrix results for this vLLM release"))])
def test_recorded_matrix_cell_reproduces_on_this_release(check, family, recorded):
    """Rerunning a release reproduces its cells: same status, same reason, errors within the cell's tolerance."""
    import json
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, str(ROOT / "compat_matrix" / "cell.py"), check, family],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("EAGLE_COMPAT_CELL ")), None)
    assert line, proc.stderr[-3000:]
    cell = json.loads(line.split(" ", 1)[1])
    assert cell["status"] == recorded["status"], cell.get("error")
    if recorded["status"] == "pass":
        assert cell["precision"] == recorded["precision"] and cell["errors"].keys() == recorded["errors"].keys()
    else:  # the same exception type and the same first words of its message
        assert cell["error"].split(":", 1)[0] == recorded["error"].split(":", 1)[0]
        assert cell["error"].splitlines()[0][:80] == recorded["error"].splitlines()[0][:80]
