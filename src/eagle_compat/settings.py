"""Every environment variable eagle_compat reads that is the user's to set, in one place, as vLLM's envs.py keeps
its own: each with its type, default and one line of doc. Read when asked, never cached at import (a test, a
launcher or a Ray actor's runtime environment may set one after eagle_compat is imported). No other module reads
these from os.environ (tests/test_import_graph.py); docs/environment.md's "Read" table is `markdown_table()`
(regenerate it with `python -m eagle_compat.settings`).

A leaf: it imports nothing of the package but `errors`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from .errors import InvalidInput


def _names(raw: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in raw.split(",") if n.strip())


def _seconds(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError("not a positive number")
    return value


def _wait_seconds(raw: str) -> float:
    value = float(raw)
    if not value >= 0:
        raise ValueError("not a number >= 0")
    return value


def _bytes(raw: str) -> int:
    if not raw.strip().isdigit():
        raise ValueError("not a whole number of bytes")
    return int(raw)


def _date(raw: str) -> str:
    import datetime
    datetime.date.fromisoformat(raw.strip())
    return raw.strip()


def _flag(raw: str) -> bool:
    return raw.strip().lower() in ("1", "true")


def _text(raw: str) -> str:
    return raw


@dataclass(frozen=True)
class Setting:
    name: str
    parse: Callable[[str], Any]
    default: Any  # the value where the variable is unset or empty (a function: called then)
    shown_default: str  # the default as the documentation says it
    doc: str
    allowed: str = ""  # what a value must be, for the refusal of a bad one


def _default_tiny_models() -> str:
    return os.path.expanduser("~/.cache/eagle-compat/tiny-models")


SETTINGS: tuple[Setting, ...] = (
    Setting("EAGLE_COMPAT_DISABLE", _names, (), "none",
            "comma-separated patch units `install()` leaves off, in the driver and the workers (a unit's name as "
            "`doctor` lists it, or its base name for every side, e.g. `worker_error_messages`); an unknown name is "
            "refused naming the units there are"),
    Setting("EAGLE_COMPAT_ALLOW_UNVERIFIED", _names, (), "none",
            "comma-separated families the resolver accepts without a parity run (those `doctor` lists as unverified: "
            "MiniMax-M2, OLMo-2, Mistral Large 3, ...)"),
    Setting("EAGLE_COMPAT_SHM_LIMIT_BYTES", _bytes, None, "a quarter of /dev/shm",
            "the most /dev/shm the hand-over ring uses; a batch past it goes through vLLM's RPC queue",
            "a whole number of bytes (e.g. 1073741824), or unset"),
    Setting("EAGLE_COMPAT_NO_SHM", lambda raw: raw == "1", False, "unset",
            "`1`: every batch through the RPC queue (no shared memory)"),
    Setting("EAGLE_COMPAT_WRITERS_WAIT_S", _wait_seconds, 120.0, "120",
            "how long a run waits for an earlier run's writers (orphaned `--ray` actors) to leave `--out`",
            "a number of seconds >= 0"),
    Setting("EAGLE_COMPAT_LOAD_DEADLINE_S", _seconds, 3600.0, "3600",
            "`--ray`: the allowance for an actor's engine start in a batch's deadline", "a number of seconds > 0"),
    Setting("EAGLE_COMPAT_TINY_MODELS", _text, _default_tiny_models, "`~/.cache/eagle-compat/tiny-models`",
            "where tiny and real test models are built and cached"),
    Setting("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", _seconds, None, "eagle_compat: 1500",
            "vLLM's step deadline; also the deadline of every eagle_compat call to the workers (a hung worker ends "
            "there)", "a number of seconds > 0"),
    Setting("VLLM_LOGGING_LEVEL", _text, None, "—",
            "set by you, `extract` and `demo` leave vLLM's output as it is (no quiet mode)"),
    Setting("VLLM_PLUGINS", _names, None, "—",
            "if set, must list `eagle_compat` (install() refuses otherwise: the workers would run unpatched)"),
    Setting("VLLM_CPU_OMP_THREADS_BIND", _text, None, "—",
            "yours always wins over the binding eagle_compat computes for CPU tensor parallel"),
    Setting("VLLM_ALLOW_LONG_MAX_MODEL_LEN", _flag, False, "—",
            "`extract` does not enforce the model's position limit on `--max-len`"),
    Setting("VLLM_SYSTEM_START_DATE", _date, None, "—",
            "the date in gpt-oss's harmony system message (vLLM's server reads it too); conversations for gpt-oss are "
            "refused until it is set", "a date YYYY-MM-DD"),
    Setting("VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS", _text, None, "—",
            "read for the tokenized input's key: vLLM's server puts a gpt-oss system message's text in harmony's "
            "system message where set, else in a developer message"),
    Setting("RAY_ADDRESS", _text, None, "—", "`extract --ray` without an address connects there"),
)
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def raw(name: str) -> str | None:
    """The variable as set (None where unset)."""
    return os.environ.get(BY_NAME[name].name)


def is_set(name: str) -> bool:
    return raw(name) is not None


def value(name: str) -> Any:
    """The variable's value, parsed; its default where unset or empty. A value that does not parse is refused
    naming the variable and what it must be."""
    setting, text = BY_NAME[name], raw(name)
    if text is None or text == "":
        return setting.default() if callable(setting.default) else setting.default
    try:
        return setting.parse(text)
    except ValueError:
        raise InvalidInput(f"{name}={text!r}; must be {setting.allowed or 'another value'}") from None


def markdown_table() -> str:
    rows = ["| variable | what it does | default |", "|---|---|---|"]
    rows += [f"| `{s.name}` | {s.doc} | {s.shown_default} |" for s in SETTINGS]
    return "\n".join(rows) + "\n"


def write_doc(path: str) -> None:
    """Replace the table under docs/environment.md's "## Read" heading with `markdown_table()`."""
    text = open(path).read()
    head, rest = text.split("## Read", 1)
    section, tail = (rest.split("\n## ", 1) + [""])[:2]
    start = section.index("| variable |")
    end = section.index("\n\n", start) + 1 if "\n\n" in section[start:] else len(section)
    section = section[:start] + markdown_table() + section[end:]
    with open(path, "w") as f:
        f.write(head + "## Read" + section + ("\n## " + tail if tail else ""))


if __name__ == "__main__":
    doc = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs",
                       "environment.md")
    write_doc(doc)
    print(f"wrote {doc}")
