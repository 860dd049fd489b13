"""``fledge bench cache``: cache throughput against a bare forward of the same model over the same batches.

Both run in one process on the same length-sorted batches, alternating, so that machine noise hits both alike; the
ratio cache/bare says what hooks, dtype conversion, unpadding and shard writing cost on top of the forward itself.

With ``parts`` each round also times the cache's two parts apart: the capture alone (the forwards with their hooks
and copies, the shards kept in memory) and then those shards' writes alone (serialising, hashing, writing, the
read-back check), one after the other on the main thread. Their sum is what the cache would cost with no overlap;
the cache run overlaps the writes with the next forward on a thread, which on a box with few cores competes with
the forward's own threads. On a shared box the rounds' times spread by several per cent, as much as the cache's own
work: the parts say how much of a ratio below 1 is the cache's work and how much is the noise between runs.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fledge.core.dist import DistInfo, pick_device
from fledge.core.errors import ConfigError
from fledge.core.host_memory import keep_freed_memory
from fledge.data.cache import CacheConfig, write_shard
from fledge.data.cache_job import CacheJobConfig, ShardWriter, cache_shard, prepare, write_manifest
from fledge.data.sources import DataConfig
from fledge.models.capture import decoder_parts
from fledge.models.verifier import VerifierConfig, parse_dtype

log = logging.getLogger(__name__)


@dataclass
class CacheBenchConfig:
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(max_conversations=48, max_length=1024))
    cache: CacheConfig = field(default_factory=lambda: CacheConfig(shard_bytes=32 * 2**20))
    rounds: int = 3
    """Alternating (bare, cache[, parts]) rounds; the best time of each is reported."""
    parts: bool = True
    """Also time the capture alone and the writes alone each round (module docstring)."""
    keep_dir: str | None = None
    """Keep the benchmark cache here instead of a temporary directory."""
    report: str | None = None
    """Also write the figures as JSON to this path."""


@torch.inference_mode()
def bare_forward(prep, batches: list[list[int]]) -> float:
    from fledge.data.cache_job import _batch_tensors

    base, _, _ = decoder_parts(prep.verifier.model)
    pad_id = prep.verifier.tokenizer.pad_token_id or 0
    device = prep.verifier.device
    start = time.perf_counter()
    for batch in batches:
        ids, attn = _batch_tensors(prep.samples, batch, pad_id)
        base(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False)
    _sync(device)
    return time.perf_counter() - start


def cached_run(prep, cfg: CacheJobConfig, out: Path) -> float:
    storage = parse_dtype(cfg.cache.storage_dtype)
    (out / "shards").mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    writer = ShardWriter(out)
    for s, batches in enumerate(prep.plan.shards):
        writer.put(s, cache_shard(prep.verifier, prep.samples, batches, storage))
    writer.close()
    _sync(prep.verifier.device)
    return time.perf_counter() - start


def timed_parts(prep, cfg: CacheJobConfig, out: Path) -> tuple[float, float]:
    """(seconds of the capture alone, seconds of its shards' writes alone, one after the other on this thread)."""
    storage = parse_dtype(cfg.cache.storage_dtype)
    (out / "shards").mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    shards = [cache_shard(prep.verifier, prep.samples, batches, storage) for batches in prep.plan.shards]
    _sync(prep.verifier.device)
    captured = time.perf_counter()
    for s, shard in enumerate(shards):
        write_shard(out, s, *shard)
    return captured - start, time.perf_counter() - captured


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(cfg: CacheBenchConfig) -> dict:
    if cfg.rounds < 1:
        raise ConfigError(f"rounds must be >= 1, got {cfg.rounds}")
    info = DistInfo()
    device = pick_device(cfg.cache.device, info)
    keep_freed_memory(device)  # as the cache stage does: both the bare forward and the cache run under it
    job = CacheJobConfig(verifier=cfg.verifier, data=cfg.data, cache=cfg.cache)
    prep = prepare(job, info, device)
    batches = [b for shard in prep.plan.shards for b in shard]
    tokens = sum(len(s.input_ids) for s in prep.samples)
    padded = sum(len(b) * max(len(prep.samples[i].input_ids) for i in b) for b in batches)
    bare_forward(prep, batches[:1])  # warm-up: allocator, kernels

    bare_times, cache_times, capture_times, write_times = [], [], [], []
    root = Path(cfg.keep_dir) if cfg.keep_dir else Path(tempfile.mkdtemp(prefix="fledge-bench-cache-"))
    try:
        for r in range(cfg.rounds):
            bare_times.append(bare_forward(prep, batches))
            out = root / f"round-{r}"
            shutil.rmtree(out, ignore_errors=True)
            cache_times.append(cached_run(prep, job, out))
            if cfg.parts:
                parts_dir = root / f"parts-{r}"
                shutil.rmtree(parts_dir, ignore_errors=True)
                capture_s, write_s = timed_parts(prep, job, parts_dir)
                capture_times.append(capture_s)
                write_times.append(write_s)
                log.info("round %d: bare %.2fs, cache %.2fs, capture alone %.2fs, writes alone %.2fs", r,
                         bare_times[-1], cache_times[-1], capture_s, write_s)
            else:
                log.info("round %d: bare %.2fs, cache %.2fs", r, bare_times[-1], cache_times[-1])
        manifest = write_manifest(out, job, prep)
        disk = manifest["bytes"]
    finally:
        if not cfg.keep_dir:
            shutil.rmtree(root, ignore_errors=True)

    bare, cache = min(bare_times), min(cache_times)
    figures = {
        "verifier": cfg.verifier.name_or_path,
        "compute_dtype": str(prep.verifier.dtype).removeprefix("torch."),
        "storage_dtype": cfg.cache.storage_dtype,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "conversations": len(prep.samples),
        "tokens": tokens,
        "padded_tokens": padded,
        "batches": len(batches),
        "bare_forward_tokens_per_s": tokens / bare,
        "cache_tokens_per_s": tokens / cache,
        "ratio": bare / cache,
        "bytes_per_token": disk / tokens,
        "rounds": {"bare_s": bare_times, "cache_s": cache_times},
    }
    if cfg.parts:
        # each part's extra time over the best bare forward, as a share of it (noise can make one negative)
        figures["rounds"].update(capture_s=capture_times, write_s=write_times)
        figures["capture_over_bare"] = min(capture_times) / bare - 1.0
        figures["writes_over_bare"] = min(write_times) / bare
        figures["parts_ratio"] = bare / (min(capture_times) + min(write_times))
    print(
        f"\nfledge bench cache — {figures['verifier']} ({figures['compute_dtype']} compute, "
        f"{figures['storage_dtype']} storage, {figures['device']}, {figures['threads']} threads)\n"
        f"  {figures['conversations']} conversations, {tokens} tokens in {len(batches)} length-sorted batches "
        f"({padded / tokens:.2f}x padding)\n"
        f"  bare forward   {figures['bare_forward_tokens_per_s']:9.1f} tokens/s\n"
        f"  cache          {figures['cache_tokens_per_s']:9.1f} tokens/s\n"
        f"  ratio          {figures['ratio']:9.3f}   (goal >= 0.95)\n"
        f"  on disk        {figures['bytes_per_token']:9.1f} bytes/token"
    )
    if cfg.parts:
        print(
            f"  capture alone  {figures['capture_over_bare']:+9.1%}   of the bare forward (hooks, copies)\n"
            f"  writes alone   {figures['writes_over_bare']:+9.1%}   (serialise, hash, write, read back)\n"
            f"  parts ratio    {figures['parts_ratio']:9.3f}   (bare / (capture + writes), no overlap)"
        )
    if cfg.report:
        Path(cfg.report).write_text(json.dumps(figures, indent=1))
    return figures
