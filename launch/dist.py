"""The launch contract: RANK / LOCAL_RANK / WORLD_SIZE from the environment (torchrun, deepspeed, SLURM wrappers).

Without them everything runs as a single process; no code outside ``launch/`` and ``train/engine.py`` needs to know
how it was started.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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


def init_distributed(device: str = "auto") -> DistInfo:
    """Join the process group when launched with several ranks (gloo on CPU, nccl on CUDA); idempotent."""
    info = dist_info()
    if info.distributed and not dist.is_initialized():
        use_cuda = torch.cuda.is_available() and device != "cpu"
        if use_cuda:
            torch.cuda.set_device(info.local_rank)
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return info


def pick_device(device: str, info: DistInfo) -> torch.device:
    if device == "auto":
        return torch.device(f"cuda:{info.local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
