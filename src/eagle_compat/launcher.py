"""Run any Python script or module unmodified under `install()`, with every process it spawns covered.

    eagle-compat run path/to/script.py ARGS...        python -m eagle_compat path/to/script.py ARGS...
    eagle-compat run -m package.module ARGS...        python -m eagle_compat -m package.module ARGS...

The script runs as `__main__` in this process (like `python script.py`: `sys.argv`, `sys.path[0]`), after
`install()`; the start-up hook (`eagle_compat.startup`) makes its spawned children import speculators patched.
Exits with the script's status; `uninstall()` runs at the end, which clears the variable.
"""
from __future__ import annotations

import os
import runpy
import sys

USAGE = ("usage: eagle-compat run SCRIPT.py [ARGS...]  |  eagle-compat run -m MODULE [ARGS...]\n"
         "       (or python -m eagle_compat ...): runs it unmodified under eagle_compat.install()\n"
         "       eagle-compat run --online --model M --data D.jsonl [...] -- python scripts/train.py ARGS...:\n"
         "       speculators 0.3.0's trainer, its data from the engine (eagle-compat run --online --help)")


def parse(argv: list[str]) -> tuple[str, str, list[str]]:
    """(kind, target, args) with kind 'path' or 'module'; a bad command line raises InvalidInput."""
    from .errors import InvalidInput
    if not argv or argv[0] in ("-h", "--help"):
        raise InvalidInput(USAGE)
    if argv[0] == "-m":
        if len(argv) < 2 or not argv[1] or argv[1].startswith("-"):
            raise InvalidInput(f"-m needs a module name, got {argv[1:2] or 'nothing'}\n{USAGE}")
        return "module", argv[1], argv[2:]
    target = argv[0]
    if target.startswith("-"):
        raise InvalidInput(f"unknown option {target!r}; allowed: a script path or -m MODULE\n{USAGE}")
    if not os.path.isfile(target):
        raise InvalidInput(f"script {target!r} does not exist or is not a file\n{USAGE}")
    return "path", target, argv[1:]


def prepare(argv: list[str]) -> tuple[str, str, list[str]]:
    """Everything that can refuse, before the script runs: the command line, install()."""
    kind, target, args = parse(argv)
    from .installer import install

    install()  # also the start-up hook, for this run's spawned processes (startup.py)
    return kind, target, args


def run(kind: str, target: str, args: list[str]) -> int:
    """Run the script or module (after prepare()); return its exit status. Its own exceptions propagate."""
    from .installer import uninstall

    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    try:
        if kind == "path":
            sys.argv = [target, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python script.py` does
            runpy.run_path(target, run_name="__main__")
        else:
            sys.argv = [target, *args]  # runpy replaces argv[0] with the module's file
            sys.path.insert(0, os.getcwd())  # as `python -m` does
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as exc:
        return _exit_status(exc.code)
    finally:
        sys.argv = saved_argv
        if sys.path and saved_path0 is not None and sys.path[0] != saved_path0:
            sys.path.pop(0)
        uninstall()


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message") prints the message and exits 1
    return 1


def main(argv: list[str] | None = None) -> int:
    from .errors import EagleCompatError
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):  # help for `run` itself; a script's own --help comes after its name
        print(USAGE)
        return 0
    try:
        kind, target, args = prepare(argv)
    except EagleCompatError as exc:
        print(f"eagle-compat run: {exc}", file=sys.stderr)
        return 2
    return run(kind, target, args)
