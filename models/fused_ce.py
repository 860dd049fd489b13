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


class _FusedSoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, teacher, teacher_top, index, row_weight, chunk, compute_dtype, want_grad):
        n = x.shape[0]
        exact = torch.promote_types(compute_dtype, torch.float32)  # float32, or float64 in the equality tests
        row_weight = row_weight.to(exact)
        need_x = want_grad and ctx.needs_input_grad[0]
        need_w = want_grad and ctx.needs_input_grad[1]
        ce = torch.empty(n, dtype=exact, device=x.device)
        correct = torch.empty(n, dtype=torch.bool, device=x.device)
        grad_x = torch.empty_like(x) if need_x else None
        grad_w = torch.zeros(weight.shape, dtype=exact, device=weight.device) if need_w else None
        w = weight.to(compute_dtype)
        with torch.autocast(device_type=x.device.type, enabled=False):
            for start in range(0, n, chunk):
                rows = slice(start, start + chunk)
                xc = x[rows].to(compute_dtype)
                target = teacher[index[rows]].to(exact)
                logits = (xc @ w.T).to(exact)
                # max(-1).indices: the same first maximum as argmax, about twice as fast on a CPU
                correct[rows] = logits.max(-1).indices == teacher_top[index[rows]]
                logp = logits.log_softmax(-1)
                del logits  # at most three [chunk, V] tensors live at once: logits, log-probabilities, target
                ce[rows] = -(target[:, None, :] @ logp[:, :, None]).view(-1)  # row dot products: no [chunk, V] product
                if need_x or need_w:
                    # d/dz of -sum(t * log_softmax(z)) is softmax(z) * sum(t) - t; the row's weight is the mean's 1/n
                    # times the step's decay.
                    g = logp.exp_().mul_(target.sum(-1, keepdim=True)).sub_(target).mul_(row_weight[rows, None])
                    g = g.to(compute_dtype)
                    if need_x:
                        grad_x[rows] = (g @ w).to(x.dtype)
                    if need_w and compute_dtype == exact:
                        torch.addmm(grad_w, g.T, xc, out=grad_w)  # (addmm_ would escape torch's FLOP counter)
                    elif need_w:  # one [V, H] product in the compute dtype, summed in float32
                        grad_w += (g.T @ xc).to(exact)
                    del g
                del target, logp  # before the next chunk's are made: one chunk's tensors live at a time
        loss = (ce * row_weight).sum()
        ctx.save_for_backward(grad_x, grad_w)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(ce, correct)
        return loss, ce, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_correct):
        grad_x, grad_w = ctx.saved_tensors
        if grad_x is not None:
            grad_x = grad_x * grad_loss.to(grad_x.dtype)
        if grad_w is not None:
            grad_w = (grad_w * grad_loss).to(ctx.weight_dtype)
        return grad_x, grad_w, None, None, None, None, None, None, None


def fused_soft_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    teacher: torch.Tensor,
    index: torch.Tensor,
    row_weight: torch.Tensor,
    chunk: int,
    teacher_top: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sum_i row_weight[i] * CE_i, with CE_i = -sum_v teacher[index[i], v] * log_softmax(x[i] @ weight.T)[v].

    x [N, H] (the normed hidden states of the counted positions), weight [V, H] (the head), teacher [M, V] float32
    (rows of target distributions), index [N] int64 (the teacher row of each position), row_weight [N],
    chunk: positions per chunk (>= 1); teacher_top [M]: each teacher row's argmax, if the caller has it (one argmax
    per teacher row instead of one per position: the unroll reads each row up to ttt_steps times). Returns (weighted
    loss with grad, CE [N] float32 (float64 for float64 weights), top-1 agreement [N] bool),
    the last two detached. Gradients are computed only when grad mode is on and x or weight requires them.
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
    if teacher_top is None:
        teacher_top = teacher.max(-1).indices
    return _FusedSoftCrossEntropy.apply(
        x, weight, teacher, teacher_top, index, row_weight, chunk, compute, want_grad
    )
