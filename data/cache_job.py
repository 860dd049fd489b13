"""``fledge cache``: tokenise conversations, pick the draft vocabulary, and cache the verifier's hidden states.

Each rank (``torchrun``) caches the shards ``s % world_size == rank`` of one deterministic plan; rank 0 writes the
manifest once every shard is complete. A rerun with the same inputs skips complete shards, so a run killed at any
moment resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from fledge.core.dist import DistInfo, barrier, process_group
from fledge.core.errors import ConfigError, MismatchError
from fledge.core.files import atomic_write_text, renamed_file, retire_old_name
from fledge.core.host_memory import keep_freed_memory
from fledge.data.cache import (
    CACHE_PLAN,
    FORMAT_VERSION,
    OLD_CACHE_PLAN,
    SHARD_DIR,
    CacheConfig,
    CacheError,
    CacheIdentity,
    ShardPlan,
    chat_template_hash,
    complete_shard,
    plan_shards,
    remove_stale_temporaries,
    tokenizer_hash,
    write_shard,
)
from fledge.data.shipped import warn_if_other_verifier
from fledge.data.sources import SHIPPED_SOURCE, DataConfig, load_conversations
from fledge.data.template import Tokenized, tokenize_all
from fledge.data.vocab import build_draft_vocab, count_tokens, save_draft_vocab
from fledge.models.capture import forward_hidden
from fledge.models.verifier import (
    Verifier,
    VerifierConfig,
    load_verifier,
    parse_dtype,
    resolve_verifier_dir,
    weight_fingerprint,
)

log = logging.getLogger(__name__)


CACHED_CONVERSATIONS = 1000
"""How many conversations ``fledge cache`` (and online training, ``data/online.py``) take by default."""


@dataclass
class CacheJobConfig:
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(max_conversations=CACHED_CONVERSATIONS))
    """The conversations to cache; the first 1000 usable ones by default (``data.max_conversations=null``: all)."""
    cache: CacheConfig = field(default_factory=CacheConfig)


@dataclass
class Prepared:
    """Everything decided before the first forward: the same on every rank and on every rerun."""

    verifier: Verifier
    samples: list[Tokenized]
    identity: CacheIdentity
    plan: ShardPlan
    plan_record: dict[str, Any]
    d2t: torch.Tensor
    t2d: torch.Tensor
    counts: torch.Tensor
    source_report: dict[str, Any]
    token_stats: dict[str, int]


def _config_hash(cfg: CacheJobConfig, fingerprint: str) -> str:
    payload = {"verifier": asdict(cfg.verifier), "data": asdict(cfg.data), "fingerprint": fingerprint}
    if payload["data"]["sources"] is None:
        del payload["data"]["sources"]  # a single source hashes as it did before mixtures existed
    for placement in ("home", "device_map"):  # where the verifier is kept or placed does not change its states
        payload["verifier"].pop(placement, None)
    # how it is built or read, not what (the engine is bound in the plan record, and only when it is vllm)
    unbound = {"dir", "overwrite", "device", "verify_on_resume", "verify_on_read", "engine", "vllm_python"}
    payload["cache"] = {k: v for k, v in asdict(cfg.cache).items() if k not in unbound}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _why_none_usable(stats: dict[str, int], data: DataConfig) -> str:
    """What tokenisation did to the conversations the source kept, for a refusal that has none left."""
    why = []
    if stats.get("dropped_no_mask"):
        cut = f" (the first is {stats['first_cut_length']:,} tokens long)" if "first_cut_length" in stats else ""
        why.append(f"{stats['dropped_no_mask']:,} had no assistant token within data.max_length={data.max_length}"
                   f"{cut}")
    if stats.get("template_errors"):
        why.append(f"{stats['template_errors']:,} refused by the chat template")
    return ": " + "; ".join(why) if why else ""


def prepare(cfg: CacheJobConfig, info: DistInfo, device: torch.device) -> Prepared:
    # The data first: a source that yields nothing is refused before the verifier loads.
    conversations, report = load_conversations(cfg.data)
    verifier = load_verifier(cfg.verifier, device)
    if SHIPPED_SOURCE in cfg.data.source_names() and info.is_main:
        warn_if_other_verifier(verifier.fingerprint)
    samples, stats = tokenize_all(
        verifier.tokenizer,
        conversations,
        cfg.data.max_length,
        desc="tokenize",
        template_kwargs=dict(cfg.data.chat_template_kwargs),
    )
    if not samples:
        raise CacheError(
            f"no usable conversation in {cfg.data.describe()!r} ({report.summary()}){_why_none_usable(stats, cfg.data)}",
            fix="check data.source and data.max_length",
        )
    vocab_size = int(verifier.model.config.vocab_size)
    try:
        counts = count_tokens(samples, vocab_size)
    except ValueError as e:  # the tokenizer makes ids the verifier's embedding has no row for
        raise MismatchError(
            f"{cfg.verifier.name_or_path}: the tokenizer does not fit the verifier: {e}",
            fix="use the tokenizer saved with the verifier (its vocabulary must not exceed the model's vocab_size)",
        ) from None
    draft_vocab_size = min(cfg.cache.draft_vocab_size, vocab_size)
    try:
        d2t, t2d = build_draft_vocab(counts, draft_vocab_size)
    except ValueError as e:
        raise ConfigError(f"cache.draft_vocab_size={cfg.cache.draft_vocab_size}: {e}",
                          fix="set cache.draft_vocab_size to at least 1") from None

    storage = parse_dtype(cfg.cache.storage_dtype)
    bytes_per_token = 4 * verifier.hidden_size * storage.itemsize + 5
    lengths = [len(s.input_ids) for s in samples]
    plan = plan_shards(lengths, bytes_per_token, cfg.cache.shard_bytes, cfg.cache.batch_tokens, cfg.cache.max_batch_size)
    identity = CacheIdentity(
        verifier_fingerprint=verifier.fingerprint,
        tokenizer_hash=tokenizer_hash(verifier.tokenizer),
        chat_template_hash=chat_template_hash(verifier.tokenizer),
        aux_layer_ids=verifier.aux_layer_ids,
        max_length=cfg.data.max_length,
    )
    data_hash = hashlib.sha256()
    for s in samples:
        data_hash.update(torch.tensor(s.input_ids, dtype=torch.int64).numpy().tobytes())
        data_hash.update(torch.tensor(s.loss_mask, dtype=torch.uint8).numpy().tobytes())
    plan_record = {
        "format_version": FORMAT_VERSION,
        "config_hash": _config_hash(cfg, verifier.fingerprint),
        "identity": asdict(identity),
        "storage_dtype": cfg.cache.storage_dtype,
        "compute_dtype": str(verifier.dtype).removeprefix("torch."),
        "data_sha256": data_hash.hexdigest(),
        "plan_sha256": hashlib.sha256(json.dumps(plan.shards).encode()).hexdigest(),
        "num_shards": len(plan.shards),
    }
    if cfg.cache.engine != "hf":  # (an hf cache's record is as it was before there was a choice)
        plan_record["engine"] = cfg.cache.engine
    return Prepared(
        verifier=verifier,
        samples=samples,
        identity=identity,
        plan=plan,
        plan_record=plan_record,
        d2t=d2t,
        t2d=t2d,
        counts=counts,
        source_report=asdict(report),
        token_stats=stats,
    )


def claim_directory(cache_dir: Path, plan_record: dict[str, Any], overwrite: bool) -> bool:
    """Bind ``cache_dir`` to this plan (rank 0). True when the cache is already complete."""
    plan_path = renamed_file(cache_dir, CACHE_PLAN, OLD_CACHE_PLAN)
    if plan_path.is_file():
        old = json.loads(plan_path.read_text())
        differs = [k for k in plan_record if old.get(k) != plan_record[k] and k != "config_hash"]
        if differs:
            if not overwrite:
                raise CacheError(
                    f"{cache_dir} holds a cache of other inputs ({', '.join(differs)} differ)",
                    fix="choose another cache.dir or pass cache.overwrite=true to replace it",
                )
            log.warning("cache.overwrite=true: replacing %s (%s differ)", cache_dir, ", ".join(differs))
            shutil.rmtree(cache_dir / SHARD_DIR, ignore_errors=True)
            for name in ("manifest.json", CACHE_PLAN, OLD_CACHE_PLAN, "draft_vocab.safetensors"):
                (cache_dir / name).unlink(missing_ok=True)
        elif (cache_dir / "manifest.json").is_file():
            return True
    elif cache_dir.exists() and any(not p.name.startswith(".") for p in cache_dir.iterdir()) and not overwrite:
        raise CacheError(f"{cache_dir} exists and is not a fledge cache", fix="choose another cache.dir")
    (cache_dir / SHARD_DIR).mkdir(parents=True, exist_ok=True)
    atomic_write_text(cache_dir / CACHE_PLAN, json.dumps(plan_record, indent=1))
    retire_old_name(cache_dir, OLD_CACHE_PLAN)
    return False


def _batch_tensors(
    samples: list[Tokenized], batch: list[int], pad_id: int, pad_to: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max([len(samples[i].input_ids) for i in batch] + [pad_to or 0])
    ids = torch.full((len(batch), longest), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(batch), longest), dtype=torch.int64)
    for row, i in enumerate(batch):
        n = len(samples[i].input_ids)
        ids[row, :n] = torch.tensor(samples[i].input_ids)
        mask[row, :n] = 1
    return ids, mask


def capture_batch(
    verifier: Verifier, samples: list[Tokenized], batch: list[int], storage: torch.dtype, pad_to: int | None = None
) -> list[dict[str, torch.Tensor]]:
    """One verifier forward over ``batch`` (right-padded to its longest conversation, or to ``pad_to``): each
    conversation's row as a shard stores it (input_ids int64, loss_mask uint8, aux [T, 3H] and final [T, H] in
    ``storage``).

    The values of a conversation's row depend on the padded length of its forward but not on the other rows (on
    CPU in fp32 they are bitwise the same for any batch mates): ``data/online.py`` relies on it to reproduce a
    cache's rows exactly, padding each conversation to the length of its batch in the cache's plan."""
    pad_id = verifier.tokenizer.pad_token_id or 0
    ids, attn = _batch_tensors(samples, batch, pad_id, pad_to)
    device = verifier.device
    captured = forward_hidden(verifier.model, ids.to(device), attn.to(device), verifier.aux_layer_ids)
    aux = torch.cat([a.to("cpu", storage) for a in captured.aux], dim=-1)  # layers may sit on several GPUs
    final = captured.final.to("cpu", storage)
    rows = []
    for row, i in enumerate(batch):
        n = len(samples[i].input_ids)
        rows.append({
            "input_ids": ids[row, :n],
            "loss_mask": torch.tensor(samples[i].loss_mask, dtype=torch.uint8),
            "aux": aux[row, :n],
            "final": final[row, :n],
        })
    return rows


def cache_shard(verifier: Verifier, samples: list[Tokenized], batches: list[list[int]], storage: torch.dtype,
                on_batch=None, capture=None):
    """Run the verifier over one shard's batches; returns per-conversation tensors in shard order. ``capture``:
    what makes a batch's rows (``capture_batch``'s arguments after the verifier; None: ``capture_batch``)."""
    capture = capture or (lambda samples_, batch_, storage_: capture_batch(verifier, samples_, batch_, storage_))
    conv_ids, ids_out, mask_out, aux_out, final_out = [], [], [], [], []
    for batch in batches:
        for i, row in zip(batch, capture(samples, batch, storage)):
            conv_ids.append(i)
            ids_out.append(row["input_ids"])
            mask_out.append(row["loss_mask"])
            aux_out.append(row["aux"])
            final_out.append(row["final"])
        if on_batch is not None:
            on_batch(sum(len(samples[i].input_ids) for i in batch))
    return conv_ids, ids_out, mask_out, aux_out, final_out


class ShardWriter:
    """Writes shards on a background thread so the next forward overlaps the disk work (hashing, fsync)."""

    def __init__(self, cache_dir: Path, depth: int = 2):
        self.cache_dir = cache_dir
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.thread.start()

    def _work(self) -> None:
        while (item := self.queue.get()) is not None:
            try:
                if self.error is None:
                    write_shard(self.cache_dir, *item)
            except BaseException as e:  # surfaced on the main thread by put()/close()
                self.error = e

    def put(self, s: int, shard: tuple) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put((s, *shard))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


def write_manifest(cache_dir: Path, cfg: CacheJobConfig, prep: Prepared,
                   engine: dict[str, Any] | None = None) -> dict[str, Any]:
    """``engine``: what captured the states when it was not the hf engine (recorded as the manifest's ``engine``)."""
    shards = []
    for s in range(len(prep.plan.shards)):
        record = complete_shard(cache_dir, s, verify=False)
        if record is None:
            raise CacheError(f"{cache_dir}: shard {s} is not complete", fix="rerun `fledge cache` to finish it")
        shards.append(record)
    manifest = manifest_record(cfg, prep, shards)
    if engine is not None:
        manifest["engine"] = engine
    atomic_write_text(cache_dir / "manifest.json", json.dumps(manifest, indent=1))
    return manifest


def manifest_record(cfg: CacheJobConfig, prep: Prepared, shards: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest of a cache of ``prep`` made of ``shards`` (their sidecar records). Online training
    (``data/online.py``) builds the same record with no shards, so a run reads one description of its data."""
    v = prep.verifier
    return {
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "verifier": {
            "name": v.name,
            "path": str(v.path.resolve()),
            "fingerprint": v.fingerprint,
            "model_type": v.model.config.model_type,
            "num_layers": v.num_layers,
            "vocab_size": int(v.model.config.vocab_size),
        },
        "tokenizer_hash": prep.identity.tokenizer_hash,
        "chat_template_hash": prep.identity.chat_template_hash,
        "aux_layer_ids": v.aux_layer_ids,
        "hidden_size": v.hidden_size,
        "storage_dtype": cfg.cache.storage_dtype,
        "compute_dtype": str(prep.verifier.dtype).removeprefix("torch."),
        "max_length": cfg.data.max_length,
        "source": {"config": asdict(cfg.data), "report": prep.source_report, "tokens": prep.token_stats},
        "draft_vocab_size": int(prep.d2t.numel()),
        "num_conversations": len(prep.samples),
        "num_tokens": sum(len(s.input_ids) for s in prep.samples),  # every conversation is in exactly one shard
        "num_loss_tokens": sum(sum(s.loss_mask) for s in prep.samples),
        "bytes": sum(r["bytes"] for r in shards),
        "shards": shards,
    }


def already_complete(cache_dir: Path, cfg: CacheJobConfig) -> bool:
    """Cheap rerun check (no tokenisation): a manifest exists and was written for this very configuration."""
    plan_path, manifest_path = renamed_file(cache_dir, CACHE_PLAN, OLD_CACHE_PLAN), cache_dir / "manifest.json"
    if not (plan_path.is_file() and manifest_path.is_file()):
        return False
    fingerprint = weight_fingerprint(resolve_verifier_dir(cfg.verifier))
    return json.loads(plan_path.read_text()).get("config_hash") == _config_hash(cfg, fingerprint)


def run(cfg: CacheJobConfig) -> Path:
    with process_group(cfg.cache.device) as (info, device):
        return _run(cfg, info, device)


def _run(cfg: CacheJobConfig, info: DistInfo, device: torch.device) -> Path:
    cache_dir = Path(cfg.cache.dir)
    python, vllm_version = None, None
    if cfg.cache.engine == "vllm":  # refused before anything is read or loaded when it cannot run
        from fledge.data.vllm_capture import check_capture
        from fledge.data.vllm_engine import find_vllm_python

        if info.world_size > 1:
            raise ConfigError(f"cache.engine=vllm runs in one process (got {info.world_size} ranks)",
                              fix="run fledge cache without torchrun (vLLM spreads a verifier over GPUs itself)")
        python = find_vllm_python(cfg.cache.vllm_python)
        vllm_version = check_capture(python)
    if info.is_main:
        resolve_verifier_dir(cfg.verifier)  # convert a GGUF once, before the other ranks look for it
    barrier()
    if already_complete(cache_dir, cfg):
        if info.is_main:
            log.info("%s is complete for this configuration; nothing to do", cache_dir)
        return cache_dir
    prep = prepare(cfg, info, device)
    if info.is_main:
        done = claim_directory(cache_dir, prep.plan_record, cfg.cache.overwrite)
        if not done:
            remove_stale_temporaries(cache_dir)
            if not (cache_dir / "draft_vocab.safetensors").is_file():
                save_draft_vocab(cache_dir / "draft_vocab.safetensors", prep.d2t, prep.t2d, prep.counts)
    barrier()
    if (cache_dir / "manifest.json").is_file():
        if info.is_main:
            log.info("%s is complete; nothing to do", cache_dir)
        return cache_dir

    storage = parse_dtype(cfg.cache.storage_dtype)
    keep_freed_memory(device)  # each batch's activations reuse the last batch's memory (core/host_memory.py)
    mine = [s for s in range(len(prep.plan.shards)) if s % info.world_size == info.rank]
    todo = [s for s in mine if complete_shard(cache_dir, s, verify=cfg.cache.verify_on_resume) is None]
    if len(todo) < len(mine):
        log.info("rank %d: %d of %d shards already complete", info.rank, len(mine) - len(todo), len(mine))
    lengths = [len(s.input_ids) for s in prep.samples]
    total = sum(lengths[i] for s in todo for i in prep.plan.conversations(s))
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc=f"cache[{info.rank}]", disable=not info.is_main, smoothing=0.1)
    writer = ShardWriter(cache_dir)
    engine = None
    try:
        if python is not None and todo:
            from fledge.data.vllm_capture import VllmCapture

            engine = VllmCapture(prep.verifier, python, cfg.data.max_length, cfg.cache.max_batch_size,
                                 cache_dir / "vllm.log")
        for s in todo:
            shard = cache_shard(prep.verifier, prep.samples, prep.plan.shards[s], storage, on_batch=bar.update,
                                capture=engine.capture_batch if engine else None)
            writer.put(s, shard)
    finally:
        if engine is not None:
            engine.close()
        writer.close()
        bar.close()
    barrier()
    if info.is_main:
        manifest = write_manifest(cache_dir, cfg, prep, {"name": "vllm", "version": vllm_version} if python else None)
        log.info(
            "cache %s: %d conversations, %d tokens (%d in the loss), %d shards, %.1f MB (%.0f bytes/token)",
            cache_dir,
            manifest["num_conversations"],
            manifest["num_tokens"],
            manifest["num_loss_tokens"],
            len(manifest["shards"]),
            manifest["bytes"] / 1e6,
            manifest["bytes"] / max(1, manifest["num_tokens"]),
        )
    barrier()
    return cache_dir
