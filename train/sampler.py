"""Length-bucketed micro-batches over a cache, deterministic from the seed, sharded by rank, resumable.

Every rank builds the same list of *global* micro-batches for an epoch (a function of the seed, the epoch and the
sequence lengths only), and an optimizer step consumes ``world_size * grad_accum`` consecutive ones: micro-step
``a`` of rank ``r`` reads global micro-batch ``first + a * world_size + r``. So one process with ``grad_accum = 2``
sees exactly the global batch that two ranks with ``grad_accum = 1`` see together, which is what makes a
single-process run and a DDP / DeepSpeed run comparable step by step.

The position in the data is ``(epoch, batch)``: the index of the next global micro-batch of that epoch. A checkpoint
stores it, and a resumed run rebuilds the epoch's list and continues from there. ``Prefetcher`` reads the micro-batches
the loop names one ahead, on a background thread, without changing which ones or in what order.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, TypeVar

import numpy as np
import torch

from fledge.core.errors import ConfigError

if TYPE_CHECKING:
    from fledge.data.cache import CacheReader
    from fledge.data.online import OnlineSource


T = TypeVar("T")


@dataclass
class DataPosition:
    epoch: int = 0
    """Epoch the next micro-batch belongs to (the bucketing and shuffling are drawn from ``(seed, epoch)``)."""
    batch: int = 0
    """Index of the next global micro-batch in that epoch's list."""


def bucket_batches(
    lengths: list[int] | np.ndarray,
    indices: list[int] | np.ndarray,
    micro_batch_size: int,
    max_tokens: int,
    rng: np.random.Generator,
    chunk_batches: int = 64,
) -> list[list[int]]:
    """Shuffle, sort by length inside chunks of about ``chunk_batches`` micro-batches, cut, shuffle the batches.

    Sorting only inside chunks keeps batches of similar lengths (little padding) while the order of the data
    stays random. With ``max_tokens > 0`` a micro-batch holds as many sequences as fit in that padded-token budget
    (longest sequence x count), at least one; otherwise ``micro_batch_size`` sequences.
    """
    lengths = np.asarray(lengths)
    order = np.asarray(indices, dtype=np.int64)[rng.permutation(len(indices))]
    if max_tokens > 0:
        per_batch = max(1, max_tokens // max(1, int(lengths[order].mean()) if len(order) else 1))
    else:
        per_batch = micro_batch_size
    per_chunk = per_batch * chunk_batches
    batches: list[list[int]] = []
    for start in range(0, len(order), per_chunk):
        chunk = order[start : start + per_chunk]
        # Stable sort, longest first: the first batch of a chunk shows the memory peak early.
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        if max_tokens <= 0:
            batches.extend(chunk[i : i + micro_batch_size].tolist() for i in range(0, len(chunk), micro_batch_size))
            continue
        current: list[int] = []
        longest = 0
        for idx in chunk.tolist():
            longest_with = max(longest, int(lengths[idx]))
            if current and longest_with * (len(current) + 1) > max_tokens:
                batches.append(current)
                current, longest_with = [], int(lengths[idx])
            current.append(idx)
            longest = longest_with
        if current:
            batches.append(current)
    return [batches[i] for i in rng.permutation(len(batches))]


class BucketSampler:
    """This rank's micro-batches, step by step, from a deterministic per-epoch list of global micro-batches."""

    def __init__(
        self,
        lengths: list[int],
        indices: list[int],
        micro_batch_size: int,
        max_tokens: int,
        grad_accum: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not indices:
            raise ConfigError("no training conversations", fix="lower validation.holdout or cache more conversations")
        self.lengths = np.asarray(lengths)
        self.indices = list(indices)
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens
        self.grad_accum = grad_accum
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self._epochs: dict[int, list[list[int]]] = {}

    @property
    def batches_per_step(self) -> int:
        """Global micro-batches one optimizer step consumes (all ranks, all accumulation steps)."""
        return self.world_size * self.grad_accum

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All global micro-batches of an epoch, cut to a whole number of steps (the tail is dropped so that every
        rank runs the same number of forwards; it comes back in another order next epoch)."""
        if epoch not in self._epochs:
            rng = np.random.default_rng([self.seed, epoch])
            batches = bucket_batches(self.lengths, self.indices, self.micro_batch_size, self.max_tokens, rng)
            usable = len(batches) // self.batches_per_step * self.batches_per_step
            if usable == 0:
                raise ConfigError(
                    f"an epoch of {len(self.indices)} conversations makes {len(batches)} micro-batches, fewer than "
                    f"one optimizer step needs (world_size {self.world_size} x train.grad_accum {self.grad_accum}); "
                    "lower train.micro_batch_size / train.max_tokens / train.grad_accum or cache more conversations"
                )
            self._epochs = {epoch: batches[:usable]}  # keep one epoch: a long run must not hold them all
        return self._epochs[epoch]

    def steps_in_epoch(self, epoch: int) -> int:
        return len(self.epoch_batches(epoch)) // self.batches_per_step

    def steps_for_epochs(self, epochs: float) -> int:
        """Optimizer steps in the first ``epochs`` epochs (a fraction counts that share of the last one)."""
        whole = int(epochs)
        steps = sum(self.steps_in_epoch(e) for e in range(whole))
        if epochs > whole:
            steps += int(round((epochs - whole) * self.steps_in_epoch(whole)))
        return steps

    def next_step(self, position: DataPosition) -> tuple[list[list[int]], DataPosition]:
        """This rank's ``grad_accum`` micro-batches for the step at ``position``, and the position after it."""
        epoch, first = position.epoch, position.batch
        if first >= len(self.epoch_batches(epoch)):
            epoch, first = epoch + 1, 0
        batches = self.epoch_batches(epoch)
        mine = [batches[first + a * self.world_size + self.rank] for a in range(self.grad_accum)]
        return mine, DataPosition(epoch, first + self.batches_per_step)


def eval_batches(
    lengths: list[int], indices: list[int], micro_batch_size: int, max_tokens: int, rank: int, world_size: int
) -> list[tuple[list[int], float]]:
    """This rank's share of the held-out set as (micro-batch, weight) pairs, the same for every eval.

    Every rank gets the same number of batches (ZeRO-3 gathers parameters collectively in each forward, so a rank
    that stopped early would hang the others); the padding batches repeat a real one with weight 0.
    """
    if not indices:
        return []
    rng = np.random.default_rng(0)
    batches = bucket_batches(lengths, indices, micro_batch_size, max_tokens, rng)
    mine = [(b, 1.0) for b in batches[rank::world_size]]
    per_rank = -(-len(batches) // world_size)
    while len(mine) < per_rank:
        mine.append((batches[0], 0.0))
    return mine


def pad_batch(samples: list[dict[str, torch.Tensor]], pin_memory: bool = False) -> dict[str, torch.Tensor]:
    """Right-pad a list of cached conversations into a batch of CPU tensors; hidden states become float32.

    Padding positions get ``attention_mask = 0`` and ``loss_mask = 0``; the TTT loss never counts them, and causal
    attention never lets a real position see them (they come after every real token). ``pin_memory`` puts the batch
    in page-locked memory, from which a copy to a GPU runs without blocking the host (CUDA only).
    """
    longest = max(int(s["input_ids"].shape[0]) for s in samples)
    b = len(samples)
    aux_width = samples[0]["aux"].shape[-1]
    final_width = samples[0]["final"].shape[-1]
    out = {
        "input_ids": torch.zeros(b, longest, dtype=torch.int64, pin_memory=pin_memory),
        "loss_mask": torch.zeros(b, longest, dtype=torch.int64, pin_memory=pin_memory),
        "attention_mask": torch.zeros(b, longest, dtype=torch.int64, pin_memory=pin_memory),
        "aux": torch.zeros(b, longest, aux_width, dtype=torch.float32, pin_memory=pin_memory),
        "final": torch.zeros(b, longest, final_width, dtype=torch.float32, pin_memory=pin_memory),
    }
    for i, s in enumerate(samples):
        n = int(s["input_ids"].shape[0])
        out["input_ids"][i, :n] = s["input_ids"]
        out["loss_mask"][i, :n] = s["loss_mask"]
        out["attention_mask"][i, :n] = 1
        out["aux"][i, :n] = s["aux"].float()
        out["final"][i, :n] = s["final"].float()
    return out


def to_device(batch: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """The batch on ``device``; from pinned memory to a GPU the copies are queued and the host goes on. ``rows``
    (the conversations' cache indices, read by the host) stays on the host."""
    return {k: v if k == "rows" else v.to(device, non_blocking=True) for k, v in batch.items()}


def collate(samples: list[dict[str, torch.Tensor]], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """``pad_batch`` on ``device`` (pinned on the way when it is a GPU)."""
    device = torch.device(device)
    return to_device(pad_batch(samples, pin_memory=device.type == "cuda"), device)


class Prefetcher:
    """Micro-batches of a cache, read and padded one ahead on a background thread while the current one trains (or,
    online, computed by the verifier there: ``data/online.py``).

    The caller names every micro-batch (``next(indices, ahead)``: this one, and the one to read meanwhile), so the
    data order, and with it the resume position, is exactly the sampler's. One thread makes every read of
    ``reader`` (``read`` queues behind the read-ahead), so the reader is never used from two threads at once. On
    CUDA the batches are padded into pinned memory and copied to the GPU by the caller's thread without blocking:
    the copy lands on the stream the forward runs on, so no stream bookkeeping is needed.
    """

    def __init__(self, reader: CacheReader | OnlineSource, device: torch.device | str) -> None:
        self.reader = reader
        self.device = torch.device(device)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fledge-data")
        self._ahead: tuple[list[int], Future] | None = None
        from fledge.data.cache import CacheReader

        # A cache's rows are the same bytes every epoch: batches name them (``rows``) so that the teacher's
        # in-vocabulary decisions can be kept across epochs (``train.ttt.InVocabMemo``). Online rows are not named.
        self.names_rows = isinstance(reader, CacheReader)

    def _read(self, indices: list[int]) -> dict[str, torch.Tensor]:
        batch = pad_batch(self.reader.rows(indices), pin_memory=self.device.type == "cuda")
        if self.names_rows:
            batch["rows"] = torch.tensor(indices, dtype=torch.int64)
        return batch

    def next(self, indices: list[int], ahead: list[int] | None = None) -> dict[str, torch.Tensor]:
        """Micro-batch ``indices`` on the device (already read if it was the previous call's ``ahead``); ``ahead``
        starts reading in the background."""
        if self._ahead is not None and self._ahead[0] == indices:
            pending = self._ahead[1]
        else:
            pending = self._pool.submit(self._read, indices)
        self._ahead = (ahead, self._pool.submit(self._read, ahead)) if ahead is not None else None
        return to_device(pending.result(), self.device)

    def read(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """One micro-batch now (held-out evaluation), leaving the read-ahead in place."""
        return to_device(self._pool.submit(self._read, indices).result(), self.device)

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the data thread, after the reads queued before it (``data.mode=cache_first_epoch`` writes its
        shards there: the thread that runs the verifier)."""
        return self._pool.submit(fn).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._ahead = None

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
