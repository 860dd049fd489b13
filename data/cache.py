"""The hidden-state cache: the verifier is run once over the tokenised data and its states are kept on disk.

Layout of a cache directory::

    plan.json                    what is being cached (identity + shard plan); written first, checked on resume
    draft_vocab.safetensors      d2t / t2d / token counts
    shards/shard-00012.safetensors   input_ids, loss_mask, aux [N,3H], final [N,H], offsets, index
    shards/shard-00012.json      sidecar: checksum and sizes; written after the shard, so it marks it complete
    manifest.json                written last, once every shard is complete: the only thing readers trust

A shard is written to a temporary name, flushed and renamed, then its sidecar is written the same way, so a process
killed at any moment leaves either a complete shard or nothing a reader or a resumed run would take.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fledge.core.errors import ConfigError, FledgeError
from fledge.core.files import atomic_write, atomic_write_text, sha256_file

FORMAT_VERSION = 1
SHARD_DIR = "shards"


class CacheError(FledgeError, RuntimeError):
    """A cache that is incomplete, damaged, or built for something else than what asks for it."""


@dataclass
class CacheConfig:
    dir: str = "runs/cache"
    """Cache directory; a rerun with the same inputs resumes it."""
    storage_dtype: str = "bfloat16"
    """dtype of the stored hidden states (bf16 halves the disk of fp32 and is what the draft trains in)."""
    batch_tokens: int = 8192
    """Padded tokens per verifier forward (batch size x longest sequence in the batch)."""
    max_batch_size: int = 64
    """Upper bound on sequences per forward, whatever their length."""
    shard_bytes: int = 256 * 2**20
    """Target size of a shard file; the plan packs length-sorted conversations until a shard reaches it."""
    draft_vocab_size: int = 32000
    """Size of the draft vocabulary chosen from loss-masked token frequencies (capped at the verifier's vocab)."""
    overwrite: bool = False
    """Delete an existing cache of different inputs instead of refusing to touch it."""
    device: str = "auto"
    """'auto' (cuda when available, else cpu), 'cpu', 'cuda', 'cuda:1', ..."""
    verify_on_resume: bool = True
    """Re-hash complete shards before trusting them on resume."""

    def __post_init__(self) -> None:
        if self.batch_tokens < 1 or self.max_batch_size < 1 or self.shard_bytes < 1:
            raise ConfigError("cache.batch_tokens, cache.max_batch_size and cache.shard_bytes must be positive")


@dataclass
class CacheIdentity:
    """What a cache is bound to; a reader refuses a cache whose identity differs from what the caller expects."""

    verifier_fingerprint: str
    tokenizer_hash: str
    chat_template_hash: str
    aux_layer_ids: list[int]
    max_length: int

    def mismatches(self, other: "CacheIdentity") -> list[str]:
        return [
            f"{k}: cache has {getattr(other, k)!r}, expected {getattr(self, k)!r}"
            for k in asdict(self)
            if getattr(self, k) != getattr(other, k)
        ]


def tokenizer_hash(tokenizer) -> str:
    """Hash of the vocabulary and special tokens (what decides the ids), not of the tokenizer object."""
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    for tok, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{tok}\n".encode())
    h.update(json.dumps(tokenizer.all_special_tokens).encode())
    return h.hexdigest()[:16]


def chat_template_hash(tokenizer) -> str:
    return hashlib.sha256((getattr(tokenizer, "chat_template", None) or "").encode()).hexdigest()[:16]


def shard_name(i: int) -> str:
    return f"shard-{i:05d}"


# --------------------------------------------------------------------------------------------------- plan


@dataclass
class ShardPlan:
    """Which conversations each shard holds and how they are batched; a pure function of the lengths."""

    shards: list[list[list[int]]] = field(default_factory=list)
    """shards[s] = list of batches; a batch = list of conversation indices (length-sorted, longest first)."""

    def conversations(self, s: int) -> list[int]:
        return [i for batch in self.shards[s] for i in batch]


def plan_shards(
    lengths: list[int], bytes_per_token: int, shard_bytes: int, batch_tokens: int, max_batch_size: int
) -> ShardPlan:
    """Length-sorted batches (little padding) packed into shards of about ``shard_bytes``.

    Batches never straddle shards, and the plan depends only on the lengths and sizes — not on the number of
    ranks — so that one process and N processes write byte-identical shards.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and ((len(current) + 1) * longest > batch_tokens or len(current) >= max_batch_size):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    plan = ShardPlan()
    shard: list[list[int]] = []
    shard_tokens = 0
    tokens_per_shard = max(1, shard_bytes // max(1, bytes_per_token))
    for batch in batches:
        n = sum(lengths[i] for i in batch)
        if shard and shard_tokens + n > tokens_per_shard:
            plan.shards.append(shard)
            shard, shard_tokens = [], 0
        shard.append(batch)
        shard_tokens += n
    if shard:
        plan.shards.append(shard)
    return plan


# --------------------------------------------------------------------------------------------------- writing


def write_shard(
    cache_dir: Path,
    s: int,
    conv_ids: list[int],
    input_ids: list[torch.Tensor],
    loss_mask: list[torch.Tensor],
    aux: list[torch.Tensor],
    final: list[torch.Tensor],
) -> dict[str, Any]:
    """Write one shard and then its sidecar, each atomically; returns the sidecar record."""
    shard_dir = cache_dir / SHARD_DIR
    lengths = [len(x) for x in input_ids]
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    tensors = {
        "index": torch.tensor(conv_ids, dtype=torch.int64),
        "offsets": offsets,
        "input_ids": torch.cat(input_ids).to(torch.int32),
        "loss_mask": torch.cat(loss_mask).to(torch.uint8),
        "aux": torch.cat(aux).contiguous(),
        "final": torch.cat(final).contiguous(),
    }
    final_path = shard_dir / f"{shard_name(s)}.safetensors"
    atomic_write(
        final_path, lambda tmp: save_file(tensors, str(tmp)), before_replace=lambda: _fault_point("before_rename")
    )
    record = {
        "shard": s,
        "file": f"{SHARD_DIR}/{final_path.name}",
        "sha256": sha256_file(final_path),
        "bytes": final_path.stat().st_size,
        "conversations": len(conv_ids),
        "tokens": int(offsets[-1]),
        "index": conv_ids,
        "lengths": lengths,
    }
    atomic_write_text(shard_dir / f"{shard_name(s)}.json", json.dumps(record))
    _fault_point("after_shard")
    return record


_shards_written = 0


def _fault_point(where: str) -> None:
    """Fault injection for the resume tests: ``FLEDGE_FAULT=after_shard:2`` SIGKILLs this process once two shards
    are complete; ``before_rename:2`` kills it while the third shard exists only under its temporary name."""
    global _shards_written
    if where == "after_shard":
        _shards_written += 1
    point, _, count = os.environ.get("FLEDGE_FAULT", "").partition(":")
    if point == where and _shards_written >= int(count or 0):
        os.kill(os.getpid(), 9)


def complete_shard(cache_dir: Path, s: int, verify: bool) -> dict[str, Any] | None:
    """The sidecar of shard ``s`` if it is complete (and, with ``verify``, its checksum still matches)."""
    sidecar = cache_dir / SHARD_DIR / f"{shard_name(s)}.json"
    if not sidecar.is_file():
        return None
    record = json.loads(sidecar.read_text())
    path = cache_dir / record["file"]
    if not path.is_file() or path.stat().st_size != record["bytes"]:
        return None
    if verify and sha256_file(path) != record["sha256"]:
        return None
    return record


def remove_stale_temporaries(cache_dir: Path) -> int:
    n = 0
    for tmp in (cache_dir / SHARD_DIR).glob("*.tmp-*"):
        tmp.unlink(missing_ok=True)
        n += 1
    return n


# --------------------------------------------------------------------------------------------------- reading


class CacheReader:
    """Serves one conversation at a time from a complete cache, checking identity and shard checksums.

    ``reader[i]`` -> {"input_ids": int64[T], "loss_mask": int64[T], "aux": [T, 3H], "final": [T, H]} in the storage
    dtype. Shards are memory-mapped; each shard's checksum is verified the first time it is read (``verify``).
    """

    def __init__(self, path: str | Path, expect: CacheIdentity | None = None, verify: bool = True):
        self.path = Path(path)
        manifest_path = self.path / "manifest.json"
        if not manifest_path.is_file():
            if (self.path / "plan.json").is_file():
                raise CacheError(f"{self.path}: incomplete (no manifest.json)", fix="rerun `fledge cache` to finish it")
            raise CacheError(f"{self.path}: not a fledge cache", fix="build one with `fledge cache cache.dir=...`")
        self.manifest: dict[str, Any] = json.loads(manifest_path.read_text())
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise CacheError(
                f"{self.path}: cache format {self.manifest.get('format_version')}, this fledge reads {FORMAT_VERSION}",
                fix="rebuild the cache with this version (`fledge cache cache.overwrite=true`)",
            )
        if expect is not None:
            problems = expect.mismatches(self.identity)
            if problems:
                raise CacheError(
                    f"{self.path} was built for something else:\n  " + "\n  ".join(problems),
                    fix="use the verifier and settings the cache was built with, or build a cache for these",
                )
        self.verify = verify
        self._verified: set[int] = set()
        self._handles: dict[int, Any] = {}
        self._where: list[tuple[int, int]] = [(-1, -1)] * self.manifest["num_conversations"]
        self._lengths: list[int] = [0] * self.manifest["num_conversations"]
        self._offsets: dict[int, list[int]] = {}
        for s, shard in enumerate(self.manifest["shards"]):
            for local, conv in enumerate(shard["index"]):
                self._where[conv] = (s, local)
            for conv, n in zip(shard["index"], shard["lengths"]):
                self._lengths[conv] = n

    @property
    def identity(self) -> CacheIdentity:
        m = self.manifest
        return CacheIdentity(
            verifier_fingerprint=m["verifier"]["fingerprint"],
            tokenizer_hash=m["tokenizer_hash"],
            chat_template_hash=m["chat_template_hash"],
            aux_layer_ids=list(m["aux_layer_ids"]),
            max_length=m["max_length"],
        )

    @property
    def verifier_dir(self) -> Path:
        return Path(self.manifest["verifier"]["path"])

    def __len__(self) -> int:
        return len(self._where)

    def lengths(self) -> list[int]:
        return list(self._lengths)

    def draft_vocab(self) -> tuple[torch.Tensor, torch.Tensor]:
        from fledge.data.vocab import load_draft_vocab

        try:
            return load_draft_vocab(self.path / "draft_vocab.safetensors")
        except (FileNotFoundError, ValueError) as e:
            raise CacheError(f"{self.path}: {e}", fix="rebuild the cache with `fledge cache cache.overwrite=true`") from e

    def _shard(self, s: int):
        if s not in self._handles:
            record = self.manifest["shards"][s]
            path = self.path / record["file"]
            if not path.is_file():
                raise CacheError(f"{path}: shard missing from the cache", fix="rerun `fledge cache` to rebuild it")
            if self.verify and s not in self._verified:
                if path.stat().st_size != record["bytes"] or sha256_file(path) != record["sha256"]:
                    raise CacheError(
                        f"{path}: damaged shard (checksum mismatch)", fix="delete it and rerun `fledge cache` to rebuild it"
                    )
                self._verified.add(s)
            try:
                handle = safe_open(str(path), "pt")
                self._offsets[s] = handle.get_tensor("offsets").tolist()
            except Exception as e:  # safetensors raises its own error types for unreadable headers
                raise CacheError(f"{path}: unreadable shard ({e})", fix="delete it and rerun `fledge cache`") from e
            self._handles[s] = handle
        return self._handles[s]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"conversation {i} outside 0..{len(self) - 1}")
        s, local = self._where[i]
        handle = self._shard(s)
        a, b = self._offsets[s][local], self._offsets[s][local + 1]
        return {
            "input_ids": handle.get_slice("input_ids")[a:b].to(torch.int64),
            "loss_mask": handle.get_slice("loss_mask")[a:b].to(torch.int64),
            "aux": handle.get_slice("aux")[a:b],
            "final": handle.get_slice("final")[a:b],
        }

    def rows(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """``[self[i] for i in indices]``: what the training loop reads per micro-batch (``data/online.py`` computes
        them in one verifier forward instead)."""
        return [self[i] for i in indices]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(len(self)):
            yield self[i]

    def verify_all(self) -> None:
        """Check every shard's checksum now (``fledge cache`` does this before declaring a cache complete)."""
        for s in range(len(self.manifest["shards"])):
            self._shard(s)
