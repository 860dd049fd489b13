"""The one place that knows about ranks and engines: single process, torch DDP, or DeepSpeed ZeRO-1/2/3.

The loop sees one interface whatever the engine::

    with engine.accumulating(boundary):        # boundary: last micro-batch of the step (DDP syncs gradients there)
        loss, metrics = engine.forward(batch)  # bf16 autocast inside when train.dtype=bf16; metrics stay on the device
        engine.backward(loss, boundary)
    result = engine.step()                     # clip, non-finite guard, AdamW, LR schedule, zero grads

Every engine trains the same module (``TTTModule``: the draft plus the frozen verifier head), with torch's AdamW
and the same warmup + cosine ``LambdaLR``; DeepSpeed is given both as client objects, so the three engines run the
same optimizer arithmetic and a single-process run and a ZeRO run can be compared step by step (DeepSpeed's own
fused optimizers would need compiled ops and would differ in the last bits). Only trainable parameters reach the
optimizer: the verifier's embedding inside the draft is frozen and never in it (ZeRO-3 still partitions its
storage, like every parameter of the module it wraps, and gathers it for the lookup).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from datetime import timedelta
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from fledge.core.dist import TIMEOUT_MINUTES, DistInfo, backend_for, dist_info, pick_device
from fledge.core.dist import init_process_group as join_process_group
from fledge.core.errors import ConfigError
from fledge.train.config import TrainConfig
from fledge.train.stopping import TimeShare
from fledge.train.ttt import InVocabMemo, TeacherHead, TTTConfig, ttt_forward

log = logging.getLogger(__name__)

ENGINES = ("single", "ddp", "deepspeed")


@dataclass
class EngineConfig:
    kind: str = "single"
    """'single' (one process; also each rank's fallback), 'ddp' (torch DistributedDataParallel) or 'deepspeed'."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also parameters."""
    deepspeed_config: str | None = None
    """Path of a DeepSpeed JSON to use instead of the generated one. Batch size, accumulation and clipping are
    taken from train.* when absent and must agree with them when present; an ``optimizer`` / ``scheduler``
    section replaces the torch AdamW / warmup-cosine."""
    device: str = "auto"
    """'auto' (cuda:LOCAL_RANK when CUDA is available, else cpu), 'cpu', 'cuda', ..."""
    backend: str = "auto"
    """Process-group backend: 'auto' is nccl on CUDA and gloo on CPU."""
    timeout_minutes: float = TIMEOUT_MINUTES
    """How long a rank waits in a collective (torch's default, 10, is shorter than rank 0's first load of a large
    verifier online, which the other ranks wait for in a barrier)."""

    def __post_init__(self) -> None:
        if self.kind not in ENGINES:
            raise ConfigError(f"engine.kind must be one of {ENGINES}, got {self.kind!r}")
        if self.zero_stage not in (1, 2, 3):
            raise ConfigError(f"engine.zero_stage must be 1, 2 or 3, got {self.zero_stage}")
        if not self.timeout_minutes > 0:
            raise ConfigError(f"engine.timeout_minutes must be positive, got {self.timeout_minutes}")


class TTTModule(nn.Module):
    """The draft and the frozen verifier head as one module, so that every training forward passes through
    DDP's / DeepSpeed's own ``forward`` (DDP prepares its gradient all-reduce there, ZeRO-3 its parameter gathers)."""

    def __init__(
        self, draft: nn.Module, verifier_head: torch.Tensor, ttt: TTTConfig, compiled: bool = False,
        compiled_layer: bool | None = None,
    ) -> None:
        super().__init__()
        self.draft = draft
        self.compiled = compiled
        """``train.compile``: the loss's per-chunk terms through ``torch.compile`` (``models/fused_ce.py``)."""
        self.compiled_layer = compiled if compiled_layer is None else compiled_layer
        """``train.compile``: the unroll's steps through ``torch.compile`` too (``train.ttt.ttt_unroll``); not under
        DeepSpeed, whose ZeRO-3 hooks gather each layer's weights around its forward."""
        # A plain attribute, neither parameter nor buffer: DDP would broadcast it and ZeRO-3 partition it, and
        # checkpoints would store a copy of the verifier's head. Split at the draft vocabulary (installed by now and
        # fixed from here on) into the parts the teacher reads; the caller's head can then be let go.
        self.teacher = TeacherHead(verifier_head, draft.t2d)
        self.memo = InVocabMemo()
        """The teacher's in-vocabulary decisions per cached conversation, kept across epochs (``InVocabMemo``)."""
        self.ttt = ttt
        self.steps: int | None = None
        """The unroll's length of the training forwards from here (the loop sets it each step from
        ``ttt.step0_share``); None: ``ttt.ttt_steps``. A forward without gradients (held-out) runs the whole unroll."""
        self.compute_dtype: str | None = None
        """The dtype the first forward really ran its matrix products in (the autocast dtype inside whatever the
        engine wrapped around it, else the weights'), so that a run records what ran, not what was asked."""

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        device = batch["final"].device
        if self.teacher.device != device:
            self.teacher = self.teacher.to(device)
        if self.compute_dtype is None:
            on = torch.is_autocast_enabled(device.type)
            dtype = torch.get_autocast_dtype(device.type) if on else self.draft.fc.weight.dtype
            self.compute_dtype = str(dtype).removeprefix("torch.")
        steps = self.steps if torch.is_grad_enabled() else None
        return ttt_forward(self.draft, batch, self.teacher, self.ttt, self.compiled, self.memo, self.compiled_layer,
                           steps)


DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32"}
"""``train.dtype`` (once ``auto`` is settled) as torch names the dtype its forward runs in."""


def check_compute_dtype(module: TTTModule, requested: str, engine: str) -> str:
    """The dtype the first forward ran in, refused when it is not ``train.dtype`` (an engine that ignored the
    setting would otherwise train for days in another precision than the run records)."""
    want = DTYPE_NAMES[requested]
    if module.compute_dtype != want:
        raise ConfigError(
            f"train.dtype={requested} asks for {want}, but the {engine} engine's forward ran in {module.compute_dtype}",
            fix=f"for DeepSpeed, install deepspeed>={MIN_DEEPSPEED} (its torch_autocast section carries bf16) and "
            "keep a user JSON's bf16 / fp16 sections off; or set train.dtype to what should run",
        )
    return want


@dataclass
class StepResult:
    grad_norm: float
    """Global gradient norm before clipping (inf or nan when the step was skipped for it)."""
    applied: bool
    """False when the non-finite guard skipped the update."""


def warmup_cosine(
    total_steps: int, warmup_steps: int, min_ratio: float, share: TimeShare | None = None
) -> Callable[[int], float]:
    """LR multiplier: linear from 1/warmup to 1 over the warmup, then cosine down to ``min_ratio`` at the end. A run
    sized by time (``share`` with a budget; ``total_steps`` is then its upper bound) stands at the step its share of
    the time spent corresponds to, or at the step it took, whichever is further: its warmup takes the same share of
    the time as of the steps, and the cosine reaches its floor when the time is spent."""

    def factor(step: int) -> float:
        at = max(step, share.fraction() * total_steps) if share is not None else step
        if at < warmup_steps:
            return min(1.0, (at + 1) / warmup_steps)
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (at - warmup_steps) / span)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def make_optimizer(
    module: nn.Module, train: TrainConfig, total_steps: int, share: TimeShare | None = None
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over every trainable parameter (decay on matrices only), or with ``train.optimizer=muon``: Muon for the
    hidden matrices (the decoder layer and ``fc``) and AdamW for the rest (``lm_head``, norms), as Muon's authors
    prescribe. Muon's step is scaled to AdamW's update size (``match_rms_adamw``), so both take ``train.lr``."""
    decay, no_decay, hidden = [], [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if train.optimizer == "muon" and p.dim() == 2 and "lm_head" not in name:
            hidden.append(p)
        else:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=train.lr, betas=tuple(train.betas), eps=train.eps)
    if hidden:
        muon = torch.optim.Muon(hidden, lr=train.lr, weight_decay=train.weight_decay, adjust_lr_fn="match_rms_adamw")
        optimizer = OptimizerPair([muon, optimizer])
    # A closure, not a callable object: LambdaLR would save an object's fields in the checkpoint and a resume would
    # bring back the old length (max_steps / epochs may change on resume; the cosine follows the new one).
    schedule = warmup_cosine(total_steps, train.warmup(total_steps), train.min_lr / train.lr, share)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


class OptimizerPair(torch.optim.Optimizer):
    """Two optimizers stepped as one, so that one LR schedule, one clipping and one checkpoint cover both: its
    ``param_groups`` are theirs (the schedule sets their learning rates), its state dict holds both."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:  # noqa: D107 (no base __init__: no params)
        self.optimizers = list(optimizers)
        self.defaults: dict[str, Any] = {}
        self.state: dict[Any, Any] = {}
        self._optimizer_step_pre_hooks: dict[int, Any] = {}
        self._optimizer_step_post_hooks: dict[int, Any] = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        # Read anew each time: loading a state dict gives each optimizer new group dicts.
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self, closure: Any = None) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for o, s in zip(self.optimizers, state_dict["optimizers"], strict=True):
            o.load_state_dict(s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(cfg: EngineConfig) -> tuple[DistInfo, torch.device]:
    """Join the process group that RANK / WORLD_SIZE describe (``core.dist``); a plain single process joins none,
    except for DeepSpeed, which always wants one: it gets a one-rank group on a free local port."""
    info = dist_info()
    if cfg.kind != "deepspeed":
        if info.distributed and cfg.kind == "single":
            raise ConfigError(
                f"launched with WORLD_SIZE={info.world_size} but engine.kind=single",
                fix="use engine.kind=ddp or engine.kind=deepspeed",
            )
        return join_process_group(cfg.device, cfg.backend, cfg.timeout_minutes)
    device = pick_device(cfg.device, info)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    import deepspeed

    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=backend_for(device, cfg.backend), verbose=False,
                                   timeout=timedelta(minutes=cfg.timeout_minutes))
    return info, device


def choose_train_dtype(requested: str, device: torch.device, shape: tuple[int, int, int]) -> str:
    """``fp32`` or ``bf16`` for ``train.dtype``; ``auto`` times the product ``shape`` = (rows, in, out) (the draft's
    widest: its head) in fp32 and under bf16 autocast, and takes bf16 only when it is at least 25 % faster. Every
    rank takes rank 0's choice, so that a run computes alike everywhere."""
    if requested != "auto":
        return requested
    rows, width, out = shape
    x = torch.randn(rows, width, device=device)
    w = torch.randn(out, width, device=device)

    def seconds(bf16: bool) -> float:
        best = math.inf
        for attempt in range(4):  # the first call is untimed: it pays for allocation and kernel choice
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
                nn.functional.linear(x, w)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if attempt:
                best = min(best, time.perf_counter() - start)
        return best

    fp32, bf16 = seconds(False), seconds(True)
    choice = ["bf16" if bf16 < fp32 / 1.25 else "fp32"]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    log.info("train.dtype=auto: %s (a %dx%dx%d product took %.1f ms in fp32, %.1f ms in bf16 autocast)", choice[0],
             rows, width, out, 1e3 * fp32, 1e3 * bf16)
    return choice[0]


class TorchEngine:
    """A single process, or torch DDP across ranks (gradients all-reduced on the last micro-batch of a step)."""

    def __init__(
        self, module: TTTModule, train: TrainConfig, cfg: EngineConfig, info: DistInfo, device: torch.device,
        total_steps: int, share: TimeShare | None = None,
    ) -> None:
        self.module = module.to(device)
        self.draft = module.draft
        self.device = device
        self.bf16 = train.dtype == "bf16"
        self.clip_norm = train.clip_norm
        self.optimizer, self.scheduler = make_optimizer(module, train, total_steps, share)
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.ddp = cfg.kind == "ddp" and info.world_size > 1
        self.wrapped: nn.Module = module
        if self.ddp:
            import inspect

            from torch.nn.parallel import DistributedDataParallel

            # d2t / t2d are the same constants everywhere: no need to broadcast buffers before every forward.
            # (torch >= 2.12 renamed the switch.)
            no_sync_buffers = (
                {"forward_sync_buffers": False}
                if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                else {"broadcast_buffers": False}
            )
            self.wrapped = DistributedDataParallel(
                module, device_ids=[device.index] if device.type == "cuda" else None, **no_sync_buffers
            )

    def accumulating(self, boundary: bool) -> AbstractContextManager:
        """Wraps a micro-batch's forward and backward. Inside an accumulation window (not ``boundary``) DDP must not
        all-reduce: gradients are summed locally and synced once, on the last micro-batch. The forward belongs
        inside ``no_sync`` too: DDP's forward is where it prepares the reducer for the backward that follows, so
        a forward outside it all-reduces that micro-batch's gradients whatever the backward is wrapped in."""
        return self.wrapped.no_sync() if self.ddp and not boundary else nullcontext()

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            return self.wrapped(batch)

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        loss.backward()

    def step(self) -> StepResult:
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip_norm if self.clip_norm > 0 else math.inf)
        # The step's one host sync: whether to apply the update depends on the norm's value. After DDP's all-reduce
        # every rank holds the same gradients, hence the same norm and the same decision.
        value = float(norm)
        if not math.isfinite(value):
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(value, applied=False)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(value, applied=True)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def optimizer_numel(self) -> int | None:
        """Parameters the optimizer updates (the trainable ones; the frozen embedding must not be among them)."""
        return sum(p.numel() for p in self.params)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.draft.trainable_state_dict().items()}

    def save_state(self, folder: Path, info: DistInfo) -> None:
        # DDP ranks hold identical optimizer states: rank 0 writes them for everyone.
        if info.is_main:
            torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), folder / "scheduler.pt")

    def load_state(self, folder: Path, weights: dict[str, torch.Tensor]) -> None:
        self.draft.load_trainable_state_dict({k: v.to(self.device) for k, v in weights.items()})
        self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location=self.device, weights_only=True))
        self.scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))


MIN_DEEPSPEED = "0.17.2"
"""The first DeepSpeed that reads the ``torch_autocast`` section fledge generates; an older one ignores the key and
trains in fp32 (pyproject.toml requires at least this one)."""


def check_deepspeed_version(version: str, dtype: str) -> None:
    """Refuse bf16 on a DeepSpeed that would silently run it in fp32, before anything loads."""
    from packaging.version import Version

    if dtype == "bf16" and Version(version) < Version(MIN_DEEPSPEED):
        raise ConfigError(
            f"train.dtype=bf16 with DeepSpeed {version}: it ignores the torch_autocast section and would train in fp32",
            fix=f"pip install 'deepspeed>={MIN_DEEPSPEED}', or train.dtype=fp32",
        )


def deepspeed_config(train: TrainConfig, cfg: EngineConfig, world_size: int) -> dict[str, Any]:
    """The DeepSpeed JSON generated from the typed config, or the user's JSON checked against it."""
    generated: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum,
        "train_batch_size": train.micro_batch_size * train.grad_accum * world_size,
        "gradient_clipping": train.clip_norm,
        "zero_optimization": {"stage": cfg.zero_stage},
        # bf16 here means autocast, as in the other engines: fp32 master weights, optimizer and gradient
        # reduction, bf16 matrix products. (DeepSpeed's "bf16" section would store bf16 weights instead.)
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "torch_autocast": {"enabled": train.dtype == "bf16", "dtype": "bfloat16", "lower_precision_safe_modules": []},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if not cfg.deepspeed_config:
        return generated
    user = json.loads(Path(cfg.deepspeed_config).read_text())
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping"):
        if key in user and user[key] != "auto" and user[key] != generated[key]:
            raise ConfigError(
                f"{cfg.deepspeed_config}: {key}={user[key]} disagrees with the training config ({generated[key]}, "
                "from train.micro_batch_size / train.grad_accum / train.clip_norm and the world size); "
                "remove it from the JSON or change train.*"
            )
        user[key] = generated[key]
    return user


class DeepSpeedEngine:
    """DeepSpeed ZeRO-1/2/3 around the same module, optimizer and schedule; DeepSpeed clips and skips non-finite
    steps itself (its overflow check runs on fp32 gradients as well) and reports both."""

    def __init__(
        self, module: TTTModule, train: TrainConfig, cfg: EngineConfig, info: DistInfo, device: torch.device,
        total_steps: int, share: TimeShare | None = None,
    ) -> None:
        import deepspeed

        self.draft = module.draft
        self.device = device
        self.ds_config = deepspeed_config(train, cfg, info.world_size)
        self.zero_stage = int(self.ds_config.get("zero_optimization", {}).get("stage", 0))
        optimizer, scheduler = make_optimizer(module, train, total_steps, share)
        client_optimizer: Any = optimizer
        client_scheduler: Any = scheduler
        if "optimizer" in self.ds_config:
            # DeepSpeed builds the optimizer from the user's JSON; the warmup-cosine must drive that one, so it is
            # handed over as a factory DeepSpeed calls with its optimizer.
            client_optimizer = None
            schedule = scheduler.lr_lambdas[0]
            client_scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule)  # noqa: E731
        if "scheduler" in self.ds_config:
            client_scheduler = None
        check_deepspeed_version(deepspeed.__version__, train.dtype)
        params = [p for p in module.parameters() if p.requires_grad]
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module.to(device),
            model_parameters=params,
            optimizer=client_optimizer,
            lr_scheduler=client_scheduler,
            config=self.ds_config,
        )

    def accumulating(self, boundary: bool) -> AbstractContextManager:
        """Nothing to do: DeepSpeed counts micro-steps itself and, under ZeRO-0/1, reduces gradients only at the
        accumulation boundary; ZeRO-2/3 reduce each micro-batch's gradients into their owners' partitions by design
        (they never hold a full gradient), and DeepSpeed's ``no_sync`` refuses them."""
        return nullcontext()

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.ds(batch)  # DeepSpeed applies the torch_autocast section itself

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        # The loop has already divided the loss by grad_accum; DeepSpeed must not do it a second time.
        self.ds.backward(loss, scale_wrt_gas=False)
        if not boundary:
            self.ds.step()  # only advances DeepSpeed's micro-step counter inside an accumulation window

    def step(self) -> StepResult:
        self.ds.step()
        # DeepSpeed's step has already read the norm on the host to decide on the update (its own per-step sync).
        norm = self.ds.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        return StepResult(norm, applied=self.ds.was_step_applied())

    @property
    def lr(self) -> float:
        return float(self.ds.get_lr()[0])

    def optimizer_numel(self) -> int | None:
        """Parameters ZeRO's optimizer holds (over all partitions); None for optimizers it did not wrap."""
        opt = self.optimizer
        if self.zero_stage == 3 and hasattr(opt, "fp16_groups"):
            return sum(p.ds_numel for group in opt.fp16_groups for p in group)
        if hasattr(opt, "bit16_groups"):
            return sum(p.numel() for group in opt.bit16_groups for p in group)
        return None

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Full trainable weights on every rank; under ZeRO-3 a collective (every rank must call it)."""
        if self.zero_stage == 3:
            import deepspeed

            params = [p for p in self.draft.parameters() if p.requires_grad]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                return {k: v.detach().cpu().clone() for k, v in self.draft.trainable_state_dict().items()}
        return {k: v.detach().cpu().clone() for k, v in self.draft.trainable_state_dict().items()}

    def save_state(self, folder: Path, info: DistInfo) -> None:
        # Every rank writes its own optimizer partition; the frozen embedding is left out (it is the verifier's).
        self.ds.save_checkpoint(
            str(folder / "deepspeed"), tag="state", client_state={}, save_latest=False, exclude_frozen_parameters=True
        )

    def load_state(self, folder: Path, weights: dict[str, torch.Tensor]) -> None:
        # DeepSpeed restores the module, its (partitioned) fp32 optimizer state and the client scheduler;
        # ``weights`` (the exported copy) are not needed. Non-strict: the frozen embedding was left out.
        path, _ = self.ds.load_checkpoint(str(folder / "deepspeed"), tag="state", load_module_strict=False)
        if path is None:
            raise FileNotFoundError(f"{folder / 'deepspeed'}: no DeepSpeed checkpoint with tag 'state'")


Engine = TorchEngine | DeepSpeedEngine


def build_engine(
    module: TTTModule, train: TrainConfig, cfg: EngineConfig, info: DistInfo, device: torch.device, total_steps: int,
    share: TimeShare | None = None,
) -> Engine:
    """The engine ``cfg.kind`` names; ``share``: a run sized by time, whose schedule follows the time spent."""
    if cfg.kind == "deepspeed":
        return DeepSpeedEngine(module, train, cfg, info, device, total_steps, share)
    return TorchEngine(module, train, cfg, info, device, total_steps, share)
