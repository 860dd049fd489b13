"""The launch contract: RANK / LOCAL_RANK / WORLD_SIZE from the environment (torchrun, deepspeed, SLURM wrappers).

Without them everything runs as a single process and joins no process group. Stages that split work over ranks
(regenerate, cache, train) join one here; only ``train/engine.py`` adds what DeepSpeed wants on top. The model
files know nothing of ranks.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def dist_info() -> DistInfo:
    return DistInfo(
        rank=int(os.environ.get("RANK", 0)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
    )


def pick_device(device: str, info: DistInfo | None = None) -> torch.device:
    """``auto`` is this rank's GPU (cuda:LOCAL_RANK) when CUDA is there, else the CPU; anything else as given."""
    if device == "auto":
        local_rank = (info or dist_info()).local_rank
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


def backend_for(device: torch.device, backend: str = "auto") -> str:
    """nccl on CUDA, gloo on CPU, unless a backend is named."""
    if backend != "auto":
        return backend
    return "nccl" if device.type == "cuda" else "gloo"


TIMEOUT_MINUTES = 60.0
"""How long a rank waits in a collective before the group gives up. torch's default (10 minutes) is shorter than
rank 0's first load of a large verifier (a download, a GGUF conversion) while the other ranks wait for it in a
barrier; a real hang still ends, with the launcher's error, within the hour."""


def init_process_group(
    device: str = "auto", backend: str = "auto", timeout_minutes: float = TIMEOUT_MINUTES
) -> tuple[DistInfo, torch.device]:
    """This process's rank and device; with several ranks, join their process group (idempotent)."""
    info = dist_info()
    where = pick_device(device, info)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    if info.distributed and not dist.is_initialized():
        dist.init_process_group(backend=backend_for(where, backend), timeout=timedelta(minutes=timeout_minutes))
    return info, where


@contextmanager
def process_group(device: str = "auto", backend: str = "auto") -> Iterator[tuple[DistInfo, torch.device]]:
    """``init_process_group`` for the length of a stage; the group is destroyed on the way out, error or not."""
    try:
        yield init_process_group(device, backend)
    except BaseException:
        cleanup(in_step=False)
        raise
    cleanup()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a small tensor over ranks (a copy; the input itself in a single process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def cleanup(in_step: bool = True) -> None:
    """Leave the process group in order. Objects that hold it (DDP's reducer, DeepSpeed's engine) sit in reference
    cycles: collected here, while the interpreter is whole, rather than at its shutdown, where a group torn down
    with its worker threads still live can abort the process. ``in_step`` (every rank got here together): a
    barrier first, so that no rank closes its connections while another still reads from them; on an error path
    there is none, so that a failing rank exits (and its launcher stops the others) instead of waiting."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        if in_step and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()
