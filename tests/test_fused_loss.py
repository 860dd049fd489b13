"""The fused, chunked TTT loss and the split teacher against the plain per-step implementation they replace:
float64 losses, metrics and gradients for every step, with masks, padding and dropped positions; the bf16 fast
teacher against the float32 rule on near-ties."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fledge.models.fused_ce import fused_soft_cross_entropy
from fledge.train.ttt import TeacherHead, TTTConfig, shift_left, teacher_targets, ttt_forward, ttt_unroll
from test_ttt import TOL, random_batch, random_head, tiny_draft

pytestmark = pytest.mark.usefixtures("one_thread")


def plain_ttt_forward(draft, batch, head, cfg: TTTConfig):
    """The implementation before the fused loss: per step, full logits of the counted positions, log-softmax and the
    gathered teacher rows, all kept by autograd. The teacher is the same function's (it is checked against its
    definition in tests/test_ttt.py and below), so that the loss is compared alone."""
    input_ids = batch["input_ids"]
    teacher, in_vocab = teacher_targets(batch["final"], head, draft.t2d, cfg.teacher_chunk)
    trained = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    total, metrics = 0.0, {}
    outs = ttt_unroll(draft, draft.fuse(batch["aux"]), input_ids, cfg.ttt_steps, cfg.attention_chunk)
    for k, hidden in enumerate(outs):
        counted = shift_left(trained, k + 2, False) & shift_left(in_vocab, k + 1, False)
        rows, cols = counted.nonzero(as_tuple=True)
        if k == 0:
            metrics["tokens"] = rows.numel()
        if rows.numel() == 0:
            metrics[f"ploss_{k}"] = metrics[f"acc_{k}"] = 0.0
            continue
        logits = draft.logits(hidden[rows, cols])
        target = teacher[rows, cols + k + 1]
        ploss = -(target * F.log_softmax(logits, dim=-1)).sum(-1).mean()
        metrics[f"ploss_{k}"] = float(ploss.detach())
        metrics[f"acc_{k}"] = float((logits.argmax(-1) == target.argmax(-1)).double().mean())
        total = total + cfg.step_decay**k * ploss
    return total, metrics


def grads_of(draft, loss) -> list[torch.Tensor]:
    draft.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in draft.parameters() if p.requires_grad]


@pytest.mark.parametrize("loss_chunk", [1, 4, 1000], ids=["rows-of-1", "ragged-4", "one-chunk"])
@pytest.mark.parametrize("steps", [1, 3, 5])
def test_fused_loss_equals_plain_loss_and_gradients_in_float64(steps: int, loss_chunk: int) -> None:
    draft = tiny_draft(seed=4)
    batch = random_batch(draft, 3, 13, seed=4, pad=[0, 4, 9])
    head = random_head(draft, seed=4)
    # teacher_chunk=1: the float32 teacher row by row, bitwise the same whichever rows it is computed with (the
    # fused path computes only the rows the loss reads, the plain one all of them)
    cfg = TTTConfig(ttt_steps=steps, step_decay=0.7, loss_chunk=loss_chunk, teacher_chunk=1)

    plain_loss, plain_metrics = plain_ttt_forward(draft, batch, head, cfg)
    plain_grads = grads_of(draft, plain_loss)
    loss, metrics = ttt_forward(draft, batch, head, cfg)
    assert loss.dtype == torch.float64
    grads = grads_of(draft, loss)

    torch.testing.assert_close(loss.detach(), plain_loss.detach(), **TOL)
    assert metrics["tokens"] == plain_metrics["tokens"] > 0
    for k in range(steps):
        assert float(metrics[f"ploss_{k}"]) == pytest.approx(plain_metrics[f"ploss_{k}"], rel=1e-6)
        assert float(metrics[f"acc_{k}"]) == pytest.approx(plain_metrics[f"acc_{k}"], abs=1e-7)
    for got, want in zip(grads, plain_grads):
        torch.testing.assert_close(got, want, **TOL)
    assert any(g.abs().sum() > 0 for g in grads)


def test_fused_loss_each_step_alone_equals_plain() -> None:
    """Every TTT step's own gradient (decay 1 and one step weighted at a time is what the sum is made of): a weight
    mix-up between steps would cancel in the total of one test but not here."""
    draft = tiny_draft(seed=5)
    batch = random_batch(draft, 2, 11, seed=5, pad=[0, 3])
    head = random_head(draft, seed=5)
    for decay in (1.0, 0.25):
        cfg = TTTConfig(ttt_steps=4, step_decay=decay, loss_chunk=3)
        plain_loss, _ = plain_ttt_forward(draft, batch, head, cfg)
        plain_grads = grads_of(draft, plain_loss)
        loss, _ = ttt_forward(draft, batch, head, cfg)
        for got, want in zip(grads_of(draft, loss), plain_grads):
            torch.testing.assert_close(got, want, **TOL)


def test_fused_loss_with_nothing_counted_runs_the_head_with_zero_gradient() -> None:
    draft = tiny_draft()
    batch = random_batch(draft, 1, 6)
    batch["loss_mask"].zero_()
    calls = []
    handle = draft.lm_head.register_forward_hook(lambda *a: calls.append(1))
    loss, metrics = ttt_forward(draft, batch, random_head(draft), TTTConfig(ttt_steps=3))
    handle.remove()
    grads = grads_of(draft, loss)
    assert calls == [1], "the head must run once on every rank, counted or not"
    assert float(loss.detach()) == 0.0 and metrics["tokens"] == 0.0
    assert draft.lm_head.weight.grad is not None and all(float(g.abs().sum()) == 0.0 for g in grads)


def test_fused_cross_entropy_under_no_grad_keeps_nothing_and_matches() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(4, 5, generator=g).softmax(-1)
    index = torch.randint(0, 4, (9,), generator=g)
    row_weight = torch.rand(9, generator=g, dtype=torch.float64)
    loss, ce, correct = fused_soft_cross_entropy(x, w, teacher, index, row_weight, 2)
    with torch.no_grad():
        loss_ng, ce_ng, correct_ng = fused_soft_cross_entropy(x, w, teacher, index, row_weight, 2)
    assert loss_ng.grad_fn is None and torch.equal(ce, ce_ng) and torch.equal(correct, correct_ng)
    ref_ce = -(teacher[index].double() * F.log_softmax(x @ w.T, -1)).sum(-1)
    torch.testing.assert_close(ce, ref_ce.detach(), **TOL)
    torch.testing.assert_close(loss, (ref_ce * row_weight).sum(), **TOL)
    gx, gw = torch.autograd.grad(3.0 * loss, [x, w])
    rx, rw = torch.autograd.grad(3.0 * (ref_ce * row_weight).sum(), [x, w])
    torch.testing.assert_close(gx, rx, **TOL)
    torch.testing.assert_close(gw, rw, **TOL)
    with pytest.raises(ValueError, match="chunk"):
        fused_soft_cross_entropy(x, w, teacher, index, row_weight, 0)


def test_fused_loss_under_bf16_autocast_is_the_plain_loss_to_rounding() -> None:
    draft = tiny_draft(seed=6).float()
    batch = {k: v.float() if v.is_floating_point() else v for k, v in random_batch(draft, 2, 12, seed=6).items()}
    head = random_head(draft, seed=6).float()
    cfg = TTTConfig(ttt_steps=3, loss_chunk=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain_loss, _ = plain_ttt_forward(draft, batch, head, cfg)
        loss, _ = ttt_forward(draft, batch, head, cfg)
    plain_grads, grads = grads_of(draft, plain_loss), grads_of(draft, loss)
    torch.testing.assert_close(loss.detach(), plain_loss.detach().float(), rtol=2e-2, atol=1e-3)
    for got, want in zip(grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2 * float(want.abs().max()))


def test_loss_chunk_is_validated() -> None:
    with pytest.raises(ValueError, match="ttt.loss_chunk"):
        TTTConfig(loss_chunk=0)
    with pytest.raises(ValueError, match="ttt.loss_chunk"):
        TTTConfig(loss_chunk=-3)


def near_tie_head(vocab: int, width: int, t2d: torch.Tensor, x: torch.Tensor, gap: float) -> torch.Tensor:
    """A random head in which, for every row of x, the best outside column and the best inside column lie ``gap``
    apart (alternating which side wins): far below bf16's resolution at these logit sizes."""
    g = torch.Generator().manual_seed(11)
    head = torch.randn(vocab, width, generator=g)
    inside, outside = t2d.nonzero().squeeze(1), (~t2d).nonzero().squeeze(1)
    for i, row in enumerate(x):
        a, b = inside[i % inside.numel()], outside[i % outside.numel()]
        unit = row / row.dot(row)
        top = float((head @ row).max()) + 5.0
        head[a] += (top - head[a].dot(row)) * unit
        head[b] += (top + (gap if i % 2 else -gap) - head[b].dot(row)) * unit
    return head


def test_fast_teacher_decides_exactly_as_float32_on_near_ties() -> None:
    vocab, width, n = 64, 48, 12
    g = torch.Generator().manual_seed(3)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.randperm(vocab, generator=g)[:24]] = True
    x = torch.randn(n, width, generator=g)
    head = near_tie_head(vocab, width, t2d, x, gap=1e-3)
    final = torch.cat([x, torch.randn(20, width, generator=g)])[None]  # near-ties, then ordinary rows

    ref_probs, ref_in = teacher_targets(final, head, t2d, chunk=7)
    full = final @ head.T
    assert torch.equal(ref_in, t2d[full.argmax(-1)])
    bf16_top = t2d[(final.bfloat16() @ head.bfloat16().T).float().argmax(-1)]
    assert not torch.equal(bf16_top, ref_in), "the test needs rows that a bf16 pass alone decides wrongly"

    teacher = TeacherHead(head, t2d)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        probs, in_vocab, top = teacher.targets(final, chunk=7)
    assert torch.equal(in_vocab, ref_in)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-6, atol=1e-7)
    assert torch.equal(top, probs.argmax(-1))
    assert n <= teacher.fallback_rows < final.shape[1], "near-ties fall back to float32, ordinary rows do not"
    assert teacher._fast[torch.bfloat16][0].dtype == torch.bfloat16


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_teacher_decides_as_float32_at_the_default_verifiers_scale(compiled: bool) -> None:
    """States and head at the default verifier's scale (|x| ~ 45, column norms 2-7.5), where the fast pass leaves
    many rows undecided and the few outside columns that could still win decide them: exactly the top-1 of a float32
    product over the whole vocabulary, eager (one bound per row) and compiled (one per column)."""
    g = torch.Generator().manual_seed(21)
    vocab, width, rows = 3000, 64, 400
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.randperm(vocab, generator=g)[:1200]] = True
    head = torch.randn(vocab, width, generator=g)
    head *= (2.0 + 5.5 * torch.rand(vocab, 1, generator=g) ** 4) / head.norm(dim=1, keepdim=True)
    final = torch.randn(1, rows, width, generator=g)
    final *= 45.0 / final.norm(dim=-1, keepdim=True)
    teacher = TeacherHead(head, t2d)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        probs, in_vocab, top = teacher.targets(final, chunk=128, compiled=compiled)
    full = final[0] @ head.T
    assert torch.equal(in_vocab[0], t2d[full.argmax(-1)])
    assert 0 < in_vocab.float().mean() < 1
    assert teacher.fallback_rows >= rows // 10, "the test must reach the exact path"
    torch.testing.assert_close(probs[0], full[:, t2d].softmax(-1), rtol=1e-5, atol=1e-7)
    assert torch.equal(top[0], probs[0].argmax(-1))


def test_teacher_with_a_full_draft_vocabulary_needs_no_outside_pass() -> None:
    g = torch.Generator().manual_seed(0)
    head, final = torch.randn(10, 4, generator=g), torch.randn(1, 5, 4, generator=g)
    probs, in_vocab = teacher_targets(final, head, torch.ones(10, dtype=torch.bool), chunk=2)
    assert in_vocab.all()
    torch.testing.assert_close(probs, (final @ head.T).softmax(-1), rtol=1e-6, atol=1e-7)


def test_top1_agreement_breaks_ties_as_argmax() -> None:
    """Two head rows alike give exactly tied logits: the draft's top-1 is the first of them, as argmax has it."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64)
    w[4] = w[1]
    x = w[1][None].repeat(2, 1)  # rows 1 and 4 tie at the top
    assert torch.equal((x @ w.T).argmax(-1), torch.tensor([1, 1]))
    teacher = torch.zeros(2, 6)
    teacher[0, 1], teacher[1, 4] = 1.0, 1.0
    _, _, correct = fused_soft_cross_entropy(x, w, teacher, torch.tensor([0, 1]), torch.ones(2, dtype=torch.float64), 1)
    assert correct.tolist() == [True, False]
