"""One rank of the engine-level multi-process tests, run under torchrun (``python -m torch.distributed.run``) by
tests/test_train_dist.py, or as a plain single process for the reference.

    python -m torch.distributed.run --nproc_per_node 2 tests/dist_worker.py empty_rank ddp OUT
    python tests/dist_worker.py empty_rank single OUT
    python -m torch.distributed.run --nproc_per_node 2 tests/dist_worker.py count_all_reduces ddp OUT

``empty_rank``: two micro-batches of the same synthetic job, the second with no counted position (its loss mask is
all zero). Two ranks take one each; one process takes both with ``grad_accum=2``. Each writes its loss and the
weights after one step to OUT. ``count_all_reduces``: DDP's gradient buckets all-reduced in each of two
micro-batches of one step (a counting comm hook). The engine is released and garbage-collected before the process group is destroyed:
DDP and DeepSpeed hold the group in reference cycles, and a group left to interpreter shutdown aborts the process
(its worker threads then reach for a finalized interpreter).
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from fledge.core.dist import cleanup, dist_info
from fledge.models.draft import Eagle3Draft
from fledge.train.bench import TrainBenchConfig, synthetic_batch, synthetic_head
from fledge.train.config import TrainConfig
from fledge.train.engine import EngineConfig, TTTModule, build_engine, init_process_group
from fledge.train.ttt import TTTConfig

SHAPE = TrainBenchConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, target_hidden_size=48, vocab_size=512, draft_vocab_size=128, seq_len=16)


def micro_batches() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    full, empty = synthetic_batch(SHAPE, gen), synthetic_batch(SHAPE, gen)
    empty["loss_mask"].zero_()
    return [full, empty]


def empty_rank(kind: str, out: Path) -> None:
    engine_cfg = {"single": EngineConfig(kind="single"), "ddp": EngineConfig(kind="ddp"),
                  "zero3": EngineConfig(kind="deepspeed", zero_stage=3)}[kind]
    info, device = init_process_group(engine_cfg)
    torch.set_num_threads(1)
    config = SHAPE.draft_config()
    head = synthetic_head(config, torch.Generator().manual_seed(0))
    module = TTTModule(Eagle3Draft(config, seed=0), head, TTTConfig(ttt_steps=2))
    batches = micro_batches()
    mine = batches if info.world_size == 1 else [batches[info.rank]]
    train = TrainConfig(max_steps=1, grad_accum=len(mine), lr=1e-2, dtype="fp32", warmup_steps=0)
    engine = build_engine(module, train, engine_cfg, info, device, 1)
    losses = []
    for i, batch in enumerate(mine):
        boundary = i == len(mine) - 1
        with engine.accumulating(boundary):
            loss, metrics = engine.forward(batch)
            engine.backward(loss / len(mine), boundary)
        losses.append(float(loss))
    result = engine.step()
    weights = engine.trainable_state_dict()  # a collective under ZeRO-3: every rank calls it
    if info.is_main:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / f"{kind}.safetensors"))
    (out / f"{kind}-rank-{info.rank}.json").write_text(json.dumps({"losses": losses, "grad_norm": result.grad_norm}))
    del engine, module, weights
    gc.collect()
    cleanup()


def count_all_reduces(kind: str, out: Path) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    engine_cfg = EngineConfig(kind=kind)
    info, device = init_process_group(engine_cfg)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(info.rank)
    head = torch.randn(SHAPE.vocab_size, SHAPE.target_hidden_size, generator=gen)
    module = TTTModule(Eagle3Draft(SHAPE.draft_config(), seed=0), head, TTTConfig(ttt_steps=2))
    train = TrainConfig(max_steps=1, grad_accum=2, dtype="fp32", warmup_steps=0)
    engine = build_engine(module, train, engine_cfg, info, device, 1)
    buckets: list[int] = []

    def counting(state, bucket):
        buckets.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    engine.wrapped.register_comm_hook(None, counting)
    after = []
    for boundary in (False, True):
        batch = synthetic_batch(SHAPE, gen)
        with engine.accumulating(boundary):
            loss, _ = engine.forward(batch)
            engine.backward(loss / 2, boundary)
        after.append(len(buckets))
    engine.step()
    import torch.distributed as dist

    timeout = dist.group.WORLD._get_backend(device).options._timeout.total_seconds()  # engine.timeout_minutes
    (out / f"rank-{info.rank}.json").write_text(json.dumps(after))
    (out / f"timeout-{info.rank}.json").write_text(json.dumps(timeout))
    del engine, module, counting
    gc.collect()
    cleanup()


if __name__ == "__main__":
    job, kind, folder = sys.argv[1:4]
    {"empty_rank": empty_rank, "count_all_reduces": count_all_reduces}[job](kind, Path(folder))
    print(f"rank {dist_info().rank}: done")
