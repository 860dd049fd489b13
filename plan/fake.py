"""One training step at any shape without its memory: ``fledge bench plan fake=true``.

The step of ``fledge bench plan`` (``plan/step.py: built_step``) runs under PyTorch's ``FakeTensorMode``: every
tensor has its shape, dtype and storage size but no data, so an 8B or 70B draft at 8,192 tokens runs on a laptop, and
a trace of the storages alive (``LiveBytes``) gives the step's peak as a GPU's allocator would see it. What the planner
predicts is then checked at the shapes it is used for, not only at the lengths a CPU's memory holds.

A fake tensor has no values, and a few ops of the step depend on them: which positions a TTT step counts and which
teacher rows a fast pass left undecided (``nonzero``: their number sets shapes), and the host reads of a flag or the
gradient norm (``item``). Those ops are answered from a calibration: the same step, for real, at the same vocabulary
sizes, unroll and chunking but a narrow width and two short lengths (64 and 128 tokens), records at each call site
(the first frame of fledge's code) how many elements each ``nonzero`` kept out of how many, and what each scalar
read gave. At the fake step's length a site's count is the straight line through its two calibrated points
(positions counted per step: T - k - 2, rows with a following token: T - 1, teacher rows undecided: 0, the draft
vocabulary's columns: fixed), exact for the synthetic batch ``fledge bench plan`` uses, on which every position is
counted; scalar reads replay their calibrated value. Checked: at a length where both run, the fake step's peak
equals the real step's traced peak byte for byte (``tests/test_plan.py``), and PyTorch's own ``MemTracker``
watching the fake step counts the same total (``torch_tracker``).
"""

from __future__ import annotations

import contextlib
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fledge.models.draft import Eagle3Config
from fledge.plan.step import built_step, run_step

NONZERO = torch.ops.aten.nonzero.default
SCALAR = torch.ops.aten._local_scalar_dense.default
CALIBRATION_LENGTHS = (64, 128)
ROOT = Path(__file__).resolve().parent.parent


def call_site() -> str:
    """``file:line`` of the innermost frame in fledge's own code (dispatch modes' frames left out)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = Path(frame.filename)
        if frame.name != "__torch_dispatch__" and ROOT in path.parents and ".venv" not in path.parts:
            return f"{path.relative_to(ROOT)}:{frame.lineno}"
    return "?"


class Calls:
    """Names each call of a data-dependent op: its site and how many calls that site made before it in this run (a
    site in the unroll's loop is called once per TTT step, each with its own count)."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def next(self) -> tuple[str, int]:
        site = call_site()
        self.seen[site] = self.seen.get(site, 0) + 1
        return site, self.seen[site] - 1


class Calibration(TorchDispatchMode):
    """Records, for real steps, each data-dependent op's answer by call."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: dict[tuple[str, int], list[tuple[int, int]]] = {}
        """call -> [(elements in, elements kept)] of its ``nonzero``, one pair per calibration run."""
        self.scalars: dict[tuple[str, int], Any] = {}
        self.calls = Calls()

    def run(self) -> Calibration:
        """Start a calibration run (the calls are counted from zero again)."""
        self.calls = Calls()
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        out = func(*args, **(kwargs or {}))
        if func is NONZERO:
            self.kept.setdefault(self.calls.next(), []).append((args[0].numel(), out.shape[0]))
        elif func is SCALAR:
            self.scalars.setdefault(self.calls.next(), out)
        return out

    def known(self, table: dict, call: tuple[str, int]) -> tuple[str, int]:
        """``call``, or the first call of its site where the calibration made fewer calls there (a loop over chunks of
        positions runs more often at a longer length; its calls are alike)."""
        if call in table:
            return call
        if (call[0], 0) in table:
            return call[0], 0
        raise RuntimeError(f"fake step: {call[0]} ran a data-dependent op the calibration steps never ran")

    def kept_of(self, call: tuple[str, int], numel: int) -> int:
        """Elements a call's ``nonzero`` keeps out of ``numel``: calibrated, or on the line through its points."""
        points = sorted(set(self.kept[self.known(self.kept, call)]))
        for n, kept in points:
            if n == numel:
                return kept
        (n0, k0), (n1, k1) = points[0], points[-1]
        slope = (k1 - k0) / (n1 - n0) if n1 != n0 else k0 / n0
        return max(0, min(numel, round(k0 + slope * (numel - n0))))


class Answers(TorchDispatchMode):
    """Answers a fake step's data-dependent ops from a calibration."""

    def __init__(self, calibration: Calibration) -> None:
        super().__init__()
        self.calibration = calibration
        self.calls = Calls()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        if func is NONZERO:
            x = args[0]
            kept = self.calibration.kept_of(self.calls.next(), x.numel())
            return torch.empty((kept, x.dim()), dtype=torch.long, device=x.device)
        if func is SCALAR:
            cal = self.calibration
            return cal.scalars[cal.known(cal.scalars, self.calls.next())]
        return func(*args, **(kwargs or {}))


def narrow(config: Eagle3Config) -> Eagle3Config:
    """The calibration's draft: the same vocabularies, a width of 64."""
    return Eagle3Config.from_dict({**config.to_dict(), "hidden_size": 64, "intermediate_size": 128,
                                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                   "target_hidden_size": 64})


def fake_step(config: Eagle3Config, batch_size: int, seq_len: int, ttt_steps: int, seed: int = 0,
              dtype: str = "fp32", torch_tracker: bool = False) -> dict[str, int]:
    """The live-byte peak of one training step (above what exists before it) and those persistent bytes, at any
    shape, with no tensor's data allocated. With ``torch_tracker``, PyTorch's own ``MemTracker``
    (``torch.distributed._tools.mem_tracker``) watches the same step: ``torch_peak_bytes`` is its peak of everything
    the step holds (parameters, gradients, AdamW's moments, the batch, the teacher, activations and temporaries), an
    account independent of ``LiveBytes`` for the same total."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    calibration = Calibration()
    for length in CALIBRATION_LENGTHS:
        with calibration.run():
            engine, batch, _, _ = built_step(narrow(config), batch_size, length, ttt_steps, seed, dtype)
            run_step(engine, batch)
    to = torch.nn.Module.to
    # The engine moves its module to the CPU, where the fake parameters are already; moving swaps each parameter
    # for a new one, which fails for fake tensors.
    torch.nn.Module.to = lambda self, *args, **kwargs: self
    try:
        with FakeTensorMode(), Answers(calibration):
            engine, batch, tracker, persistent = built_step(config, batch_size, seq_len, ttt_steps, seed, dtype)
            theirs = torch_mem_tracker(engine, batch) if torch_tracker else contextlib.nullcontext()
            with theirs, tracker:
                run_step(engine, batch)
    finally:
        torch.nn.Module.to = to
    result = {"step_bytes": tracker.peak, "persistent_bytes": persistent}
    if torch_tracker:
        result["torch_peak_bytes"] = sum(snap["Total"] for snap in theirs.get_tracker_snapshot("peak").values())
    return result


def torch_mem_tracker(engine: Any, batch: dict) -> Any:
    """PyTorch's ``MemTracker`` over the step's module (parameters, buffers, gradients), its optimizer's moments, the
    batch and the teacher's weights, all made before the step."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class Tracker(MemTracker):
        """``MemTracker`` hooks every parameter's gradient, which fails on frozen ones (the verifier's embedding, the
        teacher's head): only those that train get the hook."""

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):  # noqa: ANN001, ANN202
            counts = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            if install_grad_hooks:
                for param in module.parameters():
                    if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                        self._param_to_grad_hook_handles[param] = (
                            param.register_hook(self._grad),
                            param.register_post_accumulate_grad_hook(lambda p: self._grad(p.grad)),
                        )
            return counts

        def _grad(self, grad: torch.Tensor) -> None:
            self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

    tracker = Tracker()
    teacher = engine.module.teacher
    tracker.track_external(engine.module, engine.optimizer, *batch.values(), teacher.inside, teacher.outside)
    return tracker
