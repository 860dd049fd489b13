"""The training-time-test unroll: its attention against a dense reference, its alignment against inference,
the teacher, the loss bookkeeping, and an overfit run on a tiny random verifier."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from fledge.core.errors import ConfigError
from fledge.models.capture import forward_hidden
from fledge.models.draft import DraftKVCache, Eagle3Config, Eagle3Draft
from fledge.models.ttt_attention import ttt_attention
from fledge.train.ttt import (
    InVocabMemo,
    TeacherHead,
    TTTConfig,
    shift_left,
    teacher_targets,
    ttt_forward,
    ttt_unroll,
)

# float64 everywhere below except the overfit run: equalities hold to rounding, so the tolerance is tight.
TOL = dict(rtol=1e-9, atol=1e-10)


pytestmark = pytest.mark.usefixtures("one_thread")


def dense_ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Reference: ordinary attention over all steps' keys concatenated, with the full [T, (k+1)T] mask."""
    t = q.shape[2]
    blocks = [torch.ones(t, t, dtype=torch.bool).tril()] + [torch.eye(t, dtype=torch.bool)] * (len(keys) - 1)
    mask = torch.cat(blocks, dim=1)
    k, v = torch.cat(keys, dim=2), torch.cat(values, dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


class DenseTTTCache:
    """Same interface as models.draft.TTTCache, attending through the dense reference."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def attend(self, q, k, v, attn_mask):
        self.keys.append(k)
        self.values.append(v)
        return dense_ttt_attention(q, self.keys, self.values)


def tiny_draft(seed: int = 0, **over) -> Eagle3Draft:
    kw = dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=40,
        draft_vocab_size=20,
        target_hidden_size=24,
    )
    kw.update(over)
    draft = Eagle3Draft(Eagle3Config(**kw), seed=seed).to(torch.float64)
    with torch.no_grad():
        draft.embed_tokens.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(seed + 100))
        # Larger weights than the 0.02 init, so that attention patterns and logits are far from uniform.
        for p in draft.parameters():
            if p.requires_grad and p.dim() == 2:
                p.mul_(8.0)
    # A draft vocabulary that is not a prefix, so that index mix-ups show.
    cfg = draft.config
    chosen = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))[: cfg.draft_vocab_size]
    chosen = chosen.sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    draft.set_draft_vocab(chosen - torch.arange(cfg.draft_vocab_size), t2d)
    return draft


def random_batch(draft: Eagle3Draft, b: int, t: int, seed: int = 0, pad: list[int] | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    cfg = draft.config
    attention_mask = torch.ones(b, t, dtype=torch.long)
    for row, n in enumerate(pad or []):
        if n:
            attention_mask[row, -n:] = 0
    loss_mask = (torch.rand(b, t, generator=g) < 0.7).long() * attention_mask
    return {
        "input_ids": torch.randint(0, cfg.vocab_size, (b, t), generator=g),
        "loss_mask": loss_mask,
        "attention_mask": attention_mask,
        "aux": torch.randn(b, t, 3 * cfg.target_hidden_size, generator=g, dtype=torch.float64),
        "final": torch.randn(b, t, cfg.target_hidden_size, generator=g, dtype=torch.float64),
    }


def random_head(draft: Eagle3Draft, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 2.0 * torch.randn(draft.config.vocab_size, draft.config.target_hidden_size, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("kernel,chunk", [("flash", 0), ("blocks", 0), ("blocks", 3), ("blocks", 7)],
                         ids=["flash", "whole", "blocks-of-3", "one-block"])
@pytest.mark.parametrize("steps", [1, 2, 4, 7])
def test_ttt_attention_equals_dense_mask_forward_and_grads(steps: int, kernel: str, chunk: int) -> None:
    """The flash kernel with the diagonal merged in; the explicit scores whole, or in recomputed blocks of query rows
    (3: blocks of 3, 3 and 1 rows; 7: the whole as one block)."""
    g = torch.Generator().manual_seed(steps)
    b, h, hkv, t, d = 2, 4, 2, 7, 8
    q = torch.randn(b, h, t, d, generator=g, dtype=torch.float64, requires_grad=True)
    keys = [torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
    values = [torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
    weights = torch.randn(b, h, t, d, generator=g, dtype=torch.float64)

    out = ttt_attention(q, keys, values, chunk, kernel)
    ref = dense_ttt_attention(q, keys, values)
    torch.testing.assert_close(out, ref, **TOL)
    grads = torch.autograd.grad((out * weights).sum(), [q, *keys, *values])
    ref_grads = torch.autograd.grad((ref * weights).sum(), [q, *keys, *values])
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **TOL)


def test_flash_attention_in_bf16_is_the_explicit_scores_to_rounding() -> None:
    """Under bf16 the two kernels round differently (the flash kernel accumulates in float32 throughout); they must
    agree to bf16's rounding, forward and gradients, at every step of a 7-step unroll."""
    g = torch.Generator().manual_seed(3)
    b, h, hkv, t, d = 1, 6, 2, 50, 32
    q = torch.randn(b, h, t, d, generator=g).bfloat16().requires_grad_()
    keys = [torch.randn(b, hkv, t, d, generator=g).bfloat16().requires_grad_() for _ in range(7)]
    values = [torch.randn(b, hkv, t, d, generator=g).bfloat16().requires_grad_() for _ in range(7)]
    weights = torch.randn(b, h, t, d, generator=g).bfloat16()
    for steps in range(1, 8):
        inputs = [q, *keys[:steps], *values[:steps]]
        outs = {k: ttt_attention(q, keys[:steps], values[:steps], 0, k) for k in ("flash", "blocks")}
        grads = {k: torch.autograd.grad((o.float() * weights.float()).sum(), inputs) for k, o in outs.items()}
        torch.testing.assert_close(outs["flash"].float(), outs["blocks"].float(), rtol=2e-2, atol=2e-2)
        for got, want in zip(grads["flash"], grads["blocks"]):
            torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)


def test_a_flash_kernel_that_disagrees_falls_back_to_the_explicit_scores(monkeypatch, caplog) -> None:
    """``auto`` checks the device's kernel once before using it: a wrong one (here, the causal part's output off by
    a little) is caught, warned about, and the unroll runs the explicit scores, with the right numbers."""
    from fledge.models import ttt_attention as module

    real = module._causal_forward

    def wrong(q, k, v, scale):
        out, lse, extra = real(q, k, v, scale)
        return out * 1.01, lse, extra

    monkeypatch.setattr(module, "_causal_forward", wrong)
    monkeypatch.setattr(module, "_FLASH_CHECKED", {})
    with caplog.at_level("WARNING"):
        assert not module.flash_available(torch.device("cpu"))
        assert not module.flash_available(torch.device("cpu"))  # checked once
    assert sum("failed its check" in r.message for r in caplog.records) == 1
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 9, 8, generator=g, dtype=torch.float64)
    keys = [torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    torch.testing.assert_close(ttt_attention(q, keys, keys, 0, "auto"), dense_ttt_attention(q, keys, keys), **TOL)
    with pytest.raises(ConfigError, match="ttt.attention must be one of"):
        ttt_attention(q, keys, keys, 0, "flex")
    monkeypatch.setattr(module, "_FLASH_CHECKED", {})
    monkeypatch.setattr(module, "_causal_forward", real)
    assert module.flash_available(torch.device("cpu"))


@pytest.mark.parametrize("kernel,chunk", [("flash", 0), ("blocks", 0), ("blocks", 4)])
def test_unroll_through_the_model_equals_dense_reference(kernel: str, chunk: int) -> None:
    """The whole unroll (RoPE, GQA, feedback of hidden states) with the efficient cache against the dense one, the
    attention through the flash kernel, or explicit scores whole or in recomputed blocks of 4 query rows."""
    draft = tiny_draft()
    batch = random_batch(draft, 2, 9)
    steps = 4

    def run(cache_cls) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        draft.zero_grad(set_to_none=True)
        fused = draft.fuse(batch["aux"])
        if cache_cls is None:
            outs = list(ttt_unroll(draft, fused, batch["input_ids"], steps, chunk, kernel))
        else:
            cache, hidden, outs = cache_cls(), fused, []
            for k in range(steps):
                hidden = draft(hidden, shift_left(batch["input_ids"], k + 1), torch.arange(9) + k, kv_cache=cache)
                outs.append(hidden)
        loss = sum(draft.logits(o).logsumexp(-1).sum() * (k + 1) for k, o in enumerate(outs))
        loss.backward()
        return outs, [p.grad.clone() for p in draft.parameters() if p.requires_grad]

    outs, grads = run(None)
    ref_outs, ref_grads = run(DenseTTTCache)
    for got, want in zip(outs, ref_outs):
        torch.testing.assert_close(got, want, **TOL)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **TOL)


def test_unroll_equals_inference_chain() -> None:
    """Step k at index t is exactly the k-th chained draft step after a prefix ending at t, as inference runs it:
    prefill (fc(aux_0..t), x_1..x_{t+1}) at positions 0..t into a KV cache, then feed back one token at a time."""
    draft = tiny_draft(seed=1)
    batch = random_batch(draft, 2, 10, seed=1)
    ids = batch["input_ids"]
    steps = 4
    with torch.no_grad():
        fused = draft.fuse(batch["aux"])
        unrolled = list(ttt_unroll(draft, fused, ids, steps))
        # in blocks of 3 query rows (no autograd here, so no recompute): the same hidden states
        for got, want in zip(ttt_unroll(draft, fused, ids, steps, 3), unrolled):
            torch.testing.assert_close(got, want, **TOL)
        for anchor in (0, 3, 5):
            cache = DraftKVCache()
            out = draft(fused[:, : anchor + 1], ids[:, 1 : anchor + 2], torch.arange(anchor + 1), kv_cache=cache)
            torch.testing.assert_close(out[:, anchor], unrolled[0][:, anchor], **TOL)
            hidden = out[:, anchor : anchor + 1]
            for k in range(1, steps):
                token = ids[:, anchor + k + 1 : anchor + k + 2]
                hidden = draft(hidden, token, torch.tensor([anchor + k]), kv_cache=cache)
                torch.testing.assert_close(hidden[:, 0], unrolled[k][:, anchor], **TOL)


def test_single_step_is_the_plain_forward() -> None:
    draft = tiny_draft()
    batch = random_batch(draft, 2, 8)
    with torch.no_grad():
        fused = draft.fuse(batch["aux"])
        (step0,) = list(ttt_unroll(draft, fused, batch["input_ids"], 1))
        plain = draft(fused, shift_left(batch["input_ids"], 1), torch.arange(8))
    torch.testing.assert_close(step0, plain, **TOL)


def test_teacher_chunked_equals_unchunked() -> None:
    draft = tiny_draft()
    batch = random_batch(draft, 3, 11)
    head = random_head(draft)
    probs, in_vocab = teacher_targets(batch["final"], head, draft.t2d, chunk=4)  # 33 positions: a ragged last chunk
    probs_one, in_vocab_one = teacher_targets(batch["final"], head, draft.t2d, chunk=10_000)
    # Chunks change only the blocking of the float32 matrix product: equal up to its rounding.
    torch.testing.assert_close(probs, probs_one, rtol=1e-5, atol=1e-7)
    assert torch.equal(in_vocab, in_vocab_one)
    # The definition: the full distribution restricted to the draft vocabulary and renormalised.
    full = (batch["final"] @ head.T).softmax(-1)
    restricted = full[..., draft.t2d]
    torch.testing.assert_close(probs, (restricted / restricted.sum(-1, keepdim=True)).float(), rtol=1e-5, atol=1e-7)
    assert probs.dtype == torch.float32 and probs.shape == (3, 11, draft.config.draft_vocab_size)
    assert torch.equal(in_vocab, draft.t2d[full.argmax(-1)])
    assert in_vocab.any() and not in_vocab.all(), "the test needs positions on both sides"


def test_teacher_is_float32_under_autocast() -> None:
    draft = tiny_draft()
    final = torch.randn(1, 6, draft.config.target_hidden_size)
    head = random_head(draft).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        probs, _ = teacher_targets(final, head, draft.t2d, chunk=4)
    ref, _ = teacher_targets(final, head, draft.t2d, chunk=4)
    torch.testing.assert_close(probs, ref, rtol=0, atol=0)


def test_in_vocab_memo_gives_the_teachers_numbers_without_the_outside_columns(monkeypatch) -> None:
    """A conversation seen before takes its in-vocabulary decisions from the memo: the same loss and gradients,
    bit for bit, in another batch and at another padded length, and the outside columns are not read at all."""
    draft = tiny_draft(seed=4)
    head = TeacherHead(random_head(draft, seed=4), draft.t2d)
    cfg = TTTConfig(ttt_steps=3, teacher_chunk=5)
    batch = random_batch(draft, 3, 12, seed=4, pad=[0, 2, 5])
    batch["rows"] = torch.tensor([7, 3, 11])

    def loss_and_grads(bt: dict, memo: InVocabMemo | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        draft.zero_grad(set_to_none=True)
        loss, _ = ttt_forward(draft, bt, head, cfg, memo=memo)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in draft.parameters() if p.requires_grad]

    fresh = loss_and_grads(batch, None)
    memo = InVocabMemo()
    first = loss_and_grads(batch, memo)
    assert len(memo) == 3 and memo.positions == 12 + 10 + 7
    # The same conversations in another order, padded to 14 (their batch mates differ in a real run).
    order = torch.tensor([2, 0, 1])
    again = {k: v[order] for k, v in batch.items()}
    for key in ("input_ids", "loss_mask", "attention_mask", "aux", "final"):
        again[key] = torch.cat((again[key], again[key][:, :2] * 0), dim=1)
    fresh_again = loss_and_grads(again, None)

    def no_outside(*args, **kwargs):
        raise AssertionError("the outside columns were read for a conversation the memo holds")

    monkeypatch.setattr(TeacherHead, "fast_outside", no_outside)
    remembered = loss_and_grads(again, memo)
    for got, want in ((first, fresh), (remembered, fresh_again)):
        assert torch.equal(got[0], want[0])
        assert all(torch.equal(g, w) for g, w in zip(got[1], want[1]))
    # A batch with a conversation the memo has not seen is decided afresh (and reads the outside columns).
    unseen = dict(batch, rows=torch.tensor([7, 3, 12]))
    with pytest.raises(AssertionError, match="outside columns"):
        ttt_forward(draft, unseen, head, cfg, memo=memo)
    monkeypatch.undo()
    ttt_forward(draft, unseen, head, cfg, memo=memo)
    assert len(memo) == 4
    # A known conversation whose length differs (another cache under the same index) is not taken from the memo.
    assert memo.lookup([7], [11], 12) is None and memo.lookup([7], [12], 12) is not None
    # At its limit a conversation that does not fit is not stored (12 + 7 positions fit in 20, 10 more do not).
    small = InVocabMemo(max_positions=20)
    ttt_forward(draft, batch, head, cfg, memo=small)
    assert len(small) == 2 and small.positions == 19 and small.lookup([3], [10], 12) is None


def test_loss_alignment_by_hand() -> None:
    """ploss_k, acc_k, tokens and the weighted total recomputed position by position from the alignment rules."""
    draft = tiny_draft(seed=2)
    b, t, steps, decay = 2, 10, 3, 0.7
    batch = random_batch(draft, b, t, seed=2, pad=[0, 3])
    head = random_head(draft, seed=2)
    cfg = TTTConfig(ttt_steps=steps, step_decay=decay, teacher_chunk=7)
    loss, metrics = ttt_forward(draft, batch, head, cfg)

    with torch.no_grad():
        full = batch["final"] @ head.T
        teacher = full[..., draft.t2d].softmax(-1)
        top1_in_vocab = draft.t2d[full.argmax(-1)]
        outs = list(ttt_unroll(draft, draft.fuse(batch["aux"]), batch["input_ids"], steps))
        trained = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        total, dropped = 0.0, 0
        for k in range(steps):
            terms, hits = [], []
            for row in range(b):
                for i in range(t):
                    predicted = i + k + 2  # the token this position drafts
                    if predicted >= t or not batch["loss_mask"][row, predicted]:
                        continue
                    if not batch["attention_mask"][row, predicted]:
                        continue
                    if not top1_in_vocab[row, i + k + 1]:
                        dropped += 1
                        continue
                    logp = F.log_softmax(draft.logits(outs[k][row, i]), -1)
                    target = teacher[row, i + k + 1]
                    terms.append(-(target * logp).sum())
                    hits.append(float(logp.argmax() == target.argmax()))
            assert terms, "every step needs counted positions for this test"
            ploss = float(torch.stack(terms).mean())
            if k == 0:
                assert metrics["tokens"] == len(terms)
            assert metrics[f"ploss_{k}"] == pytest.approx(ploss, rel=1e-6)
            assert metrics[f"acc_{k}"] == pytest.approx(sum(hits) / len(hits), abs=1e-6)
            total += decay**k * ploss
        # tau_chain: from each position of step 0, the steps in a row whose top-1 is the teacher's
        lengths = 0
        for row in range(b):
            for i in range(t):
                for k in range(steps):
                    predicted = i + k + 2
                    if predicted >= t or not trained[row, predicted] or not top1_in_vocab[row, i + k + 1]:
                        break
                    if draft.logits(outs[k][row, i]).argmax() != teacher[row, i + k + 1].argmax():
                        break
                    lengths += 1
    assert dropped > 0, "the test needs positions whose verifier top-1 is outside the draft vocabulary"
    assert float(loss.detach()) == pytest.approx(total, rel=1e-6) and metrics["loss"] == pytest.approx(total, rel=1e-6)
    assert metrics["tau_chain"] == pytest.approx(1.0 + lengths / float(metrics["tokens"]), abs=1e-6)


@pytest.mark.parametrize("top_k", [4, 10])
def test_reachability_mask_by_hand(top_k: int) -> None:
    """``mask_top_k`` (GRIFFIN's mask): step k >= 1 keeps a position only while every token its chain was fed so far
    was among the draft's top K at the step before; the loss and every gradient recomputed position by position."""
    draft = tiny_draft(seed=4)
    b, t, steps, decay = 4, 24, 3, 0.8
    batch = random_batch(draft, b, t, seed=4, pad=[0, 2])
    # Every token trained, fed from the draft vocabulary, and a teacher whose top-1 is mostly in it: more chains
    # survive to be checked.
    batch["loss_mask"] = batch["attention_mask"].clone()
    batch["input_ids"] = draft.t2d.nonzero().squeeze(1)[batch["input_ids"] % draft.config.draft_vocab_size]
    head = random_head(draft, seed=4)
    head[~draft.t2d] *= 0.2
    cfg = TTTConfig(ttt_steps=steps, step_decay=decay, mask_top_k=top_k, loss_chunk=5)
    params = [p for p in draft.parameters() if p.requires_grad]
    draft.zero_grad(set_to_none=True)
    loss, metrics = ttt_forward(draft, batch, head, cfg)
    loss.backward()
    got = [p.grad.clone() for p in params]

    draft.zero_grad(set_to_none=True)
    to_draft = torch.cumsum(draft.t2d.long(), 0) - 1
    full = batch["final"] @ head.T
    # the teacher's probabilities are float32 in training (``teacher_targets``)
    teacher = (batch["final"].float() @ head[draft.t2d].float().T).softmax(-1).double()
    top1_in_vocab = draft.t2d[full.argmax(-1)]
    outs = list(ttt_unroll(draft, draft.fuse(batch["aux"]), batch["input_ids"], steps))
    trained = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    reach = torch.ones(b, t, dtype=torch.bool)
    want = 0.0
    kept = []
    for k in range(steps):
        terms, next_reach = [], torch.zeros(b, t, dtype=torch.bool)
        for row in range(b):
            for i in range(t):
                predicted = i + k + 2
                if predicted >= t or not trained[row, predicted] or not top1_in_vocab[row, i + k + 1]:
                    continue
                if not reach[row, i]:
                    continue
                logits = draft.logits(outs[k][row, i])
                terms.append(-(teacher[row, i + k + 1] * F.log_softmax(logits, -1)).sum())
                fed = int(batch["input_ids"][row, predicted])
                if draft.t2d[fed]:
                    mine = logits[to_draft[fed]]
                    next_reach[row, i] = bool((logits > mine).sum() < top_k)
        kept.append(len(terms))
        if terms:
            want = want + decay**k * torch.stack(terms).mean()
        reach = next_reach
    assert kept[0] > kept[1] > kept[2] > 0, kept
    want.backward()
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-9)
    for g, p in zip(got, params):
        torch.testing.assert_close(g, p.grad, **TOL)
    # Held out (no grad) every position counts, as without the mask.
    with torch.no_grad():
        _, masked = ttt_forward(draft, batch, head, cfg)
        _, plain = ttt_forward(draft, batch, head, TTTConfig(ttt_steps=steps, step_decay=decay))
    assert masked == plain


def test_padding_and_untrained_positions_do_not_leak() -> None:
    """Whatever sits in padding changes neither the loss nor a single gradient."""
    draft = tiny_draft(seed=3)
    batch = random_batch(draft, 2, 10, seed=3, pad=[2, 4])
    head = random_head(draft, seed=3)
    cfg = TTTConfig(ttt_steps=3)

    def loss_and_grads(bt: dict) -> tuple[float, list[torch.Tensor]]:
        draft.zero_grad(set_to_none=True)
        loss, _ = ttt_forward(draft, bt, head, cfg)
        loss.backward()
        return float(loss.detach()), [p.grad.clone() for p in draft.parameters() if p.requires_grad]

    base_loss, base_grads = loss_and_grads(batch)
    noisy = {k: v.clone() for k, v in batch.items()}
    g = torch.Generator().manual_seed(9)
    pad = batch["attention_mask"] == 0
    noisy["input_ids"][pad] = torch.randint(0, draft.config.vocab_size, (int(pad.sum()),), generator=g)
    noisy["aux"][pad] = torch.randn(int(pad.sum()), noisy["aux"].shape[-1], generator=g, dtype=torch.float64)
    noisy["final"][pad] = torch.randn(int(pad.sum()), noisy["final"].shape[-1], generator=g, dtype=torch.float64)
    noisy_loss, noisy_grads = loss_and_grads(noisy)
    assert noisy_loss == pytest.approx(base_loss, rel=1e-12)
    for got, want in zip(noisy_grads, base_grads):
        torch.testing.assert_close(got, want, **TOL)


def test_nothing_to_learn_still_backpropagates() -> None:
    draft = tiny_draft()
    batch = random_batch(draft, 1, 6)
    batch["loss_mask"].zero_()
    loss, metrics = ttt_forward(draft, batch, random_head(draft), TTTConfig(ttt_steps=2))
    loss.backward()
    assert float(loss.detach()) == 0.0 and metrics["tokens"] == 0.0 and metrics["acc_0"] == 0.0


def test_ttt_config_validation() -> None:
    with pytest.raises(ValueError, match="ttt_steps"):
        TTTConfig(ttt_steps=0)
    with pytest.raises(ValueError, match="step_decay"):
        TTTConfig(step_decay=1.5)
    with pytest.raises(ConfigError, match="ttt.attention must be one of auto, flash, blocks"):
        TTTConfig(attention="dense")
    with pytest.raises(ConfigError, match="ttt.mask_top_k must be >= 0"):
        TTTConfig(mask_top_k=-1)
    with pytest.raises(ConfigError, match=r"ttt.step0_share must lie in \[0, 1\)"):
        TTTConfig(step0_share=-0.1)
    assert [TTTConfig(ttt_steps=3, step0_share=0.35).steps_at(p) for p in (0.0, 0.34, 0.35, 1.0)] == [1, 1, 3, 3]
    assert TTTConfig(ttt_steps=3).steps_at(0.0) == 3


def test_a_shorter_unroll_of_a_config_is_that_unrolls_own_loss() -> None:
    """``steps=k`` of a longer config (``ttt.step0_share``'s first share) gives the loss, the gradients and the
    metrics of a config of k steps, in float64; a length outside [1, ttt_steps] is refused."""
    draft = tiny_draft()
    batch = random_batch(draft, 2, 12, pad=[0, 3])
    head = random_head(draft)

    def run(cfg: TTTConfig, steps: int | None = None):
        draft.zero_grad()
        loss, metrics = ttt_forward(draft, batch, head, cfg, steps=steps)
        loss.backward()
        return loss.detach(), metrics, [p.grad.clone() for p in draft.parameters() if p.grad is not None]

    for k in (1, 2):
        got, want = run(TTTConfig(ttt_steps=3), steps=k), run(TTTConfig(ttt_steps=k))
        torch.testing.assert_close(got[0], want[0], **TOL)
        assert got[1].keys() == want[1].keys() and f"acc_{k}" not in got[1]
        for a, b in zip(got[2], want[2]):
            torch.testing.assert_close(a, b, **TOL)
    for bad in (0, 4):
        with pytest.raises(ValueError, match=r"steps must lie in \[1, ttt.ttt_steps=3\]"):
            ttt_forward(draft, batch, head, TTTConfig(ttt_steps=3), steps=bad)


def test_draft_overfits_a_tiny_verifier_cache() -> None:
    """A few sequences through a tiny random Llama verifier, captured as the cache would; the draft memorises them."""
    torch.manual_seed(0)
    verifier_cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=200,
    )
    verifier = LlamaForCausalLM(verifier_cfg).eval()
    with torch.no_grad():
        # A random verifier's next-token distribution is almost flat; a sharper head gives a teacher worth matching.
        verifier.lm_head.weight.mul_(30.0)
    ids = torch.randint(0, 200, (4, 48))
    attention_mask = torch.ones_like(ids)
    aux_layer_ids = [1, 2, 3]
    captured = forward_hidden(verifier, ids, attention_mask, aux_layer_ids)
    batch = {
        "input_ids": ids,
        "loss_mask": torch.ones_like(ids),
        "attention_mask": attention_mask,
        "aux": torch.cat(captured.aux, dim=-1),
        "final": captured.final,
    }

    draft = Eagle3Draft(Eagle3Config.from_verifier(verifier_cfg, 160, aux_layer_ids), seed=0)
    draft.load_verifier_embedding(verifier.model.embed_tokens.weight)
    chosen = torch.randperm(200, generator=torch.Generator().manual_seed(1))[:160].sort().values
    t2d = torch.zeros(200, dtype=torch.bool)
    t2d[chosen] = True
    draft.set_draft_vocab(chosen - torch.arange(160), t2d)

    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    total_steps = 150
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / total_steps)
    cfg = TTTConfig(ttt_steps=2)
    first = None
    for _ in range(total_steps):
        loss, metrics = ttt_forward(draft, batch, verifier.lm_head.weight, cfg)
        first = first or metrics
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    with torch.no_grad():
        _, metrics = ttt_forward(draft, batch, verifier.lm_head.weight, cfg)
    assert first["acc_0"] < 0.2
    assert metrics["acc_0"] > 0.95, metrics
    assert metrics["acc_1"] > 0.8, metrics
    assert metrics["ploss_0"] < 0.5 * first["ploss_0"]
    assert not draft.embed_tokens.weight.requires_grad
    torch.testing.assert_close(draft.embed_tokens.weight, verifier.model.embed_tokens.weight, rtol=0, atol=0)
