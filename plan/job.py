"""``fledge plan``: what a job will cost before it runs — disk for the cache, memory per GPU for each ZeRO stage,
FLOPs per token, hours per epoch — and which way to run it, without loading any weights.

    fledge plan preset=llama3.1-8b-instruct
    fledge plan preset=llama3.3-70b-instruct nodes=4 gpu_memory_gib=141 data.max_conversations=50000
    fledge plan verifier.name_or_path=org/model shape.hidden_size=5120 shape.intermediate_size=13824 ...

The plan composes the cache's and the training's settings (a preset gives both), reads the verifier's shape
(``models/shapes.py``), estimates the data from its source, and prices the job with ``plan/memory.py``. It prints
a table whose first column holds stable labels (``total_offline_gib``, ``recommended_zero_stage``, ...) and
writes the same figures to ``<out_dir>/plan.json``. An impossible job (nothing fits a GPU) is a plan too: it says
so and names what would fit.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fledge.core.errors import ConfigError
from fledge.core.record import SectionedReport
from fledge.data.cache import CacheConfig
from fledge.data.cache_job import CacheJobConfig
from fledge.data.sources import CODE_SOURCE, SHIPPED_SOURCE, DataConfig, load_conversations
from fledge.models.draft import Eagle3Config
from fledge.models.shapes import VerifierShape, resolve_shape
from fledge.models.verifier import DTYPES, VerifierConfig
from fledge.plan.memory import (
    CACHE_BYTES_PER_CONVERSATION,
    GIB,
    STAGES,
    JobShape,
    Memory,
    cache_bytes_per_token,
    ceil_div,
    draft_flops,
    draft_params,
    peak_memory,
    trainable_params,
    ttt_saved_bytes,
    verifier_flops,
)
from fledge.plan.regeneration import GpuRates, regeneration
from fledge.train.checkpoint import CheckpointConfig
from fledge.train.config import HeldOutConfig, TrainConfig
from fledge.train.engine import EngineConfig
from fledge.train.logger import LogConfig
from fledge.train.ttt import TTTConfig

log = logging.getLogger(__name__)

MODES = ("auto", "offline", "online")
TEMPLATE_TOKENS_PER_MESSAGE = 5
"""Chat-template tokens around each message (Llama-3: header start, role, header end, blank line, end of turn;
ChatML: im_start, role, newline, im_end, newline)."""
HEADROOM = 0.9
"""A stage is preferred when its peak stays under this share of the usable memory (the allocator fragments)."""
MAX_MICRO_BATCH = 64


@dataclass
class PlanJobConfig:
    out_dir: str | None = None
    """Where ``plan.json`` is written; None: beside the training run's folder (``<output_dir>/../plan``, so
    ``$FLEDGE_RUNS/<preset>/plan`` under a preset), or ``runs/plan`` without one."""
    # ---- the machines
    nodes: int = 1
    gpus_per_node: int = 8
    """One node of 8 GPUs by default, what the 8B presets are written for (the 70B preset: nodes=2)."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU (H100 80, H200 141)."""
    reserve_gib: float = 4.0
    """Held back on each GPU for what the plan does not count: the CUDA context and kernels' workspaces, NCCL
    buffers, the caching allocator's fragmentation."""
    peak_tflops: float = 989.0
    """One GPU's dense peak in the training dtype (H100 / H200 bf16: 989)."""
    mfu: float = 0.4
    """Share of the peak the job reaches (model FLOPs as ``fledge bench train`` counts them)."""
    memory_bandwidth_tbs: float = 3.35
    """One GPU's memory bandwidth in TB/s (H100 SXM 3.35, H200 4.8): a decoding step of the regeneration reads the
    weights and the KV cache once."""
    bandwidth_share: float = 0.7
    """Share of that bandwidth a decoding step streams at (an assumption of this plan, not a measurement: calibrate
    it against ``fledge bench regenerate`` on your GPUs)."""
    regenerate: bool | None = None
    """Size the regeneration of the answers with ``fledge regenerate regenerate.engine=vllm`` (prompts read, answers
    written, hours). None: when ``data.source`` does not exist yet (the presets train on answers regenerate
    writes)."""
    regenerate_batch: int = 64
    """Sequences decoded at once: ``regenerate.batch_size`` (the presets' 64; each part is one batch per turn),
    fewer when the KV cache of that many does not fit beside the weights."""
    disk_gib: float | None = None
    """Disk free for the offline cache; None: not checked."""
    mode: str = "auto"
    """'offline' (cache the verifier's states, then train on them), 'online' (a verifier replica on every training
    GPU computes them as training goes: ``fledge train data.mode=online``), or 'auto': recommend one."""
    # ---- the data
    conversations: int | None = None
    """Conversations in the cache. None: counted from ``data.source`` (up to ``data.max_conversations``)."""
    tokens_per_conversation: float | None = None
    """Mean tokens per conversation after the chat template and the cut at ``data.max_length``. None: estimated
    from the source's characters (``chars_per_token``, plus the template's tokens per message)."""
    chars_per_token: float = 4.0
    """Characters per token of the verifier's tokenizer, for the estimate (SmolLM2's 49k-token vocabulary gives
    4.17 on ShareGPT; larger vocabularies give more, so 4.0 errs toward more tokens and more disk)."""
    estimate_from: str | None = "sharegpt"
    """A source to count and measure instead of ``data.source`` while that one does not exist yet: the presets
    cache regenerate's answers to ShareGPT's prompts, so ShareGPT stands in for them until regenerate has run
    (the plan says so); None: ``data.source`` only."""
    shape: VerifierShape = field(default_factory=VerifierShape)
    """The verifier's shape, for one that cannot be read here (``shape.hidden_size=...``); a field given wins
    over the read one."""
    # ---- the job: the cache's and the training's settings, as the presets give them to those stages
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    data: DataConfig = field(default_factory=lambda: CacheJobConfig().data)
    cache: CacheConfig = field(default_factory=CacheConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ttt: TTTConfig = field(default_factory=TTTConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    validation: HeldOutConfig = field(default_factory=HeldOutConfig)
    """``validation.holdout`` conversations are cached but not trained on."""
    cache_dir: str | None = None
    """Read by ``fledge train`` only; here so that a training preset composes into the plan."""
    output_dir: str | None = None
    """The training run's folder (a training preset sets it); the plan goes beside it unless ``out_dir`` is set."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Read by ``fledge train`` only, like ``log``; here so that a training preset composes into the plan."""
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"nodes ({self.nodes}) and gpus_per_node ({self.gpus_per_node}) must be >= 1",
                              fix="give nodes=N gpus_per_node=G with N, G >= 1")
        if self.gpu_memory_gib <= 0 or not 0 <= self.reserve_gib < self.gpu_memory_gib:
            raise ConfigError(f"need gpu_memory_gib > 0 and 0 <= reserve_gib < gpu_memory_gib (got "
                              f"{self.gpu_memory_gib}, {self.reserve_gib})")
        if self.peak_tflops <= 0 or not 0 < self.mfu <= 1:
            raise ConfigError(f"need peak_tflops > 0 and 0 < mfu <= 1 (got {self.peak_tflops}, {self.mfu})")
        if self.memory_bandwidth_tbs <= 0 or not 0 < self.bandwidth_share <= 1 or self.regenerate_batch < 1:
            raise ConfigError(f"need memory_bandwidth_tbs > 0, 0 < bandwidth_share <= 1 and regenerate_batch >= 1 "
                              f"(got {self.memory_bandwidth_tbs}, {self.bandwidth_share}, {self.regenerate_batch})")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.conversations is not None and self.conversations < 1:
            raise ConfigError(f"conversations must be >= 1 or null, got {self.conversations}")
        if self.tokens_per_conversation is not None and self.tokens_per_conversation <= 0:
            raise ConfigError(f"tokens_per_conversation must be > 0 or null, got {self.tokens_per_conversation}")
        if self.chars_per_token <= 0:
            raise ConfigError(f"chars_per_token must be > 0, got {self.chars_per_token}")
        if self.disk_gib is not None and self.disk_gib <= 0:
            raise ConfigError(f"disk_gib must be > 0 or null, got {self.disk_gib}")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def plan_dir(self) -> Path:
        if self.out_dir:
            return Path(self.out_dir)
        return Path(self.output_dir).parent / "plan" if self.output_dir else Path("runs/plan")


# ------------------------------------------------------------------------------------------------------------ data
@dataclass
class JobPlan(SectionedReport):
    """What ``fledge plan`` prints and writes to ``<out_dir>/plan.json``: every figure of the table, by section."""

    FORMAT = 1
    FILE = "plan.json"
    WHAT = "fledge plan"
    COMMAND = "fledge plan"
    REQUIRED = frozenset({"memory", "recommendation"})

    verifier: dict[str, Any]
    """Its name, shape (and where the shape came from), parameters in all and active per token."""
    hardware: dict[str, Any]
    """Nodes, GPUs, memory per GPU (and usable), the peak TFLOP/s and the MFU the hours assume."""
    job: dict[str, Any]
    """The training step priced: micro-batch, length, TTT steps, dtype, optimizer, the draft's parameters."""
    data: dict[str, Any]
    """Conversations, tokens per conversation and per epoch, the loss's share, how they were estimated."""
    disk: dict[str, Any]
    """The offline cache: bytes per token and GiB in all."""
    memory: dict[str, Any]
    """``{offline|online: {zero0..zero3: {total_gib, fits, peak_at, terms_gib, moments_gib} | None}}``."""
    activations_saved_gib: dict[str, float]
    """What the backward keeps of one micro-batch, by term."""
    compute: dict[str, Any]
    """FLOPs per token, hours per epoch and in all (offline and online), the cache's build time and read rate."""
    recommendation: dict[str, Any]
    """The way to run it (mode, ZeRO stage, micro-batch, overrides) and why, or what would fit."""
    regeneration: dict[str, Any] | None = None
    """The answers regenerated through vLLM first (``regeneration``): tokens, the replica, its decoding step,
    tokens/s and hours; None when the plan does not regenerate."""
    format: int = FORMAT


@dataclass
class DataEstimate:
    conversations: int
    lengths: list[int]
    """Estimated tokens of each conversation read (one entry per conversation; the mean when given)."""
    loss_fraction: float
    """Share of the tokens the loss counts (the assistant's), for the FLOPs of the head."""
    how: str
    """Where the figures come from, in words."""
    stand_in: bool = False
    """``data.source`` does not exist yet and ``estimate_from`` was measured instead."""

    @property
    def tokens_per_conversation(self) -> float:
        return sum(self.lengths) / len(self.lengths)


def _source_exists(source: str) -> bool:
    if source in ("sharegpt", "mtbench", "humaneval", SHIPPED_SOURCE, CODE_SOURCE) or source.startswith("hf:"):
        return True
    return Path(source).expanduser().exists()


def estimate_data(cfg: PlanJobConfig) -> DataEstimate:
    """Conversations and tokens per conversation: given, or counted and estimated from the source."""
    if cfg.conversations is not None and cfg.tokens_per_conversation is not None:
        mean = min(cfg.tokens_per_conversation, cfg.data.max_length)
        return DataEstimate(cfg.conversations, [round(mean)], 1.0, "given (conversations, tokens_per_conversation)")
    source = cfg.data.describe()
    note = f"data.source {source}"
    data = cfg.data
    missing = [name for name in cfg.data.source_names() if not _source_exists(name)]
    if missing:
        if cfg.estimate_from is None:
            raise ConfigError(
                f"data.source {', '.join(missing)} does not exist yet: nothing to count conversations or tokens from",
                fix="give conversations=N tokens_per_conversation=M, or estimate_from=<a source to measure instead>",
            )
        note = f"{cfg.estimate_from} (data.source {', '.join(missing)} does not exist yet)"
        source = cfg.estimate_from
        data = dataclasses.replace(cfg.data, source=source, sources=None)
    conversations, report = load_conversations(data)
    if not conversations:
        raise ConfigError(f"{source}: no usable conversation ({report.summary()})", fix="check data.source")
    lengths, assistant, total = [], 0, 0
    for conv in conversations:
        chars = sum(len(m["content"]) for m in conv)
        tokens = chars / cfg.chars_per_token + TEMPLATE_TOKENS_PER_MESSAGE * len(conv)
        lengths.append(max(2, min(cfg.data.max_length, round(tokens))))
        assistant += sum(len(m["content"]) for m in conv if m["role"] == "assistant")
        total += chars
    stand_in = data is not cfg.data
    count = cfg.conversations if cfg.conversations is not None else len(conversations)
    if stand_in and cfg.conversations is None and cfg.data.max_conversations:
        count = cfg.data.max_conversations  # the job's own size: what regenerate will write
    how = f"{len(conversations):,} conversations of {note}"
    if cfg.tokens_per_conversation is not None:
        lengths = [round(min(cfg.tokens_per_conversation, cfg.data.max_length))]
        how += "; tokens per conversation given"
    else:
        how += (f"; tokens = characters / {cfg.chars_per_token:g} + {TEMPLATE_TOKENS_PER_MESSAGE} per message, "
                f"at most data.max_length {cfg.data.max_length:,}")
    if cfg.conversations is not None:
        how += f"; {count:,} conversations given"
    elif count != len(conversations):
        how += f"; {count:,} conversations as data.max_conversations says"
    return DataEstimate(count, lengths, assistant / max(1, total), how, stand_in=stand_in)


# ------------------------------------------------------------------------------------------------------- the plan
def draft_config(shape: VerifierShape, cfg: PlanJobConfig) -> Eagle3Config:
    """The draft ``fledge train`` builds for this verifier (``Eagle3Config.from_verifier``'s sizes)."""
    return Eagle3Config(
        hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim, vocab_size=shape.vocab_size,
        draft_vocab_size=min(cfg.cache.draft_vocab_size, shape.vocab_size), target_hidden_size=shape.hidden_size,
    )


def batch_shape(cfg: PlanJobConfig) -> tuple[int, int]:
    """(sequences, tokens each) of the largest micro-batch: ``data.max_length`` tokens, and as many sequences as
    ``train.max_tokens`` allows when it is set (``train/sampler.py``), else ``train.micro_batch_size``."""
    length = cfg.data.max_length
    if cfg.train.max_tokens > 0:
        return max(1, cfg.train.max_tokens // length), length
    return cfg.train.micro_batch_size, length


def stage_available(stage: int, cfg: PlanJobConfig) -> bool:
    # DeepSpeed runs AdamW only (train/loop.py refuses Muon with it)
    return stage == 0 or cfg.train.optimizer == "adamw"


def engine_overrides(stage: int, world: int) -> str:
    if stage == 0:
        return "engine.kind=ddp" if world > 1 else "engine.kind=single"
    return f"engine.kind=deepspeed engine.zero_stage={stage}"


def memory_table(job: JobShape, cfg: PlanJobConfig) -> dict[str, dict[int, Memory | None]]:
    return {
        mode: {s: peak_memory(job, s, cfg.world, mode == "online") if stage_available(s, cfg) else None
               for s in STAGES}
        for mode in ("offline", "online")
    }


def choose_stage(table: dict[int, Memory | None], usable: float) -> int | None:
    """The least-sharded stage that fits with headroom (DDP and ZeRO-1/2 move the same bytes per step; ZeRO-3 adds
    an all-gather of the weights in every forward and backward, K times over the unroll), else the fitting
    stage that needs least; None when none fits."""
    fitting = [s for s, m in table.items() if m is not None and m.total <= usable]
    roomy = [s for s in fitting if table[s].total <= HEADROOM * usable]
    if roomy:
        return min(roomy)
    return min(fitting, key=lambda s: table[s].total) if fitting else None


def largest_fitting(fits: Any, low: int, high: int) -> int | None:
    """The largest n in [low, high] with fits(n) (fits is monotone: true up to some n), or None."""
    if not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def what_would_fit(job: JobShape, cfg: PlanJobConfig, mode: str, usable: float) -> list[str]:
    """For a job that fits no stage in ``mode``: the changes that would make it fit."""
    online = mode == "online"
    stages = [s for s in STAGES if stage_available(s, cfg)]
    best = min(stages, key=lambda s: peak_memory(job, s, cfg.world, online).total)
    need = peak_memory(job, best, cfg.world, online).total
    lines = [f"the least it needs is {need / GIB:.1f} GiB per GPU ({mode}, ZeRO-{best}, micro-batch "
             f"{job.micro_batch}); {usable / GIB:.1f} GiB are usable (gpu_memory_gib - reserve_gib)"]
    verifier = job.verifier_bytes * job.verifier.params()
    if online and verifier > usable:
        k = ceil_div(verifier, usable)
        lines.append(
            f"the verifier alone takes {verifier / GIB:.1f} GiB: online it would need its layers spread over {k} "
            f"GPUs per replica (verifier.device_map=auto), which this plan does not price (it puts one replica on "
            f"every training GPU); offline, the cache runs it with verifier.device_map=auto over {k} GPUs"
        )
        lines.append("no data.max_length or micro-batch fits online: the verifier's weights alone exceed a GPU")
    if online:
        # what the same job needs offline (the cache supplies the verifier's states; no replica on the GPU)
        offline = {s: peak_memory(job, s, cfg.world, False).total for s in stages}
        fitting = [s for s in stages if offline[s] <= usable]
        if fitting:
            s = min(fitting)
            lines.append(f"offline it fits: ZeRO-{s} needs {offline[s] / GIB:.1f} GiB per GPU (mode=offline "
                         f"{engine_overrides(s, cfg.world)})")
        else:
            s = min(offline, key=offline.__getitem__)
            n = largest_fitting(lambda n: peak_memory(dataclasses.replace(job, micro_batch=1, seq_len=n), s,
                                                      cfg.world, False).total <= usable, 16, job.seq_len)
            least = peak_memory(dataclasses.replace(job, micro_batch=1, seq_len=16), s, cfg.world, False).total
            lines.append(f"offline it does not fit either: ZeRO-{s} needs {offline[s] / GIB:.1f} GiB per GPU"
                         + (f"; offline data.max_length={n} fits at micro-batch 1" if n else
                            f", and {least / GIB:.1f} GiB at 16 tokens: no data.max_length fits offline"))

    def fits_with(**changes: Any) -> bool:
        return peak_memory(dataclasses.replace(job, **changes), best, cfg.world, online).total <= usable

    if job.micro_batch > 1 and fits_with(micro_batch=1):
        b = largest_fitting(lambda n: fits_with(micro_batch=n), 1, job.micro_batch)
        lines.append(f"train.micro_batch_size={b} fits (raise train.grad_accum to keep the global batch)")
    length = largest_fitting(lambda n: fits_with(micro_batch=1, seq_len=n), 16, job.seq_len)
    if length is not None:
        lines.append(f"data.max_length={length} fits at micro-batch 1 ({mode}, ZeRO-{best})")
    one = dataclasses.replace(job, micro_batch=1)
    least = ceil_div(peak_memory(one, best, cfg.world, online).total, GIB) + cfg.reserve_gib
    lines.append(f"GPUs of at least {least:g} GiB fit micro-batch 1 at data.max_length={job.seq_len} (gpu_memory_gib)")
    if stage_available(3, cfg):
        more = next((w for w in (2**i for i in range(1, 17)) if w > cfg.world
                     and peak_memory(job, 3, w, online).total <= usable), None)
        if more is not None:
            lines.append(f"{more} GPUs with ZeRO-3 fit it (nodes x gpus_per_node): only the weights, gradients' "
                         "partitions and optimizer states shrink with more GPUs")
        else:
            lines.append("more GPUs do not help: the activations, the teacher head and the gathered weights are "
                         "not sharded")
    return lines


def make_plan(cfg: PlanJobConfig) -> JobPlan:
    shape, shape_source = resolve_shape(cfg.verifier, cfg.shape)
    draft = draft_config(shape, cfg)
    data = estimate_data(cfg)
    micro_batch, seq_len = batch_shape(cfg)
    dtype = "fp32" if cfg.train.dtype == "fp32" else "bf16"  # auto takes bf16 on GPUs
    verifier_dtype = DTYPES.get(cfg.verifier.dtype)
    job = JobShape(draft, shape, micro_batch, seq_len, cfg.ttt.ttt_steps, dtype, cfg.train.optimizer,
                   verifier_bytes=verifier_dtype.itemsize if verifier_dtype is not None else 2)
    usable = (cfg.gpu_memory_gib - cfg.reserve_gib) * GIB
    world = cfg.world

    # ---- disk
    storage = DTYPES[cfg.cache.storage_dtype].itemsize
    per_token = cache_bytes_per_token(shape.hidden_size, storage)
    tokens_all = data.conversations * data.tokens_per_conversation
    disk = per_token * tokens_all + CACHE_BYTES_PER_CONVERSATION * data.conversations

    # ---- memory
    table = memory_table(job, cfg)
    stage_of = {mode: choose_stage(table[mode], usable) for mode in table}

    # ---- compute
    held_out = cfg.validation.holdout if cfg.validation.holdout < data.conversations else 0
    train_conversations = max(1, data.conversations - held_out)
    mean_draft = sum(draft_flops(draft, n, cfg.ttt.ttt_steps, data.loss_fraction) for n in data.lengths)
    mean_draft /= len(data.lengths)
    mean_verifier = sum(verifier_flops(shape, n) for n in data.lengths) / len(data.lengths)
    rate = world * cfg.peak_tflops * 1e12 * cfg.mfu
    epoch_offline = train_conversations * mean_draft / rate
    epoch_online = train_conversations * (mean_draft + mean_verifier) / rate
    # the cache: one verifier replica per GPU when it fits one, else one per k GPUs running at one GPU's speed
    verifier_bytes = job.verifier_bytes * shape.params()
    cache_gpus = max(1, ceil_div(verifier_bytes, usable))
    replicas = max(1, world // cache_gpus)
    cache_seconds = data.conversations * mean_verifier / (replicas * cfg.peak_tflops * 1e12 * cfg.mfu)
    epochs = cfg.train.epochs if cfg.train.max_steps == 0 else None
    gpu = GpuRates(usable_bytes=usable, flops=cfg.peak_tflops * 1e12 * cfg.mfu,
                   bandwidth=cfg.memory_bandwidth_tbs * 1e12 * cfg.bandwidth_share)
    regen = (regeneration(shape, job.verifier_bytes, data.conversations, data.tokens_per_conversation,
                          data.loss_fraction, gpu, cfg.world, cfg.regenerate_batch)
             if (data.stand_in if cfg.regenerate is None else cfg.regenerate) else None)
    total_offline = cache_seconds + (epochs or 0) * epoch_offline
    total_online = (epochs or 0) * epoch_online
    tokens_per_s = train_conversations * data.tokens_per_conversation / epoch_offline
    compute = {
        "draft_flops_per_token": mean_draft / data.tokens_per_conversation,
        "verifier_flops_per_token": mean_verifier / data.tokens_per_conversation,
        "time_per_epoch_offline_h": epoch_offline / 3600,
        "time_per_epoch_online_h": epoch_online / 3600,
        "cache_build_h": cache_seconds / 3600,
        "cache_gpus_per_verifier": cache_gpus,
        "epochs": epochs,
        "train_time_offline_h": total_offline / 3600 if epochs else None,
        "train_time_online_h": total_online / 3600 if epochs else None,
        "cache_read_gib_per_s": tokens_per_s * per_token / GIB,
        "regenerate_h": regen["hours"] if regen else None,
    }

    # ---- recommendation
    fits = {mode: stage_of[mode] is not None for mode in table}
    disk_ok = cfg.disk_gib is None or disk <= cfg.disk_gib * GIB
    reasons: list[str] = []
    if cfg.mode != "auto":
        mode = cfg.mode
        reasons.append(f"mode={mode} was asked for")
    elif fits["offline"] and disk_ok and (not fits["online"] or not epochs or total_offline <= total_online):
        mode = "offline"
        if fits["online"] and epochs:
            reasons.append(f"offline runs the verifier once ({_h(cache_seconds)} for the cache) instead of in every "
                           f"epoch ({_h(epoch_online - epoch_offline)} each online): {_h(total_offline)} against "
                           f"{_h(total_online)} in all")
        elif not fits["online"]:
            reasons.append("online does not fit: the verifier's replica and the training state exceed a GPU")
        reasons.append(f"the cache takes {disk / GIB:,.0f} GiB of disk"
                       + (f" of the {cfg.disk_gib:,.0f} GiB free" if cfg.disk_gib else " (disk_gib not given)"))
    elif fits["online"]:
        mode = "online"
        if not disk_ok:
            reasons.append(f"the cache ({disk / GIB:,.0f} GiB) exceeds the disk ({cfg.disk_gib:,.0f} GiB)")
        elif not fits["offline"]:
            reasons.append("offline does not fit")
        else:
            reasons.append(f"online takes {_h(total_online)} against {_h(total_offline)} offline "
                           "(the cache costs as much as the epochs it saves)")
        reasons.append("online: fledge train data.mode=online runs the verifier beside the draft")
    else:
        mode = "offline" if disk_ok else "online"
    stage = stage_of[mode]
    recommendation: dict[str, Any] = {"mode": mode, "fits": stage is not None, "zero_stage": stage}
    if stage is not None:
        online = mode == "online"

        def fits_micro(n: int, share: float = 1.0) -> bool:
            return peak_memory(dataclasses.replace(job, micro_batch=n), stage, world, online).total <= share * usable

        largest = largest_fitting(fits_micro, 1, MAX_MICRO_BATCH)
        # The micro-batch is a hyperparameter (the global batch is world x accumulation x micro-batch): keep the
        # job's when it fits, and only report how far it could go.
        micro = micro_batch if fits_micro(micro_batch) else largest
        chosen = peak_memory(dataclasses.replace(job, micro_batch=micro), stage, world, online)
        recommendation.update(micro_batch=micro, largest_micro_batch=largest, memory_gib=chosen.total / GIB)
        reasons.append(
            f"ZeRO-{stage} ({engine_overrides(stage, world)}): {chosen.total / GIB:.1f} of {usable / GIB:.1f} usable "
            f"GiB per GPU, peak at the {chosen.moment}"
            + _stage_reason(stage, table[mode], usable))
        if micro == micro_batch:
            more = peak_memory(dataclasses.replace(job, micro_batch=micro + 1), stage, world, online).total
            reasons.append(
                f"micro-batch {micro}, the job's own; up to {largest} fits at {seq_len:,} tokens (each sequence adds "
                f"{(more - chosen.total) / GIB:.1f} GiB of activations, which no ZeRO stage shards)")
        else:
            reasons.append(f"micro-batch {micro}: the job's {micro_batch} does not fit at {seq_len:,} tokens (raise "
                           "train.grad_accum to keep the global batch)")
        recommendation["overrides"] = (f"{engine_overrides(stage, world)} train.micro_batch_size={micro}"
                                       + (" data.mode=online" if online else ""))
        asked = 0 if cfg.engine.kind != "deepspeed" else cfg.engine.zero_stage
        if asked != stage and table[mode][asked] is not None:
            own = table[mode][asked]
            reasons.append(f"the job's own engine ({engine_overrides(asked, world)}) needs {own.total / GIB:.1f} GiB: "
                           + ("it fits too" if own.total <= usable else "it does not fit"))
    else:
        reasons.append(f"nothing fits {mode}: no ZeRO stage holds the job in {usable / GIB:.1f} GiB per GPU")
        recommendation["what_would_fit"] = what_would_fit(job, cfg, mode, usable)
    recommendation["reasons"] = reasons

    return JobPlan(
        verifier={"name": cfg.verifier.name_or_path, "shape": dataclasses.asdict(shape), "shape_from": shape_source,
                     "params": shape.params(), "active_params": shape.active_params()},
        hardware={"nodes": cfg.nodes, "gpus_per_node": cfg.gpus_per_node, "world": world,
                     "gpu_memory_gib": cfg.gpu_memory_gib, "reserve_gib": cfg.reserve_gib,
                     "usable_gib": usable / GIB, "peak_tflops": cfg.peak_tflops, "mfu": cfg.mfu},
        job={"micro_batch": micro_batch, "seq_len": seq_len, "ttt_steps": cfg.ttt.ttt_steps, "dtype": dtype,
                "optimizer": cfg.train.optimizer, "draft_vocab_size": draft.draft_vocab_size,
                "draft_params": draft_params(draft), "trainable_params": trainable_params(draft)},
        data={"conversations": data.conversations, "train_conversations": train_conversations,
                 "tokens_per_conversation": data.tokens_per_conversation,
                 "tokens_per_epoch": train_conversations * data.tokens_per_conversation,
                 "loss_fraction": data.loss_fraction, "estimate": data.how},
        disk={"cache_bytes_per_token": per_token, "cache_disk_gib": disk / GIB,
                 "storage_dtype": cfg.cache.storage_dtype},
        memory={mode_: {f"zero{s}": (None if m is None else {
            "total_gib": m.total / GIB, "fits": m.total <= usable, "peak_at": m.moment,
            "terms_gib": {k: v / GIB for k, v in m.terms.items()},
            "moments_gib": {k: v / GIB for k, v in m.moments.items()},
        }) for s, m in stages.items()} for mode_, stages in table.items()},
        activations_saved_gib={k: v / GIB for k, v in ttt_saved_bytes(job).items()},
        compute=compute,
        recommendation=recommendation,
        regeneration=regen,
    )


def _stage_reason(stage: int, table: dict[int, Memory | None], usable: float) -> str:
    lower = [s for s in range(stage) if table[s] is not None]
    if lower:
        over = [s for s in lower if table[s].total > HEADROOM * usable]
        if over:
            return (f"; ZeRO-{over[-1]} would need {table[over[-1]].total / GIB:.1f} GiB "
                    f"({'over' if table[over[-1]].total > usable else 'within 10 % of'} the usable memory)")
    if stage < 3 and table[3] is not None:
        saved = table[stage].total - table[3].total
        return (f"; ZeRO-3 would save {saved / GIB:.1f} GiB at the price of gathering the weights in every "
                "forward and backward of the unroll")
    return ""


# ------------------------------------------------------------------------------------------------------- printing
TERMS = ("verifier_weights", "draft_weights", "frozen_embedding", "teacher_head", "master_weights",
         "optimizer_states", "gradients", "engine_buffers", "step_buffers", "batch", "ttt_activations")


def _mlp_words(s: dict[str, Any]) -> str:
    if not s.get("num_experts"):
        return f"MLP {s['intermediate_size']}"
    dense = f", {s['num_dense_layers']} dense layers of MLP {s['intermediate_size']}" if s["num_dense_layers"] else ""
    return f"{s['num_experts']} experts of MLP {s['moe_intermediate_size']}, {s['num_experts_per_tok']} per token{dense}"


def _active_words(v: dict[str, Any]) -> str:
    active = v.get("active_params", v["params"])
    return f", {active / 1e9:.2f} B active per token" if active != v["params"] else ""


def render(plan: JobPlan) -> str:
    v, hw, job, data, disk = plan.verifier, plan.hardware, plan.job, plan.data, plan.disk
    s = v["shape"]
    rec, comp = plan.recommendation, plan.compute
    p = job["draft_params"]
    lines = [
        f"job       {v['name']} on {hw['nodes']} node(s) x {hw['gpus_per_node']} GPU(s), {hw['gpu_memory_gib']:g} GiB "
        f"each ({hw['usable_gib']:.1f} usable), {hw['peak_tflops']:g} TFLOP/s at MFU {hw['mfu']:.2f}",
        f"verifier  hidden {s['hidden_size']}, {s['num_hidden_layers']} layers, {s['num_attention_heads']}/"
        f"{s['num_key_value_heads']} heads x {s['head_dim']}, {_mlp_words(s)}, vocabulary "
        f"{s['vocab_size']:,}: {v['params'] / 1e9:.2f} B parameters{_active_words(v)} (shape from {v['shape_from']})",
        f"draft     {job['trainable_params'] / 1e9:.3f} B trained parameters (fc {p['fc'] / 1e6:.0f} M, attention "
        f"{p['attention'] / 1e6:.0f} M, MLP {p['mlp'] / 1e6:.0f} M, lm_head {p['lm_head'] / 1e6:.0f} M), draft "
        f"vocabulary {job['draft_vocab_size']:,}, TTT {job['ttt_steps']}, {job['dtype']}"
        f"{' autocast' if job['dtype'] == 'bf16' else ''}, {job['optimizer']}",
        f"batch     micro-batch {job['micro_batch']} x {job['seq_len']:,} tokens (data.max_length), every position "
        "counted by the loss (the worst case)",
        "",
        "data",
        _row("conversations", f"{data['conversations']:,}", data["estimate"]),
        _row("train_conversations", f"{data['train_conversations']:,}", "less validation.holdout"),
        _row("tokens_per_conversation", f"{data['tokens_per_conversation']:,.0f}",
             "override with tokens_per_conversation=..."),
        _row("tokens_per_epoch", f"{data['tokens_per_epoch'] / 1e6:,.1f} M"),
        "disk (offline cache)",
        _row("cache_bytes_per_token", f"{disk['cache_bytes_per_token']:,}",
             f"3 aux states + the final state, {s['hidden_size']} wide, {disk['storage_dtype']}; token id and mask"),
        _row("cache_disk_gib", f"{disk['cache_disk_gib']:,.1f}"),
        *_regeneration_rows(plan.regeneration),
        "",
        "memory per GPU (GiB)" + "".join(f"{f'zero{st}':>10}" for st in STAGES)
        + "    (zero0: DDP, or one process on one GPU)",
    ]
    offline, online = plan.memory["offline"], plan.memory["online"]

    def cells(table: dict[str, Any], fn: Any) -> str:
        return "".join(f"{('n/a' if table[f'zero{st}'] is None else fn(table[f'zero{st}'])):>10}" for st in STAGES)

    for term in TERMS:
        if term == "verifier_weights":
            continue
        lines.append(f"  {term:<18}" + cells(offline, lambda m, t=term: f"{m['terms_gib'][t]:.2f}"))
    lines += [
        f"  {'total_offline_gib':<18}" + cells(offline, lambda m: f"{m['total_gib']:.2f}"),
        f"  {'peak_at_offline':<18}" + cells(offline, lambda m: m["peak_at"].split()[0]),
        f"  {'fits_offline':<18}" + cells(offline, lambda m: "yes" if m["fits"] else "no"),
        f"  {'verifier_weights':<18}" + cells(online, lambda m: f"{m['terms_gib']['verifier_weights']:.2f}")
        + "    (online: a verifier replica per GPU)",
        f"  {'total_online_gib':<18}" + cells(online, lambda m: f"{m['total_gib']:.2f}"),
        f"  {'fits_online':<18}" + cells(online, lambda m: "yes" if m["fits"] else "no"),
        "",
        f"activations saved for the backward (GiB, {job['ttt_steps']} TTT steps, micro-batch {job['micro_batch']} x "
        f"{job['seq_len']:,})",
    ]
    for term, value in sorted(plan.activations_saved_gib.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {value:8.2f}  {term}")
    hours = (lambda x: "n/a" if x is None else f"{x:.3g}")
    lines += [
        "",
        "compute",
        _row("draft_flops_per_token", f"{comp['draft_flops_per_token']:.3g}",
             f"forward + backward over {job['ttt_steps']} TTT steps and the teacher head, at the data's lengths"),
        _row("verifier_flops_per_token", f"{comp['verifier_flops_per_token']:.3g}", "its forward, once per token"),
        _row("time_per_epoch_offline_h", hours(comp["time_per_epoch_offline_h"])),
        _row("time_per_epoch_online_h", hours(comp["time_per_epoch_online_h"]), "draft + verifier forward"),
        _row("cache_build_h", hours(comp["cache_build_h"]),
             f"{comp['cache_gpus_per_verifier']} GPU(s) per verifier replica"),
        _row("train_time_offline_h", hours(comp["train_time_offline_h"]),
             f"cache + {comp['epochs']:g} epochs" if comp["epochs"] else "train.max_steps set: epochs unknown"),
        _row("train_time_online_h", hours(comp["train_time_online_h"])),
        *([_row("regenerate_h", hours(comp["regenerate_h"]), "before either (regeneration above)")]
          if comp.get("regenerate_h") is not None else []),
        _row("cache_read_gib_per_s", f"{comp['cache_read_gib_per_s']:.2f}", "all ranks together, offline"),
        "",
        "recommendation",
        _row("recommended_mode", rec["mode"]),
        _row("recommended_fits", "yes" if rec["fits"] else "no"),
    ]
    if rec["fits"]:
        lines += [
            _row("recommended_zero_stage", str(rec["zero_stage"])),
            _row("recommended_micro_batch", str(rec["micro_batch"])),
            _row("largest_micro_batch", str(rec["largest_micro_batch"]), "that fits this stage"),
            _row("recommended_memory_gib", f"{rec['memory_gib']:.2f}"),
            _row("recommended_overrides", rec["overrides"]),
        ]
    lines += ["  why:"] + [f"    - {r}" for r in rec["reasons"]]
    if not rec["fits"]:
        lines += ["  what would fit:"] + [f"    - {r}" for r in rec["what_would_fit"]]
    return "\n".join(lines)


def _regeneration_rows(r: dict[str, Any] | None) -> list[str]:
    if r is None:
        return []
    fit = ("" if r["sequences"] == r["sequences_that_fit"] else
           f"regenerate_batch; {r['sequences_that_fit']:,} fit the KV cache" if r["sequences"] < r["sequences_that_fit"]
           else "as many as fit the KV cache")
    return [
        "regeneration (fledge regenerate regenerate.engine=vllm, before the cache)",
        _row("regenerate_answer_tokens", f"{r['answer_tokens'] / 1e6:,.1f} M", "the loss's share of the tokens"),
        _row("regenerate_prompt_tokens", f"{r['prompt_tokens'] / 1e6:,.1f} M", "read once (prefill)"),
        _row("regenerate_replicas", f"{r['replicas']} x {r['gpus_per_replica']}", "replicas x GPUs each"),
        _row("regenerate_sequences", f"{r['sequences']:,}", fit),
        _row("regenerate_step_ms", f"{r['step_ms']:.1f}", f"{r['bound']}-bound: weights + KV cache read, or FLOPs"),
        _row("regenerate_tokens_per_s", f"{r['tokens_per_s']:,.0f}",
             f"{r['tokens_per_s_per_gpu']:,.0f} per GPU, all replicas decoding"),
        _row("regenerate_h", f"{r['hours']:.3g}", f"prefill {r['prefill_h']:.2g} h of it"),
        f"  run it as: fledge regenerate preset=... {r['overrides']}",
    ]


def _h(seconds: float) -> str:
    return f"{seconds / 3600:.3g} h"


def _row(label: str, value: str, note: str = "") -> str:
    return f"  {label:<26}{value:>14}" + (f"   {note}" if note else "")


def run(cfg: PlanJobConfig) -> JobPlan:
    plan = make_plan(cfg)
    print(render(plan), flush=True)
    print(f"\n{JobPlan.FILE}: {plan.save(cfg.plan_dir)}")
    return plan
