"""Online training data: the verifier runs inside the training process and its states are trained on at once.

``fledge train data.mode=online`` reads the conversations ``fledge cache`` would read, with the same code
(``data.cache_job.prepare``: source, chat template, loss masks, draft vocabulary, identity), and serves them through
``OnlineSource``, which answers what the training loop asks a ``CacheReader``: ``len``, ``lengths()``,
``draft_vocab()``, ``manifest``, ``verifier_dir``, and ``rows(indices)`` / ``source[i]``, the tensors a shard row
holds. A row is computed when the loop's data thread asks for it, under ``inference_mode``, with the cache's capture
code (``data.cache_job.capture_batch``), and rounded to ``cache.storage_dtype`` as a shard stores it.

**The same numbers as the cache.** A conversation's captured states depend on the padded length of the forward
that computed it (the attention's reductions run over it), not on its batch mates. So each conversation is padded to
the length of its batch in the cache's plan (``data.cache.plan_shards``, a pure function of the lengths and
``cache.batch_tokens`` / ``cache.max_batch_size``), and the conversations of one training micro-batch that share a
padded length run in one forward. On CPU in fp32 the rows are then bitwise the rows of a cache of the same data
(``tests/test_train_online.py``), and a run is the same run online or offline, killed and resumed or not. On GPUs
the kernels may choose differently by batch size; the equality is only tested on CPU.

Each rank holds its own verifier replica on its device (as the official EAGLE code does), or spreads it with
``verifier.device_map=auto``; every rank tokenises the whole source once, up front, because the bucket sampler
needs every length before the first step.

**``data.mode=cache_first_epoch``** (``FirstEpochSource``): online during the first epoch, and the cache at
``cache_dir`` after it. Every row computed is also written to ``cache_dir/pending/`` (one file per conversation,
atomically); when the loop reaches the first step of the second epoch it calls ``write_shards`` on the data thread:
each rank writes its shards of the cache's plan (``s % world_size == rank``, as ``fledge cache``) from the pending
rows, computing the few the epoch did not visit (its dropped tail, rows lost to a kill), then rank 0 writes the
manifest; from then on rows come from the cache. The shards are byte for byte ``fledge cache``'s. A run killed in
the first epoch resumes with the pending rows it left; a run that finds the cache complete reads it from the start.
A run that ends inside its first epoch leaves the cache unfinished, with its pending rows, for a longer run.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fledge.core.dist import DistInfo, barrier
from fledge.core.errors import ConfigError, MismatchError
from fledge.core.files import atomic_write
from fledge.data.cache import CacheConfig, CacheReader, complete_shard, remove_stale_temporaries, write_shard
from fledge.data.cache_job import (
    CACHED_CONVERSATIONS,
    CacheJobConfig,
    Prepared,
    already_complete,
    capture_batch,
    claim_directory,
    manifest_record,
    prepare,
    write_manifest,
)
from fledge.data.sources import DataConfig
from fledge.data.vocab import save_draft_vocab
from fledge.models.verifier import VerifierConfig, parse_dtype, resolve_verifier_dir, weight_fingerprint

log = logging.getLogger(__name__)

MODES = ("cache", "online", "cache_first_epoch")
"""``cache``: train on the hidden-state cache at ``cache_dir``; ``online``: run the verifier while training;
``cache_first_epoch``: online in the first epoch while writing the cache at ``cache_dir``, from the cache after."""
PENDING = "pending"
"""``cache_dir/pending/``: the rows ``cache_first_epoch`` has computed, until its shards are written."""


@dataclass
class TrainDataConfig(DataConfig):
    """Where training data comes from: a cache (the default), or the conversations themselves (``mode=online``),
    read exactly as ``fledge cache`` reads them; the source fields are used only online."""

    max_conversations: int | None = CACHED_CONVERSATIONS
    """Take the first N usable conversations (online; None takes all): ``fledge cache``'s default, so that the same
    overrides name the same data in both stages."""
    mode: str = "cache"
    """``cache`` (train on ``cache_dir``), ``online`` (run the verifier in the training process, no cache) or
    ``cache_first_epoch`` (online while writing the cache at ``cache_dir`` in the first epoch, from it after)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in MODES:
            raise ConfigError(f"data.mode must be one of {', '.join(MODES)}, got {self.mode!r}",
                              fix="data.mode=cache (a cache built by `fledge cache`), online or cache_first_epoch")

    def source_config(self) -> DataConfig:
        """The same fields as the plain ``DataConfig`` ``fledge cache`` gets (its config hash and manifest read it)."""
        return DataConfig(**{f.name: getattr(self, f.name) for f in fields(DataConfig)})


def refuse_another_job(verifier: VerifierConfig, data: TrainDataConfig, cache_dir: str | Path) -> None:
    """Before any weight loads: online training must run the verifier that wrote the data's answers (a ``fledge
    regenerate`` output names it in its manifest.json) and, when ``cache_dir`` holds a cache (the preset's, or one
    a first epoch wrote), that cache's verifier on that cache's data. Otherwise the run would train a draft for
    another model, or on other conversations than the cache it claims, and show it only at evaluation."""
    fingerprint = weight_fingerprint(resolve_verifier_dir(verifier))  # sampled windows: cheap at any size
    for name in data.source_names():
        source = Path(name)
        answers = source.parent / "manifest.json"
        if not (source.is_file() and answers.is_file()):
            continue
        record = json.loads(answers.read_text())
        if record.get("verifier_fingerprint") not in (None, fingerprint):
            raise MismatchError(
                f"data.source={source} holds the answers of {record.get('verifier')}, but "
                f"verifier.name_or_path={verifier.name_or_path} is another model (weights {fingerprint[:12]} != "
                f"{record['verifier_fingerprint'][:12]})",
                fix=f"train with verifier.name_or_path={record.get('verifier')}, or regenerate the answers with this "
                "verifier (fledge regenerate)",
            )
    manifest_path = Path(cache_dir) / "manifest.json"
    if not manifest_path.is_file():
        return
    cached = json.loads(manifest_path.read_text())
    if cached["verifier"]["fingerprint"] != fingerprint:
        raise MismatchError(
            f"cache_dir={cache_dir} was cached from {cached['verifier']['name']}, but data.mode={data.mode} would run "
            f"verifier.name_or_path={verifier.name_or_path} (weights {fingerprint[:12]} != "
            f"{cached['verifier']['fingerprint'][:12]})",
            fix=f"verifier.name_or_path={cached['verifier']['name']}, or another cache_dir for this verifier",
        )
    recorded = cached["source"]["config"]
    current = asdict(data.source_config())
    differ = [f"data.{k}: the cache has {recorded[k]!r}, this run {current[k]!r}"
              for k in sorted(current) if k in recorded and recorded[k] != current[k]]
    if differ:
        raise MismatchError(
            f"cache_dir={cache_dir} holds other data than data.mode={data.mode} would train on:\n  " + "\n  ".join(differ),
            fix="give the cache's data settings, or another cache_dir",
        )


class OnlineSource:
    """A ``CacheReader`` whose rows the verifier computes on demand (see the module docstring).

    Not thread-safe: the loop reads it from its one data thread (``train.sampler.Prefetcher``)."""

    path: Path | None = None
    """No cache on disk: the run's checkpoints record ``cache: null``."""

    def __init__(self, prep: Prepared, job: CacheJobConfig) -> None:
        self.prep = prep
        self.storage = parse_dtype(job.cache.storage_dtype)
        self.manifest: dict[str, Any] = manifest_record(job, prep, shards=[])
        self._lengths = [len(s.input_ids) for s in prep.samples]
        self._padded = [0] * len(self._lengths)
        """Each conversation's padded length in the cache's plan: the longest of its batch there."""
        for shard in prep.plan.shards:
            for batch in shard:
                longest = max(self._lengths[i] for i in batch)
                for i in batch:
                    self._padded[i] = longest

    @classmethod
    def open(cls, verifier: VerifierConfig, data: TrainDataConfig, cache: CacheConfig, info: DistInfo,
             device: torch.device, cache_dir: str | Path) -> OnlineSource:
        """Load the verifier onto ``device`` and tokenise the source, as ``fledge cache`` does on every rank (once
        ``refuse_another_job`` has found the verifier and the data to be those of the data and of ``cache_dir``)."""
        job = CacheJobConfig(verifier=verifier, data=data.source_config(), cache=cache)
        if info.is_main:
            resolve_verifier_dir(verifier)  # convert a GGUF once, before the other ranks look for it
        barrier()
        refuse_another_job(verifier, data, cache_dir)  # every rank: the same answer everywhere, and no rank waits
        source = cls(prepare(job, info, device), job)
        if info.is_main:
            m = source.manifest
            log.info("online: %d conversations, %d tokens (%d in the loss), verifier %s on %s", len(source),
                     m["num_tokens"], m["num_loss_tokens"], m["verifier"]["name"], source.prep.verifier.device)
        return source

    @property
    def verifier_dir(self) -> Path:
        return Path(self.manifest["verifier"]["path"])

    def __len__(self) -> int:
        return len(self._lengths)

    def lengths(self) -> list[int]:
        return list(self._lengths)

    def draft_vocab(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.prep.d2t, self.prep.t2d

    def token_counts(self) -> torch.Tensor:
        return self.prep.counts

    def rows(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """The rows of ``indices``, in order: one verifier forward per padded length among them."""
        for i in indices:
            if not 0 <= i < len(self):
                raise IndexError(f"conversation {i} outside 0..{len(self) - 1}")
        out: dict[int, dict[str, torch.Tensor]] = {}
        for padded in sorted({self._padded[i] for i in indices}, reverse=True):
            group = list(dict.fromkeys(i for i in indices if self._padded[i] == padded))
            for i, row in zip(group, capture_batch(self.prep.verifier, self.prep.samples, group, self.storage, padded)):
                # As CacheReader serves a shard row; clone: a row must not keep its forward's padded batch alive.
                out[i] = {
                    "input_ids": row["input_ids"].clone(),
                    "loss_mask": row["loss_mask"].to(torch.int64),
                    "aux": row["aux"].clone(),
                    "final": row["final"].clone(),
                }
        return [out[i] for i in indices]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows([i])[0]


class FirstEpochSource(OnlineSource):
    """``data.mode=cache_first_epoch``: online rows, also kept for the cache at ``cache_dir`` until its shards are
    written; then the cache's rows (see the module docstring)."""

    def __init__(self, prep: Prepared, job: CacheJobConfig, info: DistInfo) -> None:
        super().__init__(prep, job)
        self.job, self.info = job, info
        self.path = Path(job.cache.dir)
        self.pending = self.path / PENDING
        self.cache: CacheReader | None = None
        """The finished cache, once ``switch_to_cache`` has run; rows come from it."""

    @classmethod
    def open_or_cache(cls, verifier: VerifierConfig, data: TrainDataConfig, cache: CacheConfig, cache_dir: str,
                      info: DistInfo, device: torch.device) -> FirstEpochSource | CacheReader:
        """The cache at ``cache_dir`` when it is complete for these settings; else the verifier, with ``cache_dir``
        claimed for the cache of this data (a folder holding another cache is refused, as by ``fledge cache``)."""
        settings = {f.name: getattr(cache, f.name) for f in fields(CacheConfig)}
        job = CacheJobConfig(verifier=verifier, data=data.source_config(), cache=CacheConfig(**{**settings,
                                                                                                "dir": cache_dir}))
        if info.is_main:
            resolve_verifier_dir(verifier)  # convert a GGUF once, before the other ranks look for it
        barrier()
        refuse_another_job(verifier, data, cache_dir)
        if already_complete(Path(cache_dir), job):
            return CacheReader(cache_dir)
        source = cls(prepare(job, info, device), job, info)
        if info.is_main:
            if not claim_directory(source.path, source.prep.plan_record, overwrite=False):
                remove_stale_temporaries(source.path)
                source.pending.mkdir(exist_ok=True)
                for tmp in source.pending.glob("*.tmp-*"):  # a row a killed run was writing
                    tmp.unlink()
                if not (source.path / "draft_vocab.safetensors").is_file():
                    save_draft_vocab(source.path / "draft_vocab.safetensors", source.prep.d2t, source.prep.t2d,
                                     source.prep.counts)
        barrier()
        if (source.path / "manifest.json").is_file():  # complete (claim_directory found it so)
            return CacheReader(cache_dir)
        log.info("cache_first_epoch: online in the first epoch, writing the cache %s meanwhile", cache_dir)
        return source

    @property
    def complete(self) -> bool:
        return self.cache is not None

    def _pending_file(self, i: int) -> Path:
        return self.pending / f"conv-{i:08d}.safetensors"

    def rows(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        if self.cache is not None:
            return self.cache.rows(indices)
        rows = super().rows(indices)
        for i, row in zip(indices, rows):
            path = self._pending_file(i)
            if not path.is_file():
                tensors = {**row, "loss_mask": row["loss_mask"].to(torch.uint8)}  # as a shard stores it
                atomic_write(path, lambda tmp, t=tensors: save_file(t, str(tmp)))
        return rows

    def _batch_rows(self, batch: list[int]) -> list[dict[str, torch.Tensor]]:
        """One plan batch's rows as a shard stores them: pending ones read back, the others computed."""
        found = {i: load_file(str(self._pending_file(i))) for i in batch if self._pending_file(i).is_file()}
        missing = [i for i in batch if i not in found]
        for i, row in zip(missing, super().rows(missing)):
            found[i] = {**row, "loss_mask": row["loss_mask"].to(torch.uint8)}
        return [found[i] for i in batch]

    def write_shards(self) -> None:
        """This rank's unfinished shards of the plan (on the data thread: it may run the verifier)."""
        for s, batches in enumerate(self.prep.plan.shards):
            if s % self.info.world_size != self.info.rank or complete_shard(self.path, s, verify=True) is not None:
                continue
            order = [i for batch in batches for i in batch]
            rows = [row for batch in batches for row in self._batch_rows(batch)]
            columns = ([r[k] for r in rows] for k in ("input_ids", "loss_mask", "aux", "final"))
            write_shard(self.path, s, order, *columns)

    def write_cache_manifest(self) -> None:
        """Rank 0, once every rank's shards are written: the manifest; the pending rows are not needed any more."""
        manifest = write_manifest(self.path, self.job, self.prep)
        shutil.rmtree(self.pending, ignore_errors=True)
        log.info("cache_first_epoch: wrote the cache %s (%d shards, %d tokens); training reads it from now on",
                 self.path, len(manifest["shards"]), manifest["num_tokens"])

    def switch_to_cache(self) -> None:
        """Rows from the finished cache from now on; the verifier is let go (its memory is the training's now)."""
        self.cache = CacheReader(self.path)
        self.prep.verifier = None  # type: ignore[assignment]
