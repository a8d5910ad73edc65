"""A deterministic fault point for extract's crash tests (instead of a timing window): imported before the CLI runs,
it lets exactly PAUSE_WRITES_AFTER sample files be written, then writes PAUSE_WRITES_DIR/ready and holds every
further write until PAUSE_WRITES_DIR/release exists. The test acts (kill, Ctrl-C) with a known number of complete
files on disk, however busy the machine is.
usage: python -c "import pause_writes; from eagle_compat.cli import main; main()" extract ...   (tests/data on sys.path)"""
import os
import threading
import time

from eagle_compat.extract import formats

_AFTER = int(os.environ["PAUSE_WRITES_AFTER"])
_DIR = os.environ["PAUSE_WRITES_DIR"]
_lock = threading.Lock()
_started = [0]
_done = [0]


def _hold() -> None:
    while not os.path.exists(os.path.join(_DIR, "release")):
        time.sleep(0.01)


def _paused(save):
    def wrapper(self, *args, **kwargs):
        with _lock:
            held = _started[0] >= _AFTER
            _started[0] += not held
        if held:
            _hold()
        path = save(self, *args, **kwargs)
        if not held:
            with _lock:
                _done[0] += 1
                if _done[0] == _AFTER:
                    open(os.path.join(_DIR, "ready"), "w").close()
        return path
    return wrapper


for _fmt in (formats.SampleFiles, formats.ArrowLayout):
    _fmt.save = _paused(_fmt.save)
