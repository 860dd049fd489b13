"""The hidden-state cache: the verifier is run once over the tokenised data and its states are kept on disk.

Layout of a cache directory::

    cache_plan.json              what is being cached (identity + shard plan); written first, checked on resume
                                 (``plan.json`` in caches of fledge before 2026-12-05, still read)
    draft_vocab.safetensors      d2t / t2d / token counts
    shards/shard-00012.safetensors   input_ids, loss_mask, aux [N,3H], final [N,H], offsets, index
    shards/shard-00012.json      sidecar: checksum and sizes; written after the shard, so it marks it complete
    manifest.json                written last, once every shard is complete: the only thing readers trust

A shard is written to a temporary name, flushed and renamed, then its sidecar is written the same way, so a process
killed at any moment leaves either a complete shard or nothing a reader or a resumed run would take.

Shards are verified once, when written: the writer reads each one back and compares its sha256 with that of the
bytes it meant to write before the sidecar records it. A reader only checks what costs no read of the data — the
file's size and its safetensors header (the tensors, dtypes and shapes the manifest implies) — because on a shared
file system every rank hashing every shard would multiply the first epoch's reads by the number of ranks. The full
re-hash is there on demand: ``cache.verify_on_read=true`` for training, ``python -m fledge.data.cache verify DIR``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save
from tqdm import tqdm

from fledge.core.dist import dist_info
from fledge.core.errors import ConfigError, FledgeError
from fledge.core.files import atomic_write, atomic_write_text, renamed_file, sha256_file
from fledge.models.verifier import DTYPES

FORMAT_VERSION = 1
SHARD_DIR = "shards"
CACHE_PLAN = "cache_plan.json"
OLD_CACHE_PLAN = "plan.json"


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
    verify_on_read: bool = False
    """``fledge train``: re-hash every shard (sha256) when the cache is opened, on top of the size and header check
    every read makes; for a cache suspected of damage (each rank reads the whole cache once more)."""
    engine: str = "hf"
    """``fledge cache``: what runs the verifier. ``hf``: the Hugging Face model in this process; ``vllm``: vLLM, in
    its own environment (``make vllm-env``), through its hidden-state capture (``data/vllm_capture.py``): the same
    shards, within the storage dtype's rounding of ``hf``'s. Training online always runs ``hf``."""
    vllm_python: str | None = None
    """``engine=vllm``: the Python of vLLM's environment (None: ``$FLEDGE_VLLM_PYTHON``, else ``.venv-vllm``)."""

    def __post_init__(self) -> None:
        if self.batch_tokens < 1 or self.max_batch_size < 1 or self.shard_bytes < 1:
            raise ConfigError("cache.batch_tokens, cache.max_batch_size and cache.shard_bytes must be positive")
        if self.engine not in ("hf", "vllm"):
            raise ConfigError(f"cache.engine must be hf or vllm, got {self.engine!r}")


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
    """Write one shard, read it back once to check it, then its sidecar, each atomically; returns the sidecar
    record. The read-back is the shard's one full check: readers trust the sidecar's sha256 without re-hashing."""
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
    data = save(tensors)
    digest = hashlib.sha256(data).hexdigest()

    def write(tmp: Path) -> None:
        _write_bytes(tmp, data)
        _check_written(tmp, final_path, data, digest)

    atomic_write(final_path, write, before_replace=lambda: _fault_point("before_rename"))
    record = {
        "shard": s,
        "file": f"{SHARD_DIR}/{final_path.name}",
        "sha256": digest,
        "bytes": len(data),
        "conversations": len(conv_ids),
        "tokens": int(offsets[-1]),
        "index": conv_ids,
        "lengths": lengths,
    }
    atomic_write_text(shard_dir / f"{shard_name(s)}.json", json.dumps(record))
    _fault_point("after_shard")
    return record


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _check_written(tmp: Path, final_path: Path, data: bytes, digest: str) -> None:
    """Read the shard back once and compare it with the bytes meant for it, so a reader need not hash it again.

    The flushed pages are dropped first (where the OS allows), so the read comes from the storage, not from this
    process's page cache."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    # The bytes themselves, not a second hash: the same check at a fraction of the CPU (the writer thread shares the
    # CPU with the verifier's forward; docs/experiments/2026-12-05-training-peak.md, "The cache").
    if tmp.read_bytes() == data:
        return
    found = sha256_file(tmp)
    if found != digest:
        raise CacheError(
            f"{final_path}: the shard read back differs from what was written (sha256 {found[:12]}..., "
            f"expected {digest[:12]}...); it was not kept",
            fix="check the disk or file system under the cache, then rerun the command that was writing it",
        )


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


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
ANY_FLOAT = "F32|BF16|F16"
"""The states' dtype where the manifest names none (``cache.storage_dtype=auto``)."""


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets) and its length, from the first bytes
    only: an 8-byte little-endian length, then that much JSON."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"the header claims {n:,} bytes of a {size:,}-byte file")
        header = json.loads(fh.read(n))
    if not isinstance(header, dict) or not all(isinstance(v, dict) for k, v in header.items() if k != "__metadata__"):
        raise ValueError("the header is not a table of tensors")
    header.pop("__metadata__", None)
    return header, n


def expected_tensors(manifest: dict[str, Any], record: dict[str, Any]) -> dict[str, tuple[str, list[int]]]:
    """What ``write_shard`` stores for a shard of ``record`` in a cache of ``manifest``: name -> (dtype, shape)."""
    n, tokens, hidden = record["conversations"], record["tokens"], manifest["hidden_size"]
    storage = _SAFETENSORS_DTYPES.get(DTYPES.get(manifest["storage_dtype"]), ANY_FLOAT)
    return {
        "index": ("I64", [n]),
        "offsets": ("I64", [n + 1]),
        "input_ids": ("I32", [tokens]),
        "loss_mask": ("U8", [tokens]),
        "aux": (storage, [tokens, len(manifest["aux_layer_ids"]) * hidden]),
        "final": (storage, [tokens, hidden]),
    }


def _describe(dtype: Any, shape: Any) -> str:
    return f"{dtype} [{', '.join(str(d) for d in shape)}]" if isinstance(shape, list) else f"{dtype} {shape!r}"


class CacheReader:
    """Serves one conversation at a time from a complete cache, checking its identity and each shard's size and
    header the first time the shard is read.

    ``reader[i]`` -> {"input_ids": int64[T], "loss_mask": int64[T], "aux": [T, 3H], "final": [T, H]} in the storage
    dtype. Shards are memory-mapped. Their checksums were verified when they were written; ``verify`` re-hashes
    every shard now, before the first read (``verify_all``), for a cache suspected of damage.
    """

    def __init__(self, path: str | Path, expect: CacheIdentity | None = None, verify: bool = False):
        self.path = Path(path)
        manifest_path = self.path / "manifest.json"
        if not manifest_path.is_file():
            if renamed_file(self.path, CACHE_PLAN, OLD_CACHE_PLAN).is_file():
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
        self._handles: dict[int, Any] = {}
        self._where: list[tuple[int, int]] = [(-1, -1)] * self.manifest["num_conversations"]
        self._lengths: list[int] = [0] * self.manifest["num_conversations"]
        self._offsets: dict[int, list[int]] = {}
        for s, shard in enumerate(self.manifest["shards"]):
            for local, conv in enumerate(shard["index"]):
                self._where[conv] = (s, local)
            for conv, n in zip(shard["index"], shard["lengths"]):
                self._lengths[conv] = n
        if verify:
            self.verify_all()

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

    def token_counts(self) -> torch.Tensor:
        """[vocab_size] how often each verifier token is in the loss, over the cached conversations."""
        from fledge.data.vocab import load_token_counts

        try:
            return load_token_counts(self.path / "draft_vocab.safetensors")
        except (FileNotFoundError, ValueError) as e:
            raise CacheError(f"{self.path}: {e}", fix="rebuild the cache with `fledge cache cache.overwrite=true`") from e

    def _damaged(self, path: Path, what: str) -> CacheError:
        return CacheError(
            f"{path}: damaged shard: {what}",
            fix=f"delete {self.path / 'manifest.json'} and rerun `fledge cache` with the settings the cache was built "
            f"with: it re-hashes the shards and rebuilds the damaged ones (`python -m fledge.data.cache verify "
            f"{self.path}` checks them all)",
        )

    def check_shard(self, s: int) -> Path:
        """The cheap check of shard ``s``, reading a few bytes and no data: the size the manifest records and a
        header naming the tensors, dtypes and shapes the manifest implies. Returns the shard's path."""
        record = self.manifest["shards"][s]
        path = self.path / record["file"]
        if not path.is_file():
            raise CacheError(
                f"{path}: shard missing from the cache",
                fix=f"delete {self.path / 'manifest.json'} and rerun `fledge cache` with the settings the cache was "
                "built with: it rebuilds the missing shards",
            )
        size = path.stat().st_size
        if size != record["bytes"]:
            raise self._damaged(path, f"{size:,} bytes, the manifest records {record['bytes']:,}")
        try:
            header, n = read_header(path)
        except (ValueError, UnicodeDecodeError) as e:
            raise self._damaged(path, f"unreadable safetensors header ({e})") from e
        expected = expected_tensors(self.manifest, record)
        found = {k: (v.get("dtype"), v.get("shape")) for k, v in header.items()}
        problems = [f"{k} missing (expected {_describe(*want)})" for k, want in expected.items() if k not in found]
        problems += [f"{k} is {_describe(*found[k])}, expected {_describe(*want)}" for k, want in expected.items()
                     if k in found and not (found[k][1] == want[1] and found[k][0] in want[0].split("|"))]
        problems += [f"unexpected tensor {k}" for k in found if k not in expected]
        if not problems:
            try:
                end = max(int(v["data_offsets"][1]) for v in header.values())
            except (KeyError, IndexError, TypeError, ValueError):
                end = -1
            if 8 + n + end != size:
                problems.append(f"the header's data does not end at the end of the {size:,}-byte file")
        if problems:
            raise self._damaged(path, "; ".join(problems))
        return path

    def _shard(self, s: int):
        if s not in self._handles:
            path = self.check_shard(s)
            try:
                handle = safe_open(str(path), "pt")
                self._offsets[s] = handle.get_tensor("offsets").tolist()
            except Exception as e:  # safetensors raises its own error types for unreadable headers
                raise self._damaged(path, f"unreadable ({e})") from e
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
        """Re-hash every shard against the manifest now: the full check, for a cache suspected of damage. It reads
        the whole cache, which is why a read makes only the cheap one (``check_shard``)."""
        shards = self.manifest["shards"]
        with tqdm(total=sum(r["bytes"] for r in shards), unit="B", unit_scale=True, desc=f"verify {self.path.name}",
                  disable=not dist_info().is_main) as bar:
            for s, record in enumerate(shards):
                path = self.check_shard(s)
                found = sha256_file(path)
                if found != record["sha256"]:
                    raise self._damaged(path, f"sha256 {found[:12]}..., the manifest records {record['sha256'][:12]}...")
                bar.update(record["bytes"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fledge.data.cache", description="Check a hidden-state cache.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", help="re-hash every shard of a complete cache against its manifest")
    v.add_argument("dir", help="the cache directory (cache.dir / cache_dir)")
    args = parser.parse_args(argv)
    try:
        reader = CacheReader(args.dir)
        reader.verify_all()
    except CacheError as e:
        print(f"error: {e.one_line()}", file=sys.stderr)
        return 1
    print(f"{args.dir}: {len(reader.manifest['shards'])} shards, {reader.manifest['bytes']:,} bytes, all match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
