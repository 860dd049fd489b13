"""``train.compile``: the training step's element-wise work through ``torch.compile``, and eager when it cannot be.

What is compiled are small pure functions around the matrix products (the fused loss's per-chunk terms, the
teacher's per-chunk targets), each written so that the compiler turns its many element-wise passes over
[positions, vocabulary] into one or two loops; the products stay torch's own kernels. Each is compiled once per
process, dynamic in its leading (position) dimension so that a ragged last chunk or another batch length does not
compile again.

A machine where the compiler cannot run (no C++ toolchain, an unsupported op or device) is not an error: the first
failure is logged once, with its reason, and from then on every compiled function of the process runs eagerly: the
same arithmetic, unfused.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

_FAILED: list[str] = []
"""The reason compiling failed in this process (empty while it has not)."""


def compile_failed() -> str | None:
    """Why compiling failed in this process, or None."""
    return _FAILED[0] if _FAILED else None


class Compiled:
    """``fn`` run through ``torch.compile`` when called with ``compiled=True`` (``eager`` otherwise, or after any
    compile failure in this process; ``eager`` defaults to ``fn``)."""

    def __init__(self, fn: Callable[..., Any], eager: Callable[..., Any] | None = None) -> None:
        self.fn = fn
        self.eager = eager or fn
        self._compiled: Callable[..., Any] | None = None

    def __call__(self, *args: Any, compiled: bool = False) -> Any:
        if compiled and not _FAILED:
            if self._compiled is None:
                self._compiled = torch.compile(self.fn, dynamic=True)
            try:
                return self._compiled(*args)
            except Exception as err:  # no C++ compiler, an unsupported op, ...: train on, eagerly, and say why once
                text = str(err).strip()
                reason = f"{type(err).__name__}: {text.splitlines()[0][:300]}" if text else type(err).__name__
                _FAILED.append(reason)
                log.warning("train.compile: torch.compile could not compile %s (%s); the step runs eagerly",
                            getattr(self.fn, "__qualname__", self.fn), reason)
        return self.eager(*args)
