"""The draft vocabulary: counts over loss-masked tokens, top-k choice, d2t / t2d consistency, files, damage checks."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from fledge.data.template import Tokenized
from fledge.data.vocab import (
    build_draft_vocab,
    check_draft_vocab,
    count_tokens,
    draft_to_target,
    load_draft_vocab,
    save_draft_vocab,
)


def assert_consistent(d2t: torch.Tensor, t2d: torch.Tensor, k: int, vocab_size: int) -> torch.Tensor:
    assert d2t.dtype == torch.int64 and d2t.shape == (k,)
    assert t2d.dtype == torch.bool and t2d.shape == (vocab_size,)
    assert int(t2d.sum()) == k
    targets = torch.arange(k) + d2t
    assert t2d[targets].all()
    assert (targets[1:] > targets[:-1]).all()  # ascending, hence distinct
    assert torch.equal(targets, t2d.nonzero().flatten())  # draft id order == target id order
    check_draft_vocab(d2t, t2d)
    return targets


def test_count_tokens_counts_only_loss_masked_positions():
    samples = [
        Tokenized(input_ids=[5, 6, 7, 7, 9], loss_mask=[0, 0, 1, 1, 1], truncated=False),
        Tokenized(input_ids=[5, 5, 3], loss_mask=[1, 0, 1], truncated=True),
    ]
    counts = count_tokens(samples, vocab_size=12)
    assert counts.dtype == torch.int64 and counts.shape == (12,)
    expected = torch.zeros(12, dtype=torch.int64)
    expected[7], expected[9], expected[5], expected[3] = 2, 1, 1, 1
    assert torch.equal(counts, expected)  # token 6 and the unmasked 5s never count
    with pytest.raises(ValueError, match="token id 12 is outside the verifier vocabulary of 12"):
        count_tokens([Tokenized([12], [1], False)], vocab_size=12)
    assert int(count_tokens([Tokenized([12], [0], False)], vocab_size=12).sum()) == 0  # unmasked: not looked at
    with pytest.raises(ValueError, match="2 input ids but 1"):
        count_tokens([Tokenized([1, 2], [1], False)], vocab_size=12)


def test_top_k_by_frequency_ties_to_lower_id_sorted_ascending():
    counts = torch.tensor([0, 5, 9, 5, 1, 9, 0, 7, 5, 2], dtype=torch.int64)
    d2t, t2d = build_draft_vocab(counts, draft_vocab_size=5)
    targets = assert_consistent(d2t, t2d, 5, 10)
    # by frequency: 2 (9), 5 (9), 7 (7), then the 5s: 1 and 3 win the tie over 8
    assert targets.tolist() == [1, 2, 3, 5, 7]
    assert d2t.tolist() == [1, 1, 1, 2, 3]
    # every chosen token is at least as frequent as every one left out
    assert counts[t2d].min() >= counts[~t2d].max()


def test_frequency_order_on_a_larger_random_corpus():
    g = torch.Generator().manual_seed(0)
    vocab_size, k = 1000, 64
    ids = torch.multinomial(torch.linspace(1, 0.01, vocab_size) ** 4, 20_000, replacement=True, generator=g)
    sample = Tokenized(ids.tolist(), [1] * ids.numel(), False)
    counts = count_tokens([sample], vocab_size)
    d2t, t2d = build_draft_vocab(counts, k)
    assert_consistent(d2t, t2d, k, vocab_size)
    assert counts[t2d].min() >= counts[~t2d].max()
    # the same choice made independently: sort (−count, id) pairs in Python
    expected = sorted(sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))[:k])
    assert t2d.nonzero().flatten().tolist() == expected


def test_padding_with_lowest_unused_ids_when_the_corpus_is_small():
    counts = torch.zeros(20, dtype=torch.int64)
    counts[[17, 4, 9]] = torch.tensor([3, 1, 2])
    d2t, t2d = build_draft_vocab(counts, draft_vocab_size=7)
    targets = assert_consistent(d2t, t2d, 7, 20)
    assert targets.tolist() == [0, 1, 2, 3, 4, 9, 17]  # the 3 seen tokens + the lowest unused ids 0, 1, 2, 3
    d2t, t2d = build_draft_vocab(torch.zeros(6, dtype=torch.int64), 6)  # nothing seen, k == V: the identity
    assert d2t.tolist() == [0] * 6 and bool(t2d.all())


def test_draft_vocab_larger_than_the_verifier_vocab_is_an_error():
    with pytest.raises(ValueError, match=r"draft_vocab_size 33 .* vocab_size 32"):
        build_draft_vocab(torch.ones(32, dtype=torch.int64), 33)
    with pytest.raises(ValueError, match="draft_vocab_size 0"):
        build_draft_vocab(torch.ones(32, dtype=torch.int64), 0)


def test_draft_to_target_round_trip():
    counts = torch.randint(0, 50, (300,), generator=torch.Generator().manual_seed(1))
    d2t, t2d = build_draft_vocab(counts, 40)
    draft_ids = torch.arange(40)
    targets = draft_to_target(draft_ids, d2t)
    assert t2d[targets].all()
    # back again: a chosen target's draft id is its rank among the chosen ids
    t2d_index = torch.cumsum(t2d.long(), 0) - 1
    assert torch.equal(t2d_index[targets], draft_ids)
    batch = torch.tensor([[0, 39], [5, 5]])
    assert torch.equal(draft_to_target(batch, d2t), targets[batch])


def test_save_and_load(tmp_path):
    counts = torch.randint(0, 9, (100,), generator=torch.Generator().manual_seed(2))
    d2t, t2d = build_draft_vocab(counts, 16)
    path = tmp_path / "vocab" / "draft_vocab.safetensors"
    save_draft_vocab(path, d2t, t2d, counts)
    d2t2, t2d2 = load_draft_vocab(path)
    assert torch.equal(d2t, d2t2) and torch.equal(t2d, t2d2)
    assert torch.equal(load_file(str(path))["counts"], counts)
    assert not list(path.parent.glob("*.tmp"))
    # a damaged file is refused on load, naming the file
    bad = d2t.clone()
    bad[3] = bad[2] + 2 - 3  # draft 3 -> the target of draft 2
    save_file({"d2t": bad, "t2d": t2d}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match=r"bad.safetensors: d2t maps several draft ids"):
        load_draft_vocab(tmp_path / "bad.safetensors")
    save_file({"d2t": d2t}, str(tmp_path / "half.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['t2d'\]"):
        load_draft_vocab(tmp_path / "half.safetensors")
    with pytest.raises(FileNotFoundError):
        load_draft_vocab(tmp_path / "none.safetensors")
    with pytest.raises(ValueError, match="d2t maps several"):
        save_draft_vocab(tmp_path / "never.safetensors", bad, t2d, counts)


def test_checker_names_each_kind_of_damage():
    counts = torch.arange(50, dtype=torch.int64)
    d2t, t2d = build_draft_vocab(counts, 10)  # targets 40..49
    check_draft_vocab(d2t, t2d)

    def damaged_d2t(i: int, target: int) -> torch.Tensor:
        out = d2t.clone()
        out[i] = target - i
        return out

    descending = torch.arange(49, 39, -1) - torch.arange(10)  # the same ids, draft order reversed
    cases = [
        ((damaged_d2t(9, 50), t2d), "draft id 9 to target id 50, outside 0..49"),
        ((damaged_d2t(0, -1), t2d), "draft id 0 to target id -1, outside 0..49"),
        ((damaged_d2t(5, 44), t2d), "several draft ids to target id 44"),
        ((descending, t2d), "not ascending at draft id 1"),
        ((d2t, t2d.clone().index_fill_(0, torch.tensor([0]), True)), "t2d marks 11 target ids"),
        ((d2t, t2d.clone().index_fill_(0, torch.tensor([0]), True).index_fill_(0, torch.tensor([49]), False)),
         "t2d does not mark target id 49"),
        ((d2t, t2d[:45]), "outside 0..44"),
        ((d2t.int(), t2d), "int64"),
        ((d2t, t2d.long()), "bool"),
        ((d2t[:0], t2d), "between 1 and"),
    ]
    for (bad_d2t, bad_t2d), message in cases:
        with pytest.raises(ValueError, match=message):
            check_draft_vocab(bad_d2t, bad_t2d)
