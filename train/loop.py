"""``fledge train``: the training loop of the EAGLE-3 draft, in one function that reads top to bottom.

    fledge train cache_dir=runs/cache output_dir=runs/train train.max_steps=2000
    fledge train data.mode=online data.source=chats.jsonl verifier.name_or_path=/models/...   (no cache: data/online.py)
    torchrun --nproc_per_node 2 -m fledge.launch.cli train engine.kind=ddp ...        (launch/torchrun.sh)
    deepspeed --no_local_rank --module fledge.launch.cli train engine.kind=deepspeed ...  (launch/deepspeed.sh)

The run directory ends up with ``checkpoints/``, ``metrics.jsonl``, ``wandb/`` and ``draft/`` (the final weights, in
the checkpoint weight format; ``models.draft_folder.load_draft`` reads it). ``TrainJobConfig``, the root of the
stage's config, composes each component's dataclass; ``conf/train.yaml`` fills it.

SIGTERM or SIGUSR1 (a scheduler's notice) during the loop ends the run at the next optimizer-step boundary, every rank
at the same step: that step is logged and checkpointed, and the process exits with status 0 without writing
``draft/``; rerunning the same command resumes from the checkpoint (``train/stopping.py``, ``launch/slurm.sbatch``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from fledge.core.config import fields_of
from fledge.core.dist import DistInfo, all_reduce_sum, barrier, cleanup
from fledge.core.errors import ConfigError, MismatchError
from fledge.core.host_memory import keep_freed_memory
from fledge.data.cache import CacheConfig, CacheReader
from fledge.data.online import FirstEpochSource, OnlineSource, TrainDataConfig
from fledge.data.vocab import build_draft_vocab
from fledge.models.draft import Eagle3Config, Eagle3Draft
from fledge.models.draft_folder import CHECKPOINTS, latest_checkpoint, read_draft_config, write_final_draft
from fledge.models.verifier import (
    VerifierConfig,
    check_fingerprint,
    load_embed_and_head,
    load_final_norm,
    load_layer,
)
from fledge.train import sampler
from fledge.train.checkpoint import (
    CheckpointConfig,
    TrainState,
    check_resume,
    load_checkpoint,
    remove_stale,
    save_checkpoint,
)
from fledge.train.config import HeldOutConfig, TrainConfig
from fledge.train.engine import (
    DTYPE_NAMES,
    DeepSpeedEngine,
    Engine,
    EngineConfig,
    TTTModule,
    build_engine,
    check_compute_dtype,
    choose_train_dtype,
    init_process_group,
)
from fledge.train.logger import LogConfig, MetricsLogger, with_tau
from fledge.train.stopping import SIGNAL, TIME_BUDGET, TIME_LIMIT, Preempted, PreemptionSignals, TimeShare, stop_reason
from fledge.train.ttt import TTTConfig

log = logging.getLogger(__name__)


TrainingData = CacheReader | OnlineSource | FirstEpochSource
"""What the loop trains on: a cache on disk, or the verifier run as the loop asks (``data.mode=online``, and
``cache_first_epoch`` in its first epoch)."""


@dataclass
class TrainJobConfig:
    cache_dir: str = "runs/cache"
    """The hidden-state cache built by ``fledge cache`` (it names the verifier, aux layers and draft vocabulary);
    read with ``data.mode=cache``, the default."""
    data: TrainDataConfig = field(default_factory=TrainDataConfig)
    """``data.mode``: ``cache``, ``online`` or ``cache_first_epoch`` (which writes the cache at ``cache_dir``). Online,
    the other ``data.*`` fields name the conversations, read as ``fledge cache`` reads them."""
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    """The verifier run in the training process with ``data.mode=online`` (each rank holds a replica, or spreads it
    with ``verifier.device_map=auto``); a cache names its own."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """With ``data.mode=online``, the settings ``fledge cache`` would build the cache with: the draft vocabulary
    (``cache.draft_vocab_size``), the dtype states are rounded to (``cache.storage_dtype``) and the forward batching
    (``cache.batch_tokens``, ``cache.max_batch_size``), so that the states are a cache's; ``cache.dir`` and
    ``cache.device`` are not read (``cache_first_epoch`` writes to ``cache_dir``; the verifier runs on the training
    device)."""
    output_dir: str = "runs/train"
    """Run directory: checkpoints/, metrics.jsonl, wandb/ and the final draft/."""
    train: TrainConfig = field(default_factory=TrainConfig)
    ttt: TTTConfig = field(default_factory=TTTConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    validation: HeldOutConfig = field(default_factory=HeldOutConfig)
    """Held-out evaluation during training (TTT losses and accuracies; ``fledge eval`` measures real decoding)."""

    def __post_init__(self) -> None:
        if self.validation.holdout and self.validation.cache_dir:
            raise ConfigError(
                "validation.holdout and validation.cache_dir are alternatives: evaluate on a held-out slice of the "
                "training cache or on a second cache, not both"
            )
        if self.validation.every and not (self.validation.holdout or self.validation.cache_dir):
            raise ConfigError(
                f"validation.every={self.validation.every} needs held-out data: set validation.holdout=N (the last N "
                "conversations of the cache) or validation.cache_dir=PATH, or validation.every=0"
            )
        if self.engine.kind == "deepspeed" and self.train.optimizer != "adamw":
            raise ConfigError(f"train.optimizer={self.train.optimizer} runs on the torch engines only",
                              fix="use engine.kind=single or ddp, or train.optimizer=adamw with DeepSpeed")
        if self.engine.kind != "deepspeed" and self.engine.deepspeed_config:
            raise ConfigError(
                f"engine.deepspeed_config is set but engine.kind={self.engine.kind!r}; use engine.kind=deepspeed"
            )

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.output_dir) / CHECKPOINTS

    @property
    def jsonl_path(self) -> Path:
        return Path(self.log.jsonl) if self.log.jsonl else Path(self.output_dir) / "metrics.jsonl"


@dataclass
class CacheBinding:
    """The cache a run trains on, as its resolved config records it."""

    path: str | None
    """None when training online (no cache on disk)."""
    num_conversations: int
    num_tokens: int | None
    verifier_fingerprint: str


@dataclass
class RuntimeBinding:
    """What really runs: the engine, the compute dtype (checked against the first forward) and the versions."""

    engine: str
    """single, ddp, or deepspeed-zero<stage>."""
    compute_dtype: str
    """bfloat16 or float32: ``train.dtype`` once ``auto`` is settled; the first step refuses to go on when the
    forward ran in another."""
    device: str
    versions: dict[str, str]
    """torch, transformers and (when it trains) deepspeed."""


@dataclass
class RunBinding:
    """What a run is bound to besides its config; saved beside it in every checkpoint."""

    world_size: int
    cache: CacheBinding
    runtime: RuntimeBinding


_job, _run = fields_of(TrainJobConfig), fields_of(RunBinding)
RESUME_INVARIANTS = (
    _job.train.seed,
    _job.train.micro_batch_size,
    _job.train.max_tokens,
    _job.train.grad_accum,
    _job.train.freeze_head,
    _job.train.aux_scale,
    _job.train.draft_intermediate_size,
    _job.train.optimizer,
    _job.ttt.ttt_steps,
    _job.ttt.step_decay,
    _job.engine.kind,
    _job.engine.zero_stage,
    _job.validation.holdout,
    _run.world_size,
    _run.cache.num_conversations,
    _run.cache.verifier_fingerprint,
)
"""Settings a resume must not change: they decide which data each step sees or what the optimizer state means.
Everything else may change (max_steps / epochs extend or shorten the run and the cosine is recomputed from the
resumed step; lr, warmup, clipping, dtype, logging, eval and checkpoint cadence apply from the resumed step on).
Field references, not strings: a renamed field fails here, at import, instead of silently never matching."""


@dataclass
class TrainResult:
    step: int
    output_dir: Path
    draft_dir: Path | None
    """The final ``draft/`` (written by rank 0; None on other ranks)."""
    last: dict[str, float]
    """The last training record (rank 0)."""
    last_eval: dict[str, float]


def run(cfg: TrainJobConfig) -> TrainResult:
    """Train, then leave the process group in order (``core.dist.cleanup``) — also when preempted, since every
    rank stops at the same step; after an error each rank leaves at once, and the launcher stops the others."""
    info, device = init_process_group(cfg.engine)
    try:
        result = train(cfg, info, device)
    except Preempted as stop:
        stop.__traceback__ = None  # its frames hold the engine: let the collection before teardown free it
        cleanup()
        raise stop
    except BaseException:
        cleanup(in_step=False)
        raise
    cleanup()
    return result


def train(cfg: TrainJobConfig, info: DistInfo, device: torch.device) -> TrainResult:
    """The run: data, draft and engine, resume, the loop, the final draft."""
    seed_everything(cfg.train.seed)
    keep_freed_memory(device)  # each step's large tensors reuse the last step's memory (core/host_memory.py)
    output_dir = Path(cfg.output_dir)
    ckpt_dir = cfg.checkpoint_dir

    # ---- data, draft and engine
    reader = open_training_data(cfg, info, device)
    train_ids, eval_reader, eval_ids = split_data(cfg, reader)
    draft, verifier_head = build_draft(reader, cfg.train)
    bucket_sampler = sampler.BucketSampler(
        reader.lengths(), train_ids, cfg.train.micro_batch_size, cfg.train.max_tokens, cfg.train.grad_accum,
        cfg.train.seed, info.rank, info.world_size,
    )
    total_steps = cfg.train.max_steps or bucket_sampler.steps_for_epochs(cfg.train.epochs)
    # dtype=auto is settled here, once, by timing the draft's widest product (its head) on this machine.
    head_shape = (512, draft.config.hidden_size, draft.config.draft_vocab_size)
    train_cfg = dataclasses.replace(cfg.train, dtype=choose_train_dtype(cfg.train.dtype, device, head_shape))
    compiled = train_cfg.compiles(draft.config.draft_vocab_size, draft.config.hidden_size)
    module = TTTModule(draft, verifier_head, cfg.ttt, compiled, compiled and cfg.engine.kind != "deepspeed")
    del verifier_head  # the module keeps the teacher's split of it
    share = TimeShare(cfg.train.time_budget_minutes)  # a run sized by time: its schedule follows share.spent_s
    engine = build_engine(module, train_cfg, cfg.engine, info, device, total_steps, share)
    eval_set = sampler.eval_batches(
        eval_reader.lengths() if eval_reader else [], eval_ids, cfg.train.micro_batch_size, cfg.train.max_tokens,
        info.rank, info.world_size,
    )
    if cfg.validation.max_batches:
        eval_set = eval_set[: cfg.validation.max_batches]
    resolved = resolved_config(cfg, reader, info.world_size, runtime_binding(engine, train_cfg, device))
    resolved["train"]["dtype"] = train_cfg.dtype  # what ran, not "auto"
    resolved["train"]["compile"] = compiled
    meta = draft_meta(reader, cfg)

    # ---- resume from the latest complete checkpoint
    state = TrainState(world_size=info.world_size)
    if info.is_main:
        remove_stale(ckpt_dir)
    barrier()
    resume_from = latest_checkpoint(ckpt_dir) if cfg.checkpoint.resume else None
    if resume_from is not None:
        check_resume(resume_from, resolved, RESUME_INVARIANTS)
        state = load_checkpoint(resume_from, engine, info)
        share.before_s = share.spent_s = state.seconds
        # The divisors the checkpoint's weights were trained with, as measured then (another machine's reduction
        # may round the measurement differently in the last bits).
        draft.config.aux_scale = read_draft_config(resume_from).aux_scale
        log.info("resumed from %s (step %d)", resume_from, state.step)

    logger = MetricsLogger(  # a run sized by time has no known last step for its progress bar
        cfg.log, output_dir, cfg.jsonl_path, resolved, info.is_main, state.step,
        None if share.budget_s else total_steps,
    )
    # ds_numel: ZeRO-3 leaves each rank's parameter tensors empty and records their full size there.
    numel = {p: getattr(p, "ds_numel", p.numel()) for p in draft.parameters()}
    trainable = sum(n for p, n in numel.items() if p.requires_grad)
    runtime = resolved["runtime"]
    logger.log(
        {"params/trainable": trainable, "params/in_optimizer": engine.optimizer_numel(),
         "params/frozen": sum(numel.values()) - trainable, "total_steps": total_steps,
         "world_size": info.world_size, "engine": runtime["engine"], "compute_dtype": runtime["compute_dtype"],
         **{f"version/{k}": v for k, v in runtime["versions"].items()}},
        state.step,
    )
    window = MetricWindow(device)
    last: dict[str, float] = {}
    last_eval: dict[str, float] = {}
    window_start = loop_start = time.perf_counter()
    preempted = checked_dtype = False

    # ---- the loop
    # From here SIGTERM / SIGUSR1 only raise a flag (train/stopping.py): the run stops at the next step boundary.
    # The data thread reads and pads micro-batch i+1 while micro-batch i trains, in the sampler's order.
    with PreemptionSignals() as signals, sampler.Prefetcher(reader, device) as data:
        if eval_reader is reader:
            load_eval = data.read  # through the data thread: the reader is never used from two threads at once
        else:
            load_eval = lambda ids: sampler.collate([eval_reader[j] for j in ids], device)  # noqa: E731
        if share.spent() and state.step < total_steps:  # resumed after its time was spent: nothing left to train
            total_steps = state.step
        while state.step < total_steps:
            # The unroll's length for this step: step 0 alone while ttt.step0_share lasts (the same on every rank:
            # the time spent is rank 0's, handed round in the step's all-reduce).
            steps = cfg.ttt.steps_at(max(share.fraction(), state.step / total_steps))
            if steps != module.steps and module.steps is not None:
                log.info("ttt.step0_share=%g reached after step %d: the whole %d-step unroll from here",
                         cfg.ttt.step0_share, state.step, steps)
            module.steps = steps
            micro_batches, position = bucket_sampler.next_step(sampler.DataPosition(state.epoch, state.batch))
            if position.epoch > 0 and isinstance(reader, FirstEpochSource) and not reader.complete:
                paused = time.perf_counter()
                finish_first_epoch(reader, data, info)  # data.mode=cache_first_epoch: from the cache from now on
                window.paused += time.perf_counter() - paused
            for i, indices in enumerate(micro_batches):
                boundary = i == len(micro_batches) - 1
                ahead = bucket_sampler.next_step(position)[0][0] if boundary else micro_batches[i + 1]
                batch = data.next(indices, ahead)
                with engine.accumulating(boundary):  # DDP: gradients all-reduced on the last micro-batch only
                    loss, metrics = engine.forward(batch)
                    # Each micro-batch's mean loss / grad_accum: the step's gradient is the mean over its micro-
                    # batches (and DDP / ZeRO average over ranks), so it does not grow with the accumulation count.
                    engine.backward(loss / cfg.train.grad_accum, boundary)
                # Metrics add up on the device, tokens on the host: no host sync per micro-batch.
                window.add(metrics, tokens=int(bucket_sampler.lengths[indices].sum()))
            # Before the optimizer step: a run sized by time takes its next learning rate at the time spent now.
            stop = stop_reason(cfg.train.time_limit_minutes, loop_start, signals, device, share)
            result = engine.step()  # clip, skip if the gradient is not finite (one host sync), AdamW, LR schedule
            if not checked_dtype:  # what the forward ran in, against what the run records
                checked_dtype = check_compute_dtype(module, train_cfg.dtype, runtime["engine"])
            state.step += 1
            state.epoch, state.batch = position.epoch, position.batch
            state.seconds = share.spent_s
            state.skipped_steps += 0 if result.applied else 1
            if not result.applied:
                log.warning("step %d: non-finite gradient norm %s, update skipped", state.step, result.grad_norm)
            window.add_step(result.grad_norm)
            logger.advance()
            if stop == TIME_LIMIT and state.step < total_steps:
                log.warning("train.time_limit_minutes=%g reached at step %d of %d: ending the run here",
                            cfg.train.time_limit_minutes, state.step, total_steps)
                total_steps = state.step  # the final logging, held-out eval and checkpoint below run for this step
            elif stop == TIME_BUDGET and state.step < total_steps:
                log.info("train.time_budget_minutes=%g spent at step %d (at most %d): the run ends here",
                         cfg.train.time_budget_minutes, state.step, total_steps)
                total_steps = state.step
            # Preempted: log this step (and evaluate it when due), checkpoint it, and leave without the final draft:
            # the run is not over, and its resumption must log exactly what an uninterrupted run logs.
            preempted = stop == SIGNAL and state.step < total_steps
            end = preempted or state.step == total_steps

            if state.step % cfg.log.every == 0 or end:
                record = window.reduce(time.perf_counter() - window_start)
                state.tokens_seen += int(record.pop("tokens_total"))
                record.update(lr=engine.lr, skipped_steps=state.skipped_steps, epoch=state.epoch,
                              tokens_seen=state.tokens_seen)
                logger.log(with_tau(record), state.step)
                last, window, window_start = record, MetricWindow(device), time.perf_counter()

            every = cfg.validation.every
            if eval_set and every and (state.step % every == 0 or state.step == total_steps):
                paused = time.perf_counter()
                last_eval = evaluate_held_out(engine, load_eval, eval_set, device)
                logger.log(last_eval, state.step)
                window.paused += time.perf_counter() - paused  # eval time is not training throughput

            if (cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0) or end:
                paused = time.perf_counter()
                # Tokens of a window not logged yet would be lost on resume: count them before saving.
                state.tokens_seen += window.flush_tokens()
                saved = save_checkpoint(ckpt_dir, engine, state, draft.config, meta, resolved, info,
                                        cfg.checkpoint.keep_last)
                window.paused += time.perf_counter() - paused
            if preempted:
                break

    if preempted:
        by = signals.received.name if signals.received else "a signal to another rank"
        if info.is_main:
            log.warning("preempted by %s at step %d of %d: saved %s; rerun the same command to resume from it "
                        "(checkpoint.resume=true, the default)", by, state.step, total_steps, saved)
        logger.close()
        barrier()
        raise Preempted(state.step, total_steps, str(saved), by)

    # ---- the final draft, for eval and export
    weights = engine.trainable_state_dict()  # every rank: a collective under ZeRO-3
    draft_dir = write_final_draft(output_dir, weights, draft.config, {**meta, "step": state.step}) if info.is_main else None
    barrier()
    logger.close()
    return TrainResult(state.step, output_dir, draft_dir, last, last_eval)


# ------------------------------------------------------------------------------------------------ helpers
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def open_training_data(cfg: TrainJobConfig, info: DistInfo, device: torch.device) -> TrainingData:
    """The cache at ``cfg.cache_dir``, or with ``data.mode=online`` the verifier on ``device`` over the source (and
    with ``cache_first_epoch`` that too, unless the cache at ``cfg.cache_dir`` is complete)."""
    if cfg.data.mode == "online":
        return OnlineSource.open(cfg.verifier, cfg.data, cfg.cache, info, device, cfg.cache_dir)
    if cfg.data.mode == "cache_first_epoch":
        return FirstEpochSource.open_or_cache(cfg.verifier, cfg.data, cfg.cache, cfg.cache_dir, info, device)
    return CacheReader(cfg.cache_dir, verify=cfg.cache.verify_on_read)


def finish_first_epoch(reader: FirstEpochSource, data: sampler.Prefetcher, info: DistInfo) -> None:
    """The first step past the first epoch: write the cache and read it from now on. The shards are written on the
    data thread (the only one that runs the verifier: its capture hooks serve one forward at a time), the barriers
    run on this one (never a collective on two threads at once)."""
    data.call(reader.write_shards)
    barrier()
    if info.is_main:
        reader.write_cache_manifest()
    barrier()
    data.call(reader.switch_to_cache)


def split_data(cfg: TrainJobConfig, reader: TrainingData) -> tuple[list[int], TrainingData | None, list[int]]:
    """Training conversations, and the held-out reader and conversations (the last ``validation.holdout``, or a
    second cache)."""
    n = len(reader)
    if cfg.validation.holdout >= n:
        raise ConfigError(
            f"validation.holdout={cfg.validation.holdout} leaves nothing to train on: the cache has {n} conversations",
            fix="lower validation.holdout or cache more conversations",
        )
    if cfg.validation.cache_dir:
        other = CacheReader(cfg.validation.cache_dir, verify=cfg.cache.verify_on_read)
        for key in ("aux_layer_ids", "hidden_size"):
            if other.manifest[key] != reader.manifest[key]:
                raise MismatchError(
                    f"validation.cache_dir {cfg.validation.cache_dir}: {key} {other.manifest[key]} != training cache's "
                    f"{reader.manifest[key]}", fix="evaluate on a cache of the same verifier and aux layers",
                )
        if other.manifest["verifier"]["fingerprint"] != reader.manifest["verifier"]["fingerprint"]:
            raise MismatchError(
                f"validation.cache_dir {cfg.validation.cache_dir} was cached from another verifier than "
                f"{cfg.cache_dir}",
                fix="evaluate on a cache of the same verifier",
            )
        return list(range(n)), other, list(range(len(other)))
    if cfg.validation.holdout:
        return list(range(n - cfg.validation.holdout)), reader, list(range(n - cfg.validation.holdout, n))
    return list(range(n)), None, []


def aux_scales(reader: TrainingData, conversations: int = 32) -> list[float]:
    """The typical size of each aux state: the median over positions of its RMS, in the first ``conversations``
    conversations (``train.aux_scale``). A median, because a few positions (the first token's attention sink) carry
    states hundreds of times larger."""
    rows = [reader[i]["aux"].float() for i in range(min(conversations, len(reader)))]
    aux = torch.cat([r.reshape(-1, r.shape[-1]) for r in rows])
    return [float(x.pow(2).mean(-1).sqrt().median().clamp_min(1e-6)) for x in aux.chunk(3, dim=-1)]


def build_draft(reader: TrainingData, train: TrainConfig) -> tuple[Eagle3Draft, torch.Tensor]:
    """A fresh draft shaped like the cache's verifier, with its embedding and the cache's draft vocabulary, and the
    verifier's head (float32) for the teacher. Only the embedding and the head are read (and one decoder layer with
    ``train.layer_init=verifier``), never the whole model; a verifier whose weights are not the ones the cache was
    made with is refused (its head would teach other distributions than the cached states came from)."""
    from transformers import AutoConfig

    verifier_dir = reader.verifier_dir
    origin = f"the cache {reader.path}" if reader.path else "the online data"
    check_fingerprint(verifier_dir, reader.manifest["verifier"]["fingerprint"], origin)
    d2t, t2d = reader.draft_vocab()
    if train.draft_vocab_size:
        counts = reader.token_counts()
        if train.draft_vocab_size > counts.numel():
            raise ConfigError(f"train.draft_vocab_size={train.draft_vocab_size} is larger than the verifier's "
                              f"vocabulary ({counts.numel()} tokens)", fix=f"give at most {counts.numel()}")
        d2t, t2d = build_draft_vocab(counts, train.draft_vocab_size)
    hf_config = AutoConfig.from_pretrained(verifier_dir)
    config = Eagle3Config.from_verifier(
        hf_config, draft_vocab_size=int(d2t.numel()),
        aux_layer_ids=list(reader.manifest["aux_layer_ids"]),
    )
    if train.draft_intermediate_size:
        config = dataclasses.replace(config, intermediate_size=train.draft_intermediate_size)
    if train.aux_scale:
        config = dataclasses.replace(config, aux_scale=aux_scales(reader))
    if config.target_hidden_size != int(reader.manifest["hidden_size"]):
        raise MismatchError(
            f"{origin}: cached hidden size {reader.manifest['hidden_size']} != verifier's {config.target_hidden_size}"
        )
    draft = Eagle3Draft(config, seed=train.seed)
    embed, head = load_embed_and_head(verifier_dir)
    draft.load_verifier_embedding(embed.float())
    draft.set_draft_vocab(d2t, t2d)
    if train.head_init in ("verifier", "lens"):
        draft.init_head_from_verifier(head.float(), train.head_init_scale * load_final_norm(verifier_dir).float())
    if train.head_init == "lens":
        draft.init_as_lens()
    if train.layer_init == "verifier":
        init_layer(draft, verifier_dir, hf_config)
    if train.freeze_head:
        draft.lm_head.weight.requires_grad_(False)
        draft.norm.weight.requires_grad_(False)
    return draft, head.float().contiguous()


def init_layer(draft: Eagle3Draft, verifier_dir: Path, hf_config) -> None:
    """``train.layer_init=verifier``: the decoder layer from the verifier's layer whose input is the top aux state
    (``output_hidden_states`` index i is the input of ``layers.i``), its outputs on the residual's scale.
    ``hf_config``: the verifier's config (transformers'), for its number of layers."""
    cfg = draft.config
    top = int(cfg.aux_layer_ids[2])
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    layers = int(text.num_hidden_layers)
    if top >= layers:
        raise MismatchError(f"train.layer_init=verifier: the top aux state ({top}) is the verifier's output, which no "
                            f"layer reads", fix=f"aux layer ids below {layers}, or train.layer_init=random")
    scale = float(cfg.aux_scale[2]) if cfg.aux_scale is not None else 1.0
    left = draft.init_layer_from_verifier(load_layer(verifier_dir, top), residual_scale=scale)
    log.info("train.layer_init=verifier: the decoder layer starts as the verifier's layer %d", top)
    if left:
        log.warning("train.layer_init=verifier: the draft has no place for the verifier's %s; left out", left)


def runtime_binding(engine: Engine, train: TrainConfig, device: torch.device) -> RuntimeBinding:
    import transformers

    versions = {"torch": str(torch.__version__), "transformers": str(transformers.__version__)}
    if isinstance(engine, DeepSpeedEngine):
        import deepspeed

        versions["deepspeed"] = str(deepspeed.__version__)
        kind = f"deepspeed-zero{engine.zero_stage}"  # the stage DeepSpeed runs (a user JSON may set it)
    else:
        kind = "ddp" if engine.ddp else "single"
    return RuntimeBinding(engine=kind, compute_dtype=DTYPE_NAMES[train.dtype], device=str(device), versions=versions)


def resolved_config(
    cfg: TrainJobConfig, reader: TrainingData, world_size: int, runtime: RuntimeBinding
) -> dict[str, Any]:
    """The config as a plain dict plus what the run is bound to (``RunBinding``: world size, the cache's identity,
    the engine, dtype and versions that run), as checkpoints save it and a resume compares it."""
    from omegaconf import OmegaConf

    m = reader.manifest
    binding = RunBinding(
        world_size=world_size,
        cache=CacheBinding(
            path=str(reader.path) if reader.path else None,
            num_conversations=len(reader),
            num_tokens=m.get("num_tokens"),
            verifier_fingerprint=m["verifier"]["fingerprint"],
        ),
        runtime=runtime,
    )
    return {**OmegaConf.to_container(OmegaConf.structured(cfg)), **asdict(binding)}


def draft_meta(reader: TrainingData, cfg: TrainJobConfig) -> dict[str, Any]:
    m = reader.manifest
    return {
        "format": "fledge-draft-1",
        "verifier": {k: m["verifier"].get(k) for k in ("name", "path", "fingerprint")},
        "aux_layer_ids": list(m["aux_layer_ids"]),
        "cache": str(reader.path) if reader.path else None,
        "ttt_steps": cfg.ttt.ttt_steps,
    }


class MetricWindow:
    """Training metrics since the last log record: means over micro-batches (and ranks), sums of tokens.

    The per-micro-batch metrics stay on the device and add up there; ``reduce`` reads them back once per record
    (with the all-reduce over ranks), so training makes no host sync per micro-batch for its logs."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.keys: list[str] = []
        self.sums: torch.Tensor | None = None
        """float64 [len(keys)] on the device: the metrics summed over micro-batches."""
        self.counts: list[int] = []
        """Per key, the micro-batches that had it (known on the host: no device work)."""
        self._zero = torch.zeros((), device=self.device)
        self.tokens = 0
        self.steps = 0
        self.grad_norm = 0.0
        self.flushed = 0
        self.paused = 0.0
        """Seconds spent in eval and checkpoints inside this window (excluded from tokens/s)."""

    def add(self, metrics: dict[str, torch.Tensor], tokens: int) -> None:
        if not metrics.keys() <= set(self.keys):  # a key this window has not seen
            self._widen(metrics)
        values = torch.stack([torch.as_tensor(metrics[k], device=self.device) if k in metrics else self._zero
                              for k in self.keys]).double()
        self.sums = values if self.sums is None else self.sums + values
        self.counts = [n + (k in metrics) for n, k in zip(self.counts, self.keys)]
        self.tokens += tokens

    def _widen(self, metrics: dict[str, torch.Tensor]) -> None:
        """Make room for keys this window has not seen (the unroll's later steps, once ``ttt.step0_share`` is
        over): each key's mean is over the micro-batches that had it. Every rank widens at the same step."""
        keys = sorted(set(self.keys) | set(metrics))
        sums = torch.zeros(len(keys), dtype=torch.float64, device=self.device)
        counts = dict(zip(self.keys, self.counts))
        if self.sums is not None:
            sums[[keys.index(k) for k in self.keys]] = self.sums
        self.keys, self.sums, self.counts = keys, sums, [counts.get(k, 0) for k in keys]

    def add_step(self, grad_norm: float) -> None:
        self.steps += 1
        self.grad_norm += grad_norm

    def flush_tokens(self) -> int:
        """Tokens of all ranks not yet counted in ``tokens_seen`` (a collective)."""
        unflushed = torch.tensor([float(self.tokens - self.flushed)], dtype=torch.float64, device=self.device)
        total = int(all_reduce_sum(unflushed)[0])
        self.flushed = self.tokens
        return total

    def reduce(self, seconds: float) -> dict[str, float]:
        """A log record (a collective: every rank calls it at the same steps; the window's one host sync)."""
        counts = torch.tensor([*self.counts, self.tokens, self.tokens - self.flushed], dtype=torch.float64,
                              device=self.device)
        local = counts if self.sums is None else torch.cat([self.sums, counts])
        total = all_reduce_sum(local).tolist()
        tokens, unflushed = total[-2:]
        keys, n = self.keys, len(self.keys)
        record = {k: total[i] / total[n + i] for i, k in enumerate(keys) if k != "tokens"}
        record["loss_tokens"] = total[keys.index("tokens")] if "tokens" in keys else 0.0
        record["grad_norm"] = self.grad_norm / max(1, self.steps)
        record["tokens_per_s"] = tokens / max(seconds - self.paused, 1e-9)
        record["tokens_total"] = unflushed
        return record


@torch.no_grad()
def evaluate_held_out(
    engine: Engine, load: Callable[[list[int]], dict[str, torch.Tensor]], batches: list[tuple[list[int], float]],
    device: torch.device,
) -> dict[str, float]:
    """TTT losses and accuracies on held-out conversations, weighted by counted positions, over all ranks.
    ``load`` turns a micro-batch's conversation ids into a batch on the device; the sums stay there until the end."""
    keys: list[str] | None = None
    sums: torch.Tensor | None = None
    for indices, weight in batches:
        _, metrics = engine.forward(load(indices))
        if keys is None:
            keys = sorted(k for k in metrics if k != "tokens")
        w = weight * metrics["tokens"].double()
        row = torch.stack([metrics[k].double() * w for k in keys] + [w])
        sums = row if sums is None else sums + row
    if keys is None:
        return {}
    total = all_reduce_sum(sums.to(device)).tolist()
    weight = total[-1]
    record = {f"eval/{k}": (total[i] / weight if weight > 0 else math.nan) for i, k in enumerate(keys)}
    record["eval/tokens"] = weight
    return with_tau(record, prefix="eval/")
