"""The training step ``fledge bench plan`` measures, and the live-byte trace it is measured with: built here, run for
real in ``plan/bench.py``'s fresh process, or under fake tensors in ``plan/fake.py``."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fledge.models.draft import Eagle3Config


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive, and their peak, as the ops that make them run. Storages ``add``-ed
    before the trace starts count too (a view of one is not a new storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.bytes = self.peak = 0

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        self.live[key] = storage.nbytes()
        self.bytes += storage.nbytes()
        self.peak = max(self.peak, self.bytes)

        def freed(_: object, key: int = key) -> None:
            self.bytes -= self.live.pop(key, 0)

        self.refs[key] = weakref.ref(storage, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out


def built_step(config: Eagle3Config, b: int, t: int, ttt_steps: int, seed: int,
               dtype: str = "fp32") -> tuple[Any, dict, LiveBytes, int]:
    """(the engine, the batch, a tracker of live bytes, the bytes that exist before the step): the draft, a synthetic
    batch and teacher on which every position is counted (the plan's worst case, as ``fledge bench train``), and
    AdamW's moments, as the step after the first finds them. The tracker counts from zero from here on."""
    from fledge.core.dist import DistInfo
    from fledge.models.draft import Eagle3Draft
    from fledge.train.bench import synthetic_head, synthetic_states
    from fledge.train.config import TrainConfig
    from fledge.train.engine import EngineConfig, TorchEngine, TTTModule
    from fledge.train.ttt import TTTConfig

    gen = torch.Generator().manual_seed(seed)
    draft = Eagle3Draft(config, seed=seed)
    head = synthetic_head(config, gen)
    batch = synthetic_states(config, b, t, gen)
    module = TTTModule(draft, head, TTTConfig(ttt_steps=ttt_steps))
    del head  # as train/loop.py: the module keeps the teacher's split of the head
    engine = TorchEngine(
        module, TrainConfig(max_steps=2, dtype=dtype, warmup_steps=0), EngineConfig(), DistInfo(),
        torch.device("cpu"), 2,
    )
    # AdamW creates its moments at its first step: one step on zero gradients (an update of zero) creates them, so
    # that the measured step holds what every step after the first holds, without a second forward and backward.
    for p in engine.params:
        p.grad = torch.zeros_like(p)
    engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True)
    tracker = LiveBytes()
    state = [v for s in engine.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    teacher = [module.teacher.inside, module.teacher.outside]
    for tensor in [*draft.parameters(), *draft.buffers(), *batch.values(), *teacher, *state]:
        tracker.add(tensor)
    persistent = tracker.bytes
    tracker.bytes = tracker.peak = 0  # from here on: what the step adds
    return engine, batch, tracker, persistent


def run_step(engine: Any, batch: dict) -> tuple[torch.Tensor, dict]:
    loss, metrics = engine.forward(batch)
    engine.backward(loss, boundary=True)
    engine.step()
    return loss, metrics
