"""The repository speaks of the project only: no development diary in what ships.

Every tracked text file (code, comments, tests, docs, scripts, result files, generated pages) is read; none may name
numbered development sessions, numbers of an issue tracker that is not in the repository, borrowed machines or the
tools the project was built with. Upstream references stay, written as `owner#N` (`vllm#39015`, `speculators#313`):
a reader can look those up. Evidence is named by its test, benchmark or result file instead.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (pattern, why it is refused); matched case-insensitively against each line
FORBIDDEN = [
    (r"\bsessions?\b", "a development session (name the test, benchmark or result file instead)"),
    (r"\bissues?\s+#?\d+", "a number of an issue tracker that is not in the repository"),
    (r"(?<![\w/.\-])#\d+\b", "a bare issue number (an upstream one is written owner#N, e.g. vllm#39015)"),
    (r"\blent\b|\bloans?\b|\bborrowed machine", "a borrowed machine (name the GPU kind: H100, H200)"),
    (r"\baudit(s|ed|or)?\b", "how the project was reviewed (say what the test shows)"),
    (r"subagent|before-stop|\bworkplace\b|\bCEO\b|shared/notes|\.\./shared", "a tool used to build the project"),
]
# files whose bytes are data, not prose (binary or vendored upstream code kept byte-for-byte)
SKIP_SUFFIXES = {".png", ".jpg", ".whl", ".gz", ".arrow", ".safetensors", ".pt", ".bin"}
VENDORED = ("tests/data/speculators_v0_3_0/",)  # speculators 0.3.0's own scripts, unmodified
THIS_FILE = "tests/test_project_words.py"
# the same words in a meaning of their own
ALLOWED = [r"scope=[\"']session[\"']", r"\bpytest_sessionfinish\b"]


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def offending_lines(path: str, text: str) -> list[str]:
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        bare = line
        for allowed in ALLOWED:
            bare = re.sub(allowed, "", bare)
        for pattern, why in FORBIDDEN:
            m = re.search(pattern, bare, flags=re.IGNORECASE)
            if m:
                found.append(f"{path}:{lineno}: {m.group(0)!r} ({why}): {line.strip()[:160]}")
    return found


def test_the_patterns_catch_what_they_are_for():
    # a test that must be able to fail: each refused form is caught, each allowed one is not
    for bad in ("session 23", "Sessions 3-5", "issue 52", "issues #7", "see #12", "the lent H200", "loans paused",
                "an audit found", "shared/notes/x.md"):
        assert offending_lines("x", bad), bad
    for good in ("vllm#39015", "speculators#313", "session_latest", "an H100", "the issue tracker of vLLM",
                 "color: #fff", "a helper function", '@pytest.fixture(scope="session")'):
        assert not offending_lines("x", good), good


def test_no_development_diary_in_the_repository():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (the words are checked on the repository's tracked files)")
    problems = []
    for path in tracked_files():
        if path == THIS_FILE or path.startswith(VENDORED) or Path(path).suffix in SKIP_SUFFIXES:
            continue
        try:
            text = (ROOT / path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        problems += offending_lines(path, text)
    assert not problems, f"{len(problems)} lines name how the project was built:\n" + "\n".join(problems[:200])
