"""``train.compile``: the compiled loss and teacher give the eager numbers (float64, every step, with masks, padding
and dropped positions), a machine where the compiler cannot run trains on eagerly after one warning, and the auto
rule."""

from __future__ import annotations

import logging

import pytest
import torch

from fledge.core import compile as compile_module
from fledge.core.compile import Compiled, compile_failed
from fledge.models.fused_ce import chunk_terms, fused_soft_cross_entropy
from fledge.train.config import COMPILE_MIN_HEAD, TrainConfig
from fledge.train import ttt as ttt_module
from fledge.train.ttt import TeacherHead, TTTConfig, ttt_forward
from test_fused_loss import grads_of
from test_ttt import TOL, random_batch, random_head, tiny_draft

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("chunk", [1, 5, 1000], ids=["rows-of-1", "ragged-5", "one-chunk"])
def test_compiled_loss_equals_eager_in_float64(chunk: int) -> None:
    """The fused head and loss, compiled and eager, in float64: loss, per-row CE, agreement and both gradients."""
    g = torch.Generator().manual_seed(chunk)
    x = torch.randn(23, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = (3 * torch.randn(8, 9, generator=g)).softmax(-1)
    index, row_weight = torch.randint(0, 8, (23,), generator=g), torch.rand(23, generator=g, dtype=torch.float64)
    eager = fused_soft_cross_entropy(x, w, teacher, index, row_weight, chunk)
    compiled = fused_soft_cross_entropy(x, w, teacher, index, row_weight, chunk, compiled=True)
    assert compile_failed() is None
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, **TOL)
    for got, want in zip(torch.autograd.grad(compiled[0], [x, w]), torch.autograd.grad(eager[0], [x, w])):
        torch.testing.assert_close(got, want, **TOL)


def test_compiled_loss_under_bf16_autocast_matches_eager_and_float64() -> None:
    """The bf16 path (the head cast and turned once, each chunk's weight gradient in bf16 added into the float32
    [H, V] accumulator, turned back in the backward), compiled and eager, with ragged chunks: the same loss and
    agreement, and gradients within bf16 rounding of the float64 reference."""
    g = torch.Generator().manual_seed(3)
    x64 = torch.randn(37, 16, generator=g, dtype=torch.float64)
    w64 = torch.randn(24, 16, generator=g, dtype=torch.float64) * 0.5
    teacher = (2 * torch.randn(9, 24, generator=g)).softmax(-1)
    index, row_weight = torch.randint(0, 9, (37,), generator=g), torch.rand(37, generator=g, dtype=torch.float64)
    ref = fused_soft_cross_entropy(x64.requires_grad_(), w64.requires_grad_(), teacher, index, row_weight, 37)
    ref_grads = torch.autograd.grad(ref[0], [x64, w64])
    runs = []
    for compiled in (False, True):
        x, w = x64.detach().float().requires_grad_(), w64.detach().float().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fused_soft_cross_entropy(x, w, teacher, index, row_weight, 10, compiled=compiled)
        runs.append((out, torch.autograd.grad(out[0], [x, w])))
    assert compile_failed() is None
    (eager, eager_grads), (comp, comp_grads) = runs
    torch.testing.assert_close(comp[0], eager[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(comp[2], eager[2])
    for got in (eager, comp):
        torch.testing.assert_close(got[1].double(), ref[1].detach(), rtol=2e-2, atol=2e-2)
    for grads in (eager_grads, comp_grads):
        for got, want in zip(grads, ref_grads):
            assert got.dtype == torch.float32 and got.is_contiguous()
            torch.testing.assert_close(got.double(), want, rtol=5e-2, atol=2e-2 * float(want.abs().max()))


def test_compiled_step_equals_eager() -> None:
    """The whole TTT loss (teacher, fused head and loss, every step's metrics) and every gradient, compiled and eager,
    with a float64 draft; ragged chunks and padded, untrained and dropped positions. The teacher's probabilities are
    float32 by design and the two softmaxes round differently in the last bit, so the step agrees to float32's
    rounding; its in-vocabulary decisions and top-1 exactly."""
    draft = tiny_draft(seed=7)
    batch = random_batch(draft, 3, 13, seed=7, pad=[0, 4, 9])
    head = TeacherHead(random_head(draft, seed=7), draft.t2d)
    cfg = TTTConfig(ttt_steps=4, step_decay=0.7, loss_chunk=5, teacher_chunk=6)
    eager_loss, eager_metrics = ttt_forward(draft, batch, head, cfg)
    eager_grads = grads_of(draft, eager_loss)
    loss, metrics = ttt_forward(draft, batch, head, cfg, compiled=True)
    assert compile_failed() is None
    assert_same_step(draft, (loss, metrics), (eager_loss, eager_metrics, eager_grads), rtol=1e-5, grad_atol=1e-7)
    probs, in_vocab, top = head.targets(batch["final"], 6, compiled=False)
    probs_c, in_vocab_c, top_c = head.targets(batch["final"], 6, compiled=True)
    assert torch.equal(in_vocab, in_vocab_c) and torch.equal(top, top_c) and not in_vocab.all()
    torch.testing.assert_close(probs, probs_c, rtol=1e-6, atol=1e-7)


def test_compiled_unroll_equals_eager_in_float64() -> None:
    """The unroll's steps compiled (``compiled_layer``: embedding, RoPE, norms, projections, residuals and MLP fused
    around the eager attention) against the same loss with them eager, float64 draft, every TTT step: loss, metrics
    and every gradient at two batch shapes (the second reuses the dynamic compiled graphs). The RoPE tables and the
    norms' statistics are float32 by design, and the compiler's cos / rsqrt may round their last bit otherwise than
    torch's kernels; so the step agrees to float32's rounding (a wrong position, mask or residual is off by O(1))."""
    draft = tiny_draft(seed=8)
    head = TeacherHead(random_head(draft, seed=8), draft.t2d)
    cfg = TTTConfig(ttt_steps=4, step_decay=0.7, loss_chunk=5, teacher_chunk=6)
    for b, t, pad in ((3, 13, [0, 4, 9]), (2, 17, [5, 0])):
        batch = random_batch(draft, b, t, seed=t, pad=pad)
        ref_loss, ref_metrics = ttt_forward(draft, batch, head, cfg, compiled=True)
        ref_grads = grads_of(draft, ref_loss)
        loss, metrics = ttt_forward(draft, batch, head, cfg, compiled=True, compiled_layer=True)
        assert compile_failed() is None and ttt_module._compiled_step._compiled is not None
        assert_same_step(draft, (loss, metrics), (ref_loss, ref_metrics, ref_grads), rtol=1e-6, grad_atol=1e-6)


def assert_same_step(draft, got: tuple, want: tuple, rtol: float, grad_atol: float) -> None:
    """Loss and metrics within ``rtol`` (atol 1e-7), every gradient within 1e-5 relative and ``grad_atol`` times its
    largest entry; ``want`` carries the reference's gradients third."""
    (loss, metrics), (want_loss, want_metrics, want_grads) = got, want
    torch.testing.assert_close(loss.detach(), want_loss.detach(), rtol=rtol, atol=1e-7)
    assert metrics.keys() == want_metrics.keys()
    for key, value in metrics.items():
        torch.testing.assert_close(value, want_metrics[key], rtol=rtol, atol=1e-7)
    for g, w in zip(grads_of(draft, loss), want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=grad_atol * float(w.abs().max()))


def test_compiled_terms_break_ties_as_argmax() -> None:
    """Tied logits: the compiled top-1 is the first of them, as argmax (and the eager loss) has it."""
    w = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w[4] = w[1]
    x = w[1][None].repeat(3, 1)
    teacher = torch.zeros(1, 6)
    teacher[0, 1] = 1.0
    index, weights = torch.zeros(3, dtype=torch.long), torch.full((3,), 1 / 3, dtype=torch.float64)
    _, ce, correct = fused_soft_cross_entropy(x, w, teacher, index, weights, 2, compiled=True)
    _, ce_eager, correct_eager = fused_soft_cross_entropy(x, w, teacher, index, weights, 2)
    assert correct.all() and torch.equal(correct, correct_eager)
    torch.testing.assert_close(ce, ce_eager, **TOL)


def test_a_machine_that_cannot_compile_trains_eagerly_after_one_warning(monkeypatch, caplog) -> None:
    """No working C++ compiler (Inductor's own check fails): the first compiled call logs one warning naming the
    reason and every compiled function of the process runs eagerly from then on, with the eager numbers."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(compile_module, "_FAILED", [])
    monkeypatch.setattr(inductor_config.cpp, "cxx", ("/nonexistent/c++",))
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    first, second = Compiled(chunk_terms), Compiled(lambda x: x.exp().sum(-1))
    g = torch.Generator().manual_seed(0)
    logits, teacher = torch.randn(4, 7, generator=g), torch.randn(3, 7, generator=g).softmax(-1)
    grads = torch.empty(4, 7), torch.empty(4, 7)
    args = (logits, teacher, torch.tensor([0, 2, 1, 2]), teacher.argmax(-1), torch.rand(4, generator=g))
    with caplog.at_level(logging.WARNING, logger="fledge.core.compile"):
        got = first(*args, grads[0], compiled=True)
        second(logits, compiled=True)
    warnings = [r.getMessage() for r in caplog.records if r.name == "fledge.core.compile"]
    assert len(warnings) == 1 and "could not compile" in warnings[0] and "C++ compiler" in warnings[0], warnings
    assert "C++ compiler" in compile_failed()
    for a, b in zip((*got, grads[0]), (*chunk_terms(*args, grads[1]), grads[1])):
        torch.testing.assert_close(a, b)


def test_compile_auto_is_on_for_real_drafts_only() -> None:
    auto = TrainConfig()
    assert auto.compiles(4096, 576) and auto.compiles(32000, 4096)  # the quickstart's and an 8B draft
    assert not auto.compiles(20, 32) and not auto.compiles(COMPILE_MIN_HEAD // 64 - 1, 64)
    assert TrainConfig(compile=True).compiles(20, 32) and not TrainConfig(compile=False).compiles(32000, 4096)
