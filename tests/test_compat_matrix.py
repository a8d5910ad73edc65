"""The compatibility page is generated from the committed matrix results only."""
from __future__ import annotations

import pathlib
import sys

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
        from matrix import CHECKS
        from eagle_compat import tiny_models
        assert {f for _, f in CHECKS} <= set(tiny_models.FAMILIES)
        for result in render.load():
            for key, cell in result["cells"].items():
                assert cell["status"] in ("pass", "fail", "unsupported"), key
                assert tuple(key.split("/")) in CHECKS
    finally:
        sys.path.remove(str(ROOT / "compat_matrix"))
