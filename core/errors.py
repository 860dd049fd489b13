"""Known user errors: what the ``fledge`` command prints as one line (the stage, the reason, the fix) and exits 2.

Everything else (a bug, an interrupted run) keeps its traceback. Each layer raises the subclass of its own domain;
they also derive from the builtin exception they replaced (``ValueError``, ``FileNotFoundError``, ...), so
``except ValueError`` in a caller keeps working.
"""

from __future__ import annotations


class FledgeError(Exception):
    """A problem with the user's input, files or settings, not with fledge: ``fix`` says what to do about it."""

    def __init__(self, message: str, fix: str | None = None) -> None:
        super().__init__(message)
        self.fix = fix

    def one_line(self) -> str:
        """The message and its fix on one line (a list in the message becomes '; '-separated)."""
        text = "; ".join(part.strip() for part in str(self).splitlines() if part.strip())
        return f"{text} (fix: {self.fix})" if self.fix else text


class ConfigError(FledgeError, ValueError):
    """A setting that is out of range or contradicts another one (the message names the fields)."""


class MismatchError(FledgeError, ValueError):
    """Two artefacts that must belong together do not: a cache and its verifier, a draft and its verifier, a
    checkpoint and the run that resumes it."""
