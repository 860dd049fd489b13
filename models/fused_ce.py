"""The draft's output head and its soft cross-entropy against the teacher, fused and in chunks of positions.

Written plainly, each TTT step's loss keeps, for the backward, the [positions, V_draft] float32 logits, their
log-softmax and the gathered teacher rows: at 8B shapes (V_draft 32,000, TTT 7, 4,096 tokens) several GiB per
sequence, more than the rest of the step. Here one call takes the counted positions of every step at once and walks
them in chunks: each chunk's logits, loss, top-1 agreement and its gradients (with respect to the head's input and
weight, as fused linear-cross-entropy kernels do) are computed in the forward and the logits are dropped; what the
backward keeps is a [positions, H] input gradient and one [V_draft, H] weight gradient. No matrix product is
repeated: the forward does the head's three products (one forward, two backward) once each, as autograd would.

The arithmetic is the plain version's: logits in the compute dtype (the autocast dtype when autocast is on, else the
weight's), raised to float32 (float64 stays float64); log-softmax in float32; the logit gradient
(softmax * sum(teacher) - teacher) times the row's weight, in float32, rounded to the compute dtype for the two
products. In float64 the two agree to rounding (``tests/test_fused_loss.py``); in bfloat16 the weight gradient of
several chunks is summed in float32, one rounding per chunk where the plain version rounds the whole product once.
"""

from __future__ import annotations

import torch

from fledge.core.compile import Compiled


def first_maximum(x: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """argmax(x, -1) for compiled code, given each row's maximum ``top`` [..., 1]: the first column that reaches it
    (the same id, first on ties). A min-reduction compiles to a vector loop where argmax's (value, index) pairs took
    3x as long on an AMX Xeon."""
    column = torch.arange(x.shape[-1], device=x.device, dtype=torch.int32)
    return torch.where(x == top, column, x.shape[-1]).amin(-1)


def chunk_terms(
    logits: torch.Tensor, teacher: torch.Tensor, index: torch.Tensor, teacher_top: torch.Tensor,
    row_weight: torch.Tensor, grad: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's soft cross-entropy, top-1 agreement and logit gradient, written for a compiler: the row
    reductions (max, sum of exponentials, the dot product with the teacher, the teacher's sum, the first maximum)
    read the logits and the gathered teacher rows once, and the gradient is one more pass. ``torch.compile`` turns
    it into three loops over [chunk, V] (``train.compile``); run eagerly its temporaries make it slower than
    ``_eager_terms``.

    logits [n, V] in the compute dtype; teacher [M, V] float32; index [n] (teacher rows); row_weight [n] in the
    exact dtype (float32, or float64); grad: None, or [n, V] in the logits' dtype, which receives the gradient of
    sum(row_weight * CE) with respect to the logits (computed in the exact dtype, then rounded). Returns (CE [n] in
    the exact dtype, agreement [n] bool).
    """
    exact = row_weight.dtype
    z = logits.to(exact)
    target = teacher[index].to(exact)
    top = z.amax(-1, keepdim=True)
    lse = (z - top).exp().sum(-1, keepdim=True).log() + top
    mass = target.sum(-1, keepdim=True)
    # -sum(t * (z - lse)) = lse * sum(t) - sum(t * z)
    ce = (lse * mass - (target * z).sum(-1, keepdim=True)).squeeze(-1)
    correct = first_maximum(z, top) == teacher_top[index]
    if grad is not None:
        grad.copy_(((z - lse).exp() * mass - target) * row_weight[:, None])
    return ce, correct


def _eager_terms(
    logits: torch.Tensor, teacher: torch.Tensor, index: torch.Tensor, teacher_top: torch.Tensor,
    row_weight: torch.Tensor, grad: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_terms`` for eager execution: in-place where it can, at most three [chunk, V] tensors alive."""
    exact = row_weight.dtype
    target = teacher[index].to(exact)
    z = logits.to(exact)
    # max(-1).indices: the same first maximum as argmax, about twice as fast on a CPU
    correct = z.max(-1).indices == teacher_top[index]
    logp = z.log_softmax(-1)
    del z
    ce = -(target[:, None, :] @ logp[:, :, None]).view(-1)  # row dot products: no [chunk, V] product
    if grad is not None:
        # d/dz of -sum(t * log_softmax(z)) is softmax(z) * sum(t) - t; the row's weight is the mean's 1/n times the
        # step's decay.
        grad.copy_(logp.exp_().mul_(target.sum(-1, keepdim=True)).sub_(target).mul_(row_weight[:, None]))
    return ce, correct


def accumulate(total: torch.Tensor, part: torch.Tensor) -> None:
    """total += part, cast as it adds (compiled: one pass, where eager ``add_`` first writes a float32 copy)."""
    total.add_(part)


def transposed(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x.T (times ``scale``) in ``dtype``, laid out row-major: compiled, one tiled pass (eager took 3-6x as long)."""
    return (x.t() if scale is None else x.t() * scale).to(dtype).contiguous()


def _eager_transposed(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``transposed`` for eager execution: written straight into the row-major result (no transposed temporary)."""
    out = torch.empty(x.shape[1], x.shape[0], dtype=dtype, device=x.device)
    return out.copy_(x.t()) if scale is None else torch.mul(x.t(), scale, out=out)


_terms = Compiled(chunk_terms, eager=_eager_terms)
_accumulate = Compiled(accumulate)
_transposed = Compiled(transposed, eager=_eager_transposed)


class _FusedSoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, weight, teacher, teacher_top, index, row_weight, chunk, compute_dtype, want_grad, compiled, fed, top_k
    ):
        n, h = x.shape
        v = weight.shape[0]
        exact = torch.promote_types(compute_dtype, torch.float32)  # float32, or float64 in the equality tests
        row_weight = row_weight.to(exact)
        need_x = want_grad and ctx.needs_input_grad[0]
        need_w = want_grad and ctx.needs_input_grad[1]
        ce = torch.empty(n, dtype=exact, device=x.device)
        correct = torch.empty(n, dtype=torch.bool, device=x.device)
        in_top = torch.zeros(n if fed is not None else 0, dtype=torch.bool, device=x.device)
        grad_x = torch.empty_like(x) if need_x else None
        # The products read and write row-major [H, V] blocks: the head transposed (w_t), the weight gradient
        # transposed (grad_wt, turned back once in the backward), the input gradient as w_t @ g.T. Each output goes
        # to a buffer allocated once per call: on a CPU a fresh [chunk, V] output costs its page faults in every
        # chunk, and these layouts ran the products 1.4-2.3x faster on an AMX Xeon in bf16 (docs/design.md,
        # "Training at the hardware's peak").
        w_t = _transposed(weight, compute_dtype, compiled=compiled)
        rows_max = min(chunk, n)
        logits_buf = torch.empty(rows_max * v, dtype=compute_dtype, device=x.device)
        grad_buf = torch.empty(rows_max * v, dtype=compute_dtype, device=x.device) if need_x or need_w else None
        gxt_buf = torch.empty(h * rows_max, dtype=compute_dtype, device=x.device) if need_x else None
        grad_wt = torch.zeros(h, v, dtype=exact, device=weight.device) if need_w else None
        part = torch.empty(h, v, dtype=compute_dtype, device=x.device) if need_w and compute_dtype != exact else None
        with torch.autocast(device_type=x.device.type, enabled=False):
            for start in range(0, n, chunk):
                rows = slice(start, start + chunk)
                xc = x[rows].to(compute_dtype)
                r = xc.shape[0]
                logits = torch.mm(xc, w_t, out=logits_buf[: r * v].view(r, v))
                g = grad_buf[: r * v].view(r, v) if grad_buf is not None else None
                if fed is not None:
                    ids = fed[rows]
                    mine = logits.gather(1, ids.clamp(min=0)[:, None])
                    in_top[rows] = ((logits > mine).sum(-1) < top_k) & (ids >= 0)
                ce[rows], correct[rows] = _terms(
                    logits, teacher, index[rows], teacher_top, row_weight[rows], g, compiled=compiled
                )
                if need_x:
                    grad_x[rows] = torch.mm(w_t, g.t(), out=gxt_buf[: h * r].view(h, r)).t()
                if need_w and part is None:
                    torch.addmm(grad_wt, xc.t(), g, out=grad_wt)  # (addmm_ would escape torch's FLOP counter)
                elif need_w:  # one [H, V] product in the compute dtype, summed in float32
                    _accumulate(grad_wt, torch.mm(xc.t().contiguous(), g, out=part), compiled=compiled)
        loss = (ce * row_weight).sum()
        ctx.save_for_backward(grad_x, grad_wt)
        ctx.weight_dtype = weight.dtype
        ctx.compiled = compiled
        ctx.mark_non_differentiable(ce, correct, in_top)
        return loss, ce, correct, in_top

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_correct, _grad_in_top):
        grad_x, grad_wt = ctx.saved_tensors
        if grad_x is not None:
            grad_x = grad_x * grad_loss.to(grad_x.dtype)
        grad_w = None
        if grad_wt is not None:
            grad_w = _transposed(grad_wt, ctx.weight_dtype, grad_loss, compiled=ctx.compiled)
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None, None


def fused_soft_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    teacher: torch.Tensor,
    index: torch.Tensor,
    row_weight: torch.Tensor,
    chunk: int,
    teacher_top: torch.Tensor | None = None,
    compiled: bool = False,
    fed: torch.Tensor | None = None,
    top_k: int = 0,
) -> tuple[torch.Tensor, ...]:
    """sum_i row_weight[i] * CE_i, with CE_i = -sum_v teacher[index[i], v] * log_softmax(x[i] @ weight.T)[v].

    x [N, H] (the normed hidden states of the counted positions), weight [V, H] (the head), teacher [M, V] float32
    (rows of target distributions), index [N] int64 (the teacher row of each position), row_weight [N],
    chunk: positions per chunk (>= 1); teacher_top [M]: each teacher row's argmax, if the caller has it (one argmax
    per teacher row instead of one per position: the unroll reads each row up to ttt_steps times). Returns (weighted
    loss with grad, CE [N] float32 (float64 for float64 weights), top-1 agreement [N] bool),
    the last two detached. Gradients are computed only when grad mode is on and x or weight requires them.
    ``compiled``: each chunk's terms through ``torch.compile`` (``chunk_terms``; where it cannot compile, eagerly,
    ``core/compile.py``). ``fed`` [N] int64, with ``top_k`` >= 1: a draft id per position (-1: none), and a fourth
    result, bool [N]: whether that id is among the position's ``top_k`` largest logits (in the compute dtype; ties
    with the id's own logit count in its favour), for the TTT loss's reachability mask (``TTTConfig.mask_top_k``).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [N, H] and [V, H]")
    if teacher.shape[1] != weight.shape[0] or index.shape != (x.shape[0],) or row_weight.shape != (x.shape[0],):
        raise ValueError(
            f"teacher {tuple(teacher.shape)}, index {tuple(index.shape)} and row_weight {tuple(row_weight.shape)} "
            f"must be [M, {weight.shape[0]}], [{x.shape[0]}] and [{x.shape[0]}]"
        )
    device = x.device.type
    compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    want_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if fed is not None and (fed.shape != (x.shape[0],) or top_k < 1):
        raise ValueError(f"fed {tuple(fed.shape)} must be [{x.shape[0]}], with top_k >= 1 (got {top_k})")
    if teacher_top is None:
        teacher_top = teacher.max(-1).indices
    loss, ce, correct, in_top = _FusedSoftCrossEntropy.apply(
        x, weight, teacher, teacher_top, index, row_weight, chunk, compute, want_grad, compiled, fed, top_k
    )
    return (loss, ce, correct) if fed is None else (loss, ce, correct, in_top)
