"""The training-time-test (TTT) unroll of EAGLE-3 and its loss.

Alignment, for a sequence x_0 .. x_{T-1} whose verifier states at position t are aux_t (three layers) and
final_t (the final normed state, whose head logits predict x_{t+1}):

    step 0, index t:  hidden g_t = fc(aux_t),        token x_{t+1},   position t,   target: teacher_{t+1} (x_{t+2})
    step k, index t:  hidden h^{k-1}_t (own output), token x_{t+k+1}, position t+k, target: teacher_{t+k+1} (x_{t+k+2})

Index t of step k is the k-th chained draft step after a prefix ending at t: real features g_0 .. g_t exist,
the draft's own outputs h^0_t .. h^{k-1}_t stand in for the features of positions t+1 .. t+k that the verifier
has not computed yet, and the step reads h^{k-1}_t with the ground-truth token x_{t+k+1}. The position ids t+k
are the official code's (``position_ids + lck``, lck = number of earlier steps) and exactly what inference gives
the k-th chained draft token after a prefix ending at t.

Attention at step k (``models.draft.ttt_attention``): query t sees the step-0 keys 0..t and key t of steps 1..k,
which is what the same query sees at inference through the KV cache (tests/test_ttt.py checks this against a
token-by-token cached run). Some versions of the official EAGLE-3 training code, and SpecForge, additionally hide
step-0 keys t-k+1..t at step k (a mask "shift"); no inference engine does, it has been questioned upstream
(SafeAILab/EAGLE#247, sgl-project/SpecForge#245) and other versions of the official code drop it: we keep
training and inference identical.

Loss of step k at index t: soft cross-entropy between the draft's distribution and the teacher (the verifier's
softmax over the draft vocabulary) at t+k+1, counted only when
    loss_mask[t+k+2]: the predicted token is a trained token (the official code reads loss_mask[t+k], two
        tokens earlier, which trains the two tokens after each answer and skips its first two);
    attention_mask[t+k+2]: not padding;
    the verifier's full-vocabulary top-1 at t+k+1 lies inside the draft vocabulary (as the official code).
Each step's loss is a mean over its counted positions (the official code divides by all B*T positions, which
makes the loss scale depend on padding and masking); the total is sum_k decay**k * ploss_k. acc_k is the top-1
agreement with the teacher over the same counted positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from fledge.core.errors import ConfigError
from fledge.models.draft import Eagle3Draft, TTTCache


@dataclass
class TTTConfig:
    ttt_steps: int = 7
    """Unroll length: draft steps trained on their own outputs; 1 is the no-TTT baseline (ablations)."""
    step_decay: float = 0.8
    """Loss weight of step i is step_decay**i."""
    teacher_chunk: int = 1024
    """Positions per chunk when computing the teacher: full-vocabulary logits exist for one chunk at a time."""
    attention_chunk: int = 2048
    """Sequences longer than this run the TTT attention in blocks of this many query rows, each recomputed in the
    backward rather than kept (``models.draft.ttt_attention``); 0 never does. Same numbers, less memory, a second
    forward of the attention."""

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise ConfigError(f"ttt.ttt_steps must be >= 1, got {self.ttt_steps}")
        if not 0.0 < self.step_decay <= 1.0:
            raise ConfigError(f"ttt.step_decay must lie in (0, 1], got {self.step_decay}")
        if self.attention_chunk < 0:
            raise ConfigError(f"ttt.attention_chunk must be >= 0 (0: off), got {self.attention_chunk}")
        if self.teacher_chunk < 1:
            raise ConfigError(f"ttt.teacher_chunk must be >= 1, got {self.teacher_chunk}")


@torch.no_grad()
def teacher_targets(
    final_hidden: torch.Tensor, verifier_head: torch.Tensor, t2d: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier's next-token distribution restricted to the draft vocabulary, and where its top-1 lies in it.

    final_hidden [B, T, Ht], verifier_head [V, Ht], t2d bool [V] -> (probs [B, T, V_draft] float32, in_vocab bool
    [B, T]). As the official EAGLE-3 code: softmax over the logits of the draft-vocabulary columns only, i.e. the
    full distribution renormalised over the draft vocabulary. Always float32, even under autocast: a bf16 head
    flips near-tied top-1s and the teacher is cheap next to the draft.
    """
    b, t, ht = final_hidden.shape
    if verifier_head.shape[1] != ht or verifier_head.shape[0] != t2d.shape[0]:
        raise ValueError(
            f"verifier_head {tuple(verifier_head.shape)} must be [len(t2d)={t2d.shape[0]}, Ht={ht}]"
        )
    device = final_hidden.device
    columns = t2d.to(device).nonzero().squeeze(1)
    head = verifier_head.to(device, torch.float32)
    flat = final_hidden.reshape(b * t, ht)
    probs = torch.empty(b * t, columns.numel(), dtype=torch.float32, device=device)
    in_vocab = torch.empty(b * t, dtype=torch.bool, device=device)
    in_draft = t2d.to(device, torch.bool)
    with torch.autocast(device_type=device.type, enabled=False):
        for start in range(0, b * t, chunk):
            logits = flat[start : start + chunk].float() @ head.T  # [chunk, V]
            in_vocab[start : start + chunk] = in_draft[logits.argmax(-1)]
            probs[start : start + chunk] = logits[:, columns].softmax(-1)
    return probs.view(b, t, -1), in_vocab.view(b, t)


def shift_left(x: torch.Tensor, n: int, fill: float | int | bool = 0) -> torch.Tensor:
    """x[:, n:] followed by n fill values along dim 1 (what position t of a later step reads from t + n)."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat((x[:, n:], pad), dim=1)


def ttt_unroll(
    draft: Eagle3Draft, fused: torch.Tensor, input_ids: torch.Tensor, steps: int, attention_chunk: int = 0
) -> Iterator[torch.Tensor]:
    """Yield the draft's output hidden states [B, T, H] of steps 0 .. steps-1 (alignment in the module docstring).

    fused: fc(aux) [B, T, H]; input_ids [B, T] (the sequence x). Gradients flow through the whole chain, as in
    the official code: a step's loss also trains the earlier steps that produced its input. ``attention_chunk``:
    ``TTTConfig.attention_chunk``.
    """
    cache = TTTCache(attention_chunk)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    hidden = fused
    for k in range(steps):
        # Past the end the token is a placeholder: those positions are never counted and, attending only to
        # step-0 keys before them and their own chain, never influence a counted one.
        hidden = draft(hidden, shift_left(input_ids, k + 1), positions + k, kv_cache=cache)
        yield hidden


def ttt_forward(
    draft: Eagle3Draft, batch: dict[str, torch.Tensor], verifier_head: torch.Tensor, cfg: TTTConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted TTT loss of one batch, with per-step losses and top-1 agreement for logging.

    batch: input_ids [B, T] int64, loss_mask [B, T] 0/1, attention_mask [B, T] (1 = token, 0 = right padding),
    aux [B, T, 3*Ht], final [B, T, Ht]. Returns (loss with grad, {"ploss_k", "acc_k" for each step, "loss",
    "tokens" = positions counted at step 0}). The metrics are detached 0-dim float32 tensors on the batch's
    device: reading them is a host sync, which the training loop does once per log record, not per micro-batch.
    (The gather of the counted positions, ``nonzero``, still syncs once per step of the unroll: its size decides
    the shape of the head's product.)
    """
    input_ids = batch["input_ids"]
    b, t = input_ids.shape
    for name in ("loss_mask", "attention_mask", "aux", "final"):
        if tuple(batch[name].shape[:2]) != (b, t):
            raise ValueError(f"batch[{name!r}] {tuple(batch[name].shape)} does not match input_ids {(b, t)}")
    teacher, in_vocab = teacher_targets(batch["final"], verifier_head, draft.t2d, cfg.teacher_chunk)
    trained = batch["loss_mask"].bool() & batch["attention_mask"].bool()

    fused = draft.fuse(batch["aux"])
    total = fused.new_zeros((), dtype=torch.float32)
    zero = torch.zeros((), dtype=torch.float32, device=input_ids.device)
    metrics: dict[str, torch.Tensor] = {}
    for k, hidden in enumerate(ttt_unroll(draft, fused, input_ids, cfg.ttt_steps, cfg.attention_chunk)):
        counted = shift_left(trained, k + 2, False) & shift_left(in_vocab, k + 1, False)
        rows, cols = counted.nonzero(as_tuple=True)
        if k == 0:
            metrics["tokens"] = zero + rows.numel()
        if rows.numel() == 0:
            # Nothing counted here, but every rank must run the same modules every step: skipping the head and norm
            # on one rank would leave its DDP buckets unready and its ZeRO-3 all-gathers unmatched by the others'
            # (a hang). One row goes through them with weight 0: zero gradients, the same collectives everywhere.
            ploss = draft.logits(hidden[:1, 0]).float().sum() * 0.0
            metrics[f"ploss_{k}"], metrics[f"acc_{k}"] = zero, zero
        else:
            # Only counted positions go through lm_head: it is the widest matrix product of the unroll.
            logits = draft.logits(hidden[rows, cols]).float()
            target = teacher[rows, cols + k + 1]
            ploss = -(target * F.log_softmax(logits, dim=-1)).sum(-1).mean()
            with torch.no_grad():
                acc = (logits.argmax(-1) == target.argmax(-1)).float().mean()
            metrics[f"ploss_{k}"], metrics[f"acc_{k}"] = ploss.detach(), acc
        total = total + (cfg.step_decay**k) * ploss
    metrics["loss"] = total.detach()
    return total, metrics
