"""core/host_memory.py: with the setting on, a step's large tensors reuse the heap's pages the steps before freed
instead of faulting in fresh ones; FLEDGE_HOST_MALLOC=system leaves glibc as it is."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import resource, statistics, torch
from fledge.core.host_memory import keep_freed_memory
assert keep_freed_memory(torch.device("cuda")) is False  # a GPU's tensors are not host memory: nothing is set
on = keep_freed_memory()
def step():  # as a training step: large tensors allocated, written, used together and freed, the same each step
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = torch.empty(16 << 20).fill_(1.0)
    b = torch.empty(8 << 20).fill_(1.0)
    (a[: 8 << 20] + b).sum()
    del a, b
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
counts = [step() for _ in range(10)]
print(on, statistics.median(counts[4:]))
"""


def faults(env_value: str | None) -> tuple[bool, float]:
    env = {k: v for k, v in os.environ.items() if k != "FLEDGE_HOST_MALLOC"}
    env["THP_MEM_ALLOC_ENABLE"] = "0"  # 4 KiB pages, counted one fault each (importing fledge.launch.cli turns THP on)
    if env_value is not None:
        env["FLEDGE_HOST_MALLOC"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    on, count = out.stdout.split()
    return on == "True", float(count)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_freed_memory_is_reused_by_the_next_step_and_the_opt_out_leaves_glibc_alone():
    on, kept = faults(None)
    off, system = faults("system")
    assert on and not off
    pages = (128 << 20) // os.sysconf("SC_PAGE_SIZE")  # a step's three tensors (64 + 32 + 32 MiB)
    assert system > pages // 2  # glibc maps each block afresh every step: its pages fault in again
    assert kept < pages // 20  # after the first steps the heap's freed blocks serve the next step's
