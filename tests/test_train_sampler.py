"""Length-bucketed batches: deterministic from the seed, each conversation once per epoch, sharded by rank so that
two ranks see what one process sees with grad_accum=2, resumable from a saved position; right-padding collate; the
read-ahead thread gives the batches asked for, in order."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from fledge.train.sampler import BucketSampler, DataPosition, Prefetcher, bucket_batches, collate, eval_batches

LENGTHS = [int(x) for x in np.random.default_rng(0).integers(5, 300, size=203)]


def flatten(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def test_buckets_cover_every_sequence_once_and_are_deterministic():
    ids = list(range(3, 203))  # the first three are held out
    a = bucket_batches(LENGTHS, ids, 4, 0, np.random.default_rng([7, 0]))
    b = bucket_batches(LENGTHS, ids, 4, 0, np.random.default_rng([7, 0]))
    c = bucket_batches(LENGTHS, ids, 4, 0, np.random.default_rng([7, 1]))
    assert a == b and a != c
    assert sorted(flatten(a)) == ids and sorted(flatten(c)) == ids
    assert all(len(batch) == 4 for batch in a[:-1] if len(batch) != len(ids) % 4)
    # Bucketing: far less padding than the same batches drawn without sorting.
    def padding(batches):
        return sum(max(LENGTHS[i] for i in bt) * len(bt) - sum(LENGTHS[i] for i in bt) for bt in batches)

    rng = np.random.default_rng(0)
    shuffled = rng.permutation(ids).tolist()
    unsorted = [shuffled[i : i + 4] for i in range(0, len(shuffled), 4)]
    assert padding(a) < 0.5 * padding(unsorted)


def test_token_budget():
    ids = list(range(len(LENGTHS)))
    batches = bucket_batches(LENGTHS, ids, 1, 600, np.random.default_rng(0))
    assert sorted(flatten(batches)) == ids
    for bt in batches:
        assert max(LENGTHS[i] for i in bt) * len(bt) <= 600 or len(bt) == 1
    assert max(len(bt) for bt in batches) > 4  # short sequences share a batch


def test_two_ranks_see_what_one_process_sees_with_accumulation():
    ids = list(range(len(LENGTHS)))
    single = BucketSampler(LENGTHS, ids, 4, 0, grad_accum=2, seed=3)
    ranks = [BucketSampler(LENGTHS, ids, 4, 0, grad_accum=1, seed=3, rank=r, world_size=2) for r in (0, 1)]
    pos_single, pos_ranks = DataPosition(), [DataPosition(), DataPosition()]
    steps = single.steps_in_epoch(0)
    assert steps == ranks[0].steps_in_epoch(0) == len(ids) // 8
    seen: list[list[int]] = []
    for _ in range(steps + 3):  # into the next epoch
        mine, pos_single = single.next_step(pos_single)
        theirs = []
        for r in (0, 1):
            got, pos_ranks[r] = ranks[r].next_step(pos_ranks[r])
            theirs += got
        assert mine == theirs
        assert not set(theirs[0]) & set(theirs[1])
        seen.append(flatten(mine))
    assert pos_single == pos_ranks[0] == pos_ranks[1] == DataPosition(1, 6)
    first_epoch = flatten(seen[:steps])
    assert len(set(first_epoch)) == len(first_epoch) >= len(ids) - 8  # only the tail that fills no step is left


def test_resume_from_a_saved_position_continues_the_same_sequence():
    ids = list(range(len(LENGTHS)))
    run = BucketSampler(LENGTHS, ids, 4, 0, grad_accum=1, seed=5)
    pos = DataPosition()
    full = []
    for _ in range(80):
        batches, pos = run.next_step(pos)
        full.append(batches)
    saved = DataPosition()
    for _ in range(30):
        _, saved = run.next_step(saved)
    resumed = BucketSampler(LENGTHS, ids, 4, 0, grad_accum=1, seed=5)  # a fresh process
    rest = []
    for _ in range(50):
        batches, saved = resumed.next_step(saved)
        rest.append(batches)
    assert rest == full[30:]


def test_epoch_too_small_for_one_step_is_a_clear_error():
    sampler = BucketSampler([10] * 6, list(range(6)), 4, 0, grad_accum=2, seed=0, world_size=2)
    with pytest.raises(ValueError, match="fewer than one optimizer step needs"):
        sampler.next_step(DataPosition())


def test_steps_for_epochs():
    sampler = BucketSampler(LENGTHS, list(range(200)), 4, 0, grad_accum=1, seed=0)
    assert sampler.steps_for_epochs(2) == 100 and sampler.steps_for_epochs(1.5) == 75


def test_eval_batches_are_split_evenly_across_ranks():
    ids = list(range(190, 203))
    shares = [eval_batches(LENGTHS, ids, 2, 0, rank=r, world_size=3) for r in range(3)]
    assert len({len(s) for s in shares}) == 1  # every rank runs the same number of forwards (ZeRO-3)
    real = [i for s in shares for batch, w in s if w == 1.0 for i in batch]
    assert sorted(real) == ids
    assert sum(w == 0.0 for s in shares for _, w in s) == 3 * len(shares[0]) - 7


def test_collate_pads_on_the_right():
    def sample(n: int, h: int = 3) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.arange(1, n + 1),
            "loss_mask": torch.ones(n, dtype=torch.int64),
            "aux": torch.ones(n, 3 * h, dtype=torch.bfloat16),
            "final": torch.full((n, h), 2.0, dtype=torch.bfloat16),
        }

    batch = collate([sample(2), sample(4)])
    assert batch["input_ids"].tolist() == [[1, 2, 0, 0], [1, 2, 3, 4]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch["aux"].dtype == torch.float32 and batch["aux"][0, 2:].abs().sum() == 0
    assert batch["final"][1, 3, 0] == 2.0


class RecordingReader:
    """Conversations of lengths 3..8 with distinct values, and the threads that read them."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.threads.append(threading.current_thread().name)
        n = 3 + i % 6
        return {"input_ids": torch.arange(n) + 100 * i, "loss_mask": torch.ones(n, dtype=torch.int64),
                "aux": torch.full((n, 6), float(i), dtype=torch.bfloat16), "final": torch.full((n, 2), -float(i))}

    def rows(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:  # what the Prefetcher calls
        return [self[i] for i in indices]


def test_prefetcher_gives_the_batches_asked_for_read_on_one_thread():
    reader = RecordingReader()
    order = [[0, 1], [2], [3, 4, 5], [6, 7]]
    with Prefetcher(reader, "cpu") as data:
        got = [data.next(order[0], ahead=order[1])]
        assert data.read([9]).keys() == got[0].keys()  # a held-out read between two steps keeps the read-ahead
        got += [data.next(b, ahead=a) for b, a in zip(order[1:], order[2:] + [None])]
        stray = data.next([8])  # not the announced batch: read now, correctly
    for batch, ids in zip(got + [stray], order + [[8]]):
        want = collate([RecordingReader()[i] for i in ids])
        assert batch.keys() == want.keys() and all(torch.equal(batch[k], want[k]) for k in want)
        assert not batch["aux"].is_pinned()  # pinned memory only for a GPU
    assert set(reader.threads) == {"fledge-data_0"}
    assert len(reader.threads) == sum(len(b) for b in order) + 2  # each conversation read once, +[9] and [8]
