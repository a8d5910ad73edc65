"""A deterministic fault point for extract's crash tests (instead of a timing window): exactly PAUSE_WRITES_AFTER
sample files are written, counted across every process that imports this module (the driver, or each Ray actor),
then PAUSE_WRITES_DIR/ready appears and every further write is held until PAUSE_WRITES_DIR/release exists. The test
acts (kill, Ctrl-C) with a known number of complete files on disk, however busy the machine is.
usage: python -c "import pause_writes; from eagle_compat.cli import main; main()" extract ...   (tests/data on sys.path)
Processes the test does not start (Ray's actors) import it from a `sitecustomize` (tests/test_ray.py)."""
import importlib.abc
import importlib.util
import os
import sys
import time

_AFTER = int(os.environ["PAUSE_WRITES_AFTER"])
_DIR = os.environ["PAUSE_WRITES_DIR"]
_TARGET = "eagle_compat.extract.formats"


def _ticket() -> int:
    """This write's place among all processes' writes: the first free ticket file, taken atomically (it holds the
    writer's pid)."""
    k = 0
    while True:
        try:
            fd = os.open(os.path.join(_DIR, f"ticket-{k}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            k += 1
            continue
        os.write(fd, str(os.getpid()).encode())  # who holds it: the process a test may kill mid-write
        os.close(fd)
        return k


def _paused(save):
    def wrapper(self, *args, **kwargs):
        k = _ticket()
        while k >= _AFTER and not os.path.exists(os.path.join(_DIR, "release")):
            time.sleep(0.01)
        path = save(self, *args, **kwargs)
        if k < _AFTER:
            open(os.path.join(_DIR, f"done-{k}"), "w").close()
            if sum(name.startswith("done-") for name in os.listdir(_DIR)) == _AFTER:
                open(os.path.join(_DIR, "ready"), "w").close()
        return path
    return wrapper


def _patch(formats) -> None:
    for fmt in (formats.SampleFiles, formats.ArrowLayout):
        fmt.save = _paused(fmt.save)


class _PatchWhenImported(importlib.abc.MetaPathFinder):
    """Patches the formats module as it is first imported (importing it here would import eagle_compat, and with it
    vLLM's environment checks, in every process that starts with this module)."""

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)
        spec.loader.exec_module = exec_module
        return spec


if _TARGET in sys.modules:
    _patch(sys.modules[_TARGET])
else:
    sys.meta_path.insert(0, _PatchWhenImported())
