"""The exception types eagle_compat raises. Each names what was wrong and what is allowed."""
from __future__ import annotations


class EagleCompatError(Exception):
    """Base class of every error raised by eagle_compat."""


class IncompatibleEnvironment(EagleCompatError):
    """install() cannot make the installed combination correct.

    Raised instead of ever producing silently wrong hidden states. The message names the installed versions and
    what is missing.
    """


class UndecidableProbe(IncompatibleEnvironment):
    """A feature probe could not read what it decides from (e.g. vLLM installed without .py sources): refused rather
    than answer "not needed" and skip a workaround in silence."""


class UnsupportedModel(EagleCompatError):
    """The loaded model (or engine mode) cannot be captured correctly; the message says why and what would work."""


class CaptureInvariantError(EagleCompatError, RuntimeError):
    """A check of the capture itself failed while the engine ran (a hook that never fired, rows that do not add up
    to the scheduled tokens, a batch order that does not match). This is a bug or an unforeseen engine change, never
    a known limitation: the states of that step cannot be trusted, so nothing from it is returned."""


class InvalidInput(EagleCompatError, ValueError):
    """Bad input to generate()/extract, rejected before anything reaches the engine."""


class OutputDirectoryConflict(InvalidInput):
    """--out holds files that this run's settings did not make (or that no settings record describes)."""


class OutputDirectoryBusy(InvalidInput):
    """Another run holds --out's lock."""


class WorkerError(EagleCompatError, RuntimeError):
    """An exception raised inside a vLLM worker process, with its type, message and the worker's traceback."""

    def __init__(self, exc_type: str, message: str, remote_traceback: str = "", method: str = ""):
        self.exc_type = exc_type
        self.remote_message = message
        self.remote_traceback = remote_traceback
        self.method = method
        where = f" during {method!r}" if method else ""
        text = f"{exc_type} in a vLLM worker{where}: {message or '(no message)'}"
        if remote_traceback:
            text += "\n--- worker traceback ---\n" + remote_traceback.rstrip()
        super().__init__(text)
