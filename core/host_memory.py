"""Freed host memory kept in the process for the next step, where glibc would hand it back to the system.

A training step on a CPU allocates the same large tensors every step (the head's [positions, V_draft] logits and
their gradient, the teacher's rows, the head's weight gradient) and frees them at its end. glibc's ``malloc`` serves
a request over its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and returns it with ``munmap`` when freed, and
trims the heap's free top above a threshold: each step then faults in and zeroes those pages again (about 900 MiB a
step at the bench's defaults, draft vocabulary 32,000). With mmap off for ``malloc`` and trimming only past 2 GiB,
freed blocks stay in the heap and the next step reuses them: at the bench's defaults on a 2-core AMX Xeon a step took
1.47-1.61 s against 1.69-1.79 (``docs/experiments/2026-12-07-host-memory.md``). The price is a process that keeps
its high-water mark of host memory until it exits, which a training process reaches every step anyway.

Training, the cache stage (each batch's verifier activations alike: the stage ran 1.14x faster), their benches and
the quickstart's budget probe set it on a CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from typing import Any

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**31 - 1
"""The largest value ``mallopt`` takes (an int): free memory at the heap's top is given back only past 2 GiB."""
OPT_OUT = "FLEDGE_HOST_MALLOC"
"""``FLEDGE_HOST_MALLOC=system`` leaves glibc's thresholds as they are."""

_done: bool | None = None


def keep_freed_memory(device: Any = "cpu") -> bool:
    """Set glibc's ``malloc`` to keep freed memory in the heap (once per process) for work on ``device`` (a
    ``torch.device`` or its type's name); True where it is set. False, and nothing set, for a device other than the
    CPU (its large tensors are not host memory), on other C libraries (macOS, musl), where ``mallopt`` is absent, and
    with ``FLEDGE_HOST_MALLOC=system``."""
    if getattr(device, "type", device) != "cpu":
        return False
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get(OPT_OUT, "").lower() == "system":
        log.info("%s=system: glibc's malloc thresholds left as they are", OPT_OUT)
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_MAX, 0) != 1 or mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        log.warning("glibc's mallopt refused the host memory settings; freed memory goes back to the system")
        return False
    log.info("host memory: freed blocks stay in the heap for the next step (%s=system to turn off)", OPT_OUT)
    _done = True
    return True
