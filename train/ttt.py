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

Attention at step k (``models.ttt_attention``): query t sees the step-0 keys 0..t and key t of steps 1..k,
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

from fledge.core.compile import Compiled
from fledge.core.errors import ConfigError
from fledge.models.draft import Eagle3Draft
from fledge.models.fused_ce import first_maximum
from fledge.models.ttt_attention import ATTENTION_KERNELS, TTTCache


@dataclass
class TTTConfig:
    ttt_steps: int = 7
    """Unroll length: draft steps trained on their own outputs; 1 is the no-TTT baseline (ablations)."""
    step_decay: float = 0.8
    """Loss weight of step i is step_decay**i."""
    teacher_chunk: int = 1024
    """Positions per chunk when computing the teacher: full-vocabulary logits exist for one chunk at a time."""
    loss_chunk: int = 1024
    """Positions per chunk of the fused head and loss (``models.fused_ce``): [chunk, V_draft] logits exist for one
    chunk at a time and none is kept for the backward."""
    attention: str = "auto"
    """How the unroll's attention runs (``models/ttt_attention.py``): ``flash`` (a flash-attention kernel over the
    causal part, the diagonal keys merged by log-sum-exp: O(T) memory, no [T, T] tensor), ``blocks`` (explicit
    scores, see ``attention_chunk``), or ``auto``: ``flash`` where the device's kernel exists and passes its check
    against the explicit scores, else ``blocks``. Same numbers either way."""
    attention_chunk: int = 2048
    """With ``blocks``: sequences longer than this run the attention in blocks of this many query rows, each
    recomputed in the backward rather than kept; 0 never does. Same numbers, less memory, a second forward of the
    attention."""
    mask_top_k: int = 0
    """0: every counted position of every step trains. K >= 1: GRIFFIN's loss mask (arXiv 2502.11018): a position
    of step k >= 1 trains only if, at each earlier step of its chain, the token fed next was among the draft's K
    most likely, i.e. the states a top-K tree can reach; each step's loss is the mean over the positions it keeps.
    Training only (held-out figures count every position); the head then runs once per step."""
    step0_share: float = 0.0
    """The first this share of training runs step 0 of the unroll alone, then every step (the share of the time in a
    run sized by time, else of the steps: what the learning rate's schedule follows). Early on the later steps train
    on the outputs of a draft that has not learnt its first token yet, and a step-0-only step costs a fraction of the
    whole unroll's (0.33 s against 0.76 at the quickstart's shapes, TTT 3), so the first token, which every later
    step builds on, sees more data. At the 20-minute quickstart's scale 0.35 trained 1.5x the token-passes in the
    same time and the draft alone's MT-bench tau rose +0.06-0.08 over two seeds, paired
    (docs/experiments/2026-12-07-step0-first.md). Training only: held-out figures always run the whole unroll.
    0: off."""

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise ConfigError(f"ttt.ttt_steps must be >= 1, got {self.ttt_steps}")
        if not 0.0 < self.step_decay <= 1.0:
            raise ConfigError(f"ttt.step_decay must lie in (0, 1], got {self.step_decay}")
        if self.attention not in ATTENTION_KERNELS:
            raise ConfigError(f"ttt.attention must be one of {', '.join(ATTENTION_KERNELS)}, got {self.attention!r}")
        if self.attention_chunk < 0:
            raise ConfigError(f"ttt.attention_chunk must be >= 0 (0: off), got {self.attention_chunk}")
        if self.loss_chunk < 1:
            raise ConfigError(f"ttt.loss_chunk must be >= 1, got {self.loss_chunk}")
        if self.teacher_chunk < 1:
            raise ConfigError(f"ttt.teacher_chunk must be >= 1, got {self.teacher_chunk}")
        if self.mask_top_k < 0:
            raise ConfigError(f"ttt.mask_top_k must be >= 0 (0: off), got {self.mask_top_k}")
        if not 0.0 <= self.step0_share < 1.0:
            raise ConfigError(f"ttt.step0_share must lie in [0, 1) (0: off), got {self.step0_share}")

    def steps_at(self, progress: float) -> int:
        """The unroll's length for a training step taken at ``progress`` (0 to 1) of the run (``step0_share``)."""
        return 1 if progress < self.step0_share else self.ttt_steps


FAST_MARGIN_ULPS = {"cpu": 3.0}
"""The fast (low-precision) outside logits' error bound in ``TeacherHead``, in units of that dtype's roundoff u times
|x| * |w_j| (the column's norm), by device type. Rounding x and w to the fast dtype costs (2u + u^2) |x| |w_j|; a CPU
sums the products in float32 (AMX, AVX512-BF16 and the converting kernels alike), which adds K * 2^-24 of it (under
0.01u at K = 8,192), so 3 leaves half again of room. Other devices (``FAST_MARGIN_DEFAULT``) may reduce in lower
precision (cuBLAS can split a bf16 product's sum). The rounding of the result itself, u |r_j|, is bounded apart as
2u |r_j|."""
FAST_MARGIN_DEFAULT = 8.0


class TeacherHead:
    """The verifier's head split at the draft vocabulary, once per run.

    The teacher needs the verifier's logits in float32 only at the draft-vocabulary columns (their softmax is the
    target); of the other columns it needs only whether one of them beats the best draft column (the top-1 then lies
    outside the draft vocabulary and the position is not counted). Under autocast those columns go through one
    product in the autocast dtype, and each of its logits r_j comes with an error bound b_j = u (c |x| |w_j| +
    2 |r_j|) (u the dtype's roundoff, |w_j| the column's norm, c = ``FAST_MARGIN_ULPS``: 3 on a CPU, 8 elsewhere).
    A row is decided when every outside column is surely below the best inside logit (max r_j + b_j below it) or
    one surely above (max r_j - b_j above it). For the other rows only the outside columns that could still win
    (r_j + b_j reaching the best inside logit: about one of 45,000 on the default verifier) are recomputed in
    float32, so the decision is exactly the float32 one at a small fraction of a float32 product over the whole
    vocabulary, which every undecided row cost before (with |x| ~ 45 and a row-wide bound 8u |x| max|w_j|, 97 % of
    the rows on the default verifier's states were undecided: the teacher took 1.6 s of each quickstart step).
    Without autocast everything stays float32.
    """

    def __init__(self, head: torch.Tensor, t2d: torch.Tensor) -> None:
        if head.shape[0] != t2d.shape[0]:
            raise ValueError(f"verifier_head {tuple(head.shape)} must have len(t2d)={t2d.shape[0]} rows")
        t2d = t2d.to(head.device, torch.bool)
        self.t2d = t2d
        self.columns = t2d.nonzero().squeeze(1)
        self.rest = (~t2d).nonzero().squeeze(1)
        self.inside = head[self.columns].float()
        self.outside = head[self.rest]
        self._fast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self.fallback_rows = 0
        """Rows recomputed in float32 because the fast pass could not decide them (for tests and benchmarks)."""

    @property
    def device(self) -> torch.device:
        return self.inside.device

    def to(self, device: torch.device) -> "TeacherHead":
        if device == self.device:
            return self
        moved = TeacherHead.__new__(TeacherHead)
        moved.t2d, moved.columns, moved.rest = self.t2d.to(device), self.columns.to(device), self.rest.to(device)
        moved.inside, moved.outside = self.inside.to(device), self.outside.to(device)
        moved._fast, moved.fallback_rows = {}, 0
        return moved

    def fast_outside(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The outside columns in ``dtype``, transposed ([Ht, V - V_draft]; a row-major copy below float32, whose
        product ran up to 1.3x faster than through the transposed view on an AMX Xeon), and each one's norm times
        this device's ``FAST_MARGIN_ULPS`` (float32, [V - V_draft]): the bound of a fast logit is
        u (that * |x| + 2 |r_j|)."""
        if dtype not in self._fast:
            ulps = FAST_MARGIN_ULPS.get(self.outside.device.type, FAST_MARGIN_DEFAULT)
            turned = self.outside.T if dtype == self.outside.dtype else self.outside.T.to(dtype).contiguous()
            self._fast[dtype] = (turned, ulps * self.outside.float().norm(dim=1))
        return self._fast[dtype]

    def exact_in_vocab(
        self, x: torch.Tensor, logits: torch.Tensor, fast: torch.Tensor, x_norm: torch.Tensor, unit: float
    ) -> torch.Tensor:
        """Rows the fast pass left undecided: whether the float32 top-1 lies in the draft vocabulary, from the float32
        logits of only the outside columns that could still beat the best inside one (ties go to the lower verifier
        id, as argmax breaks them). x [n, Ht], logits [n, V_draft] (float32), fast [n, V - V_draft], x_norm [n].

        A column j could win when r_j + u (c |x| |w_j| + 2 |r_j|) >= the best inside logit b. A threshold per row,
        with the largest column norm, keeps a superset in one comparison over the row (r_j >= (b - cu |x| max|w|) /
        (1 +- 2u), rounded down to the fast dtype); the exact condition is then checked on those (row, column) pairs
        only, and the survivors' float32 logits are computed."""
        n = x.shape[0]
        best_in, first_in = logits.max(-1)
        _, col_bound = self.fast_outside(fast.dtype)
        reach = best_in - unit * x_norm * col_bound.max()
        threshold = torch.minimum(reach / (1 + 2 * unit), reach / (1 - 2 * unit))
        if fast.dtype != torch.float32:  # rounded down (a cast rounds to nearest, within 2^-9 relative for bf16)
            threshold = (threshold - threshold.abs() * 2.0**-7 - 1e-30).to(fast.dtype)
        row, col = (fast >= threshold[:, None]).nonzero(as_tuple=True)
        r = fast[row, col].float()
        keep = r + unit * (x_norm[row] * col_bound[col] + 2.0 * r.abs()) >= best_in[row]
        row, col = row[keep], col[keep]
        decision = torch.ones(n, dtype=torch.bool, device=x.device)
        if not row.numel():
            return decision
        used = torch.zeros(fast.shape[1], dtype=torch.bool, device=x.device)
        used[col] = True
        cols = used.nonzero().squeeze(1)  # ascending: the position in cols follows the verifier id
        slot = (used.cumsum(0) - 1)[col]
        exact = torch.full((n, cols.numel()), float("-inf"), dtype=torch.float32, device=x.device)
        exact[row, slot] = (x @ self.outside[cols].float().T)[row, slot]
        best_out, first_out = exact.max(-1)
        lower_id_inside = self.columns[first_in] < self.rest[cols[first_out]]
        return (best_in > best_out) | ((best_in == best_out) & lower_id_inside)

    @torch.no_grad()
    def targets(
        self, final_hidden: torch.Tensor, chunk: int, compiled: bool = False, in_vocab: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """final_hidden [B, T, Ht] -> (probs [B, T, V_draft] float32, in_vocab bool [B, T], top [B, T]: the draft
        id of each row's largest probability, first on ties); see ``teacher_targets``. ``compiled``: the per-chunk
        reductions through ``torch.compile`` (``train.compile``). ``in_vocab`` [B, T]: the decision already known
        (``InVocabMemo``), returned as given; the outside columns are then not read at all."""
        b, t, ht = final_hidden.shape
        if self.inside.shape[1] != ht:
            raise ValueError(f"verifier_head has width {self.inside.shape[1]}, final hidden states {ht}")
        if in_vocab is not None and tuple(in_vocab.shape) != (b, t):
            raise ValueError(f"in_vocab {tuple(in_vocab.shape)} does not match the final hidden states {(b, t)}")
        device = final_hidden.device
        on = torch.is_autocast_enabled(device.type)
        fast_dtype = torch.get_autocast_dtype(device.type) if on else torch.float32
        fast_dtype = fast_dtype if fast_dtype.itemsize < 4 else torch.float32
        unit = torch.finfo(fast_dtype).eps / 2 if fast_dtype != torch.float32 else 0.0
        flat = final_hidden.reshape(b * t, ht)
        n, v_in = b * t, self.columns.numel()
        given, v_out = in_vocab, (self.rest.numel() if in_vocab is None else 0)
        outside, col_bound = self.fast_outside(fast_dtype) if v_out else (None, None)
        probs = torch.empty(n, v_in, dtype=torch.float32, device=device)
        top = torch.empty(n, dtype=torch.long, device=device)
        in_vocab = torch.ones(n, dtype=torch.bool, device=device)
        # the products' outputs go to buffers allocated once per call (a fresh [chunk, V] output costs its page
        # faults in every chunk on a CPU), and the terms write the probabilities in place
        rows_max = min(chunk, n)
        logits_buf = torch.empty(rows_max * v_in, dtype=torch.float32, device=device)
        fast_buf = torch.empty(rows_max * v_out, dtype=fast_dtype, device=device) if v_out else None
        with torch.autocast(device_type=device.type, enabled=False):
            for start in range(0, n, chunk):
                rows = slice(start, start + chunk)
                x = flat[rows].float()
                r = x.shape[0]
                logits = torch.mm(x, self.inside.T, out=logits_buf[: r * v_in].view(r, v_in))  # float32
                fast = None
                if v_out:
                    fast = torch.mm(x.to(fast_dtype), outside, out=fast_buf[: r * v_out].view(r, v_out))
                x_norm = x.norm(dim=-1)
                top[rows], decided_in, decided_out = _teacher_terms(
                    logits, fast, x_norm, col_bound, unit, probs[rows], compiled=compiled
                )
                if fast is None:
                    continue
                in_vocab[rows] = decided_in
                unsure = (~decided_in & ~decided_out).nonzero().squeeze(1)
                if unsure.numel():
                    in_vocab[start + unsure] = self.exact_in_vocab(
                        x[unsure], logits[unsure], fast[unsure], x_norm[unsure], unit
                    )
                    self.fallback_rows += int(unsure.numel()) if fast_dtype != torch.float32 else 0
        if given is not None:
            in_vocab = given.reshape(n).to(device, torch.bool)
        return probs.view(b, t, -1), in_vocab.view(b, t), top.view(b, t)


class InVocabMemo:
    """Where the verifier's top-1 lies in the draft vocabulary (``TeacherHead.targets``' in_vocab), per conversation
    of a cache, kept from the first time the teacher decided it: later epochs skip the outside columns' product and
    checks (on the default verifier, 45,056 of 49,152 columns: on a CPU about half of the teacher's time).

    The decision depends only on the conversation's cached final states, the verifier's head and the draft
    vocabulary, all fixed for a run, so the memo gives exactly the numbers the teacher would. Batches carry their
    conversations' cache indices as ``rows`` (``train.sampler.Prefetcher``, for a ``CacheReader`` only); a batch
    without them, or with a conversation not seen yet, is decided afresh. Kept on the host, as bools, up to
    ``max_positions`` positions in all (a conversation that would pass it is not stored)."""

    def __init__(self, max_positions: int = 1 << 28) -> None:
        self.max_positions = max_positions
        self.positions = 0
        self._rows: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def lookup(self, rows: list[int], lengths: list[int], t: int) -> torch.Tensor | None:
        """in_vocab [B, T] (False past each row's length) when every row is known with that length, else None."""
        known = [self._rows.get(r) for r in rows]
        if any(k is None or k.numel() != n for k, n in zip(known, lengths)):
            return None
        out = torch.zeros(len(rows), t, dtype=torch.bool)
        for i, k in enumerate(known):
            out[i, : k.numel()] = k
        return out

    def store(self, rows: list[int], lengths: list[int], in_vocab: torch.Tensor) -> None:
        host = in_vocab.cpu()
        for i, (r, n) in enumerate(zip(rows, lengths)):
            if r in self._rows or self.positions + n > self.max_positions:
                continue
            self._rows[r] = host[i, :n].clone()
            self.positions += n


def teacher_chunk_terms(
    logits: torch.Tensor, fast: torch.Tensor | None, x_norm: torch.Tensor, col_bound: torch.Tensor, unit: float,
    probs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One chunk of ``TeacherHead.targets``: the softmax over the draft-vocabulary logits (float32, written to
    ``probs``), its top-1 (first on ties), and whether every fast outside logit (``fast``, None when the draft
    vocabulary is the whole one) is surely below the best inside one (decided in) or one surely above it (decided
    out). Written for ``torch.compile``, which makes it one pass over each of the two logit blocks."""
    p = logits.softmax(-1)
    top = first_maximum(p, p.amax(-1, keepdim=True))
    probs.copy_(p)
    if fast is None:
        return top, None, None
    best_in = logits.amax(-1)
    r = fast.float()
    # |error| of each fast outside logit <= u (c |x| |w_j| + 2 |r_j|) (u: the dtype's roundoff; 0 in float32)
    bound = unit * (x_norm[:, None] * col_bound[None, :] + 2.0 * r.abs())
    return top, (r + bound).amax(-1) < best_in, (r - bound).amax(-1) > best_in


def _eager_teacher_terms(
    logits: torch.Tensor, fast: torch.Tensor | None, x_norm: torch.Tensor, col_bound: torch.Tensor, unit: float,
    probs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``teacher_chunk_terms`` for eager execution: one bound per row, with the largest column norm, so that only
    the fast logits' maximum is read (a per-column bound costs several passes over [chunk, V] without a compiler);
    it decides fewer rows, and ``TeacherHead.exact_in_vocab`` decides the rest, the same way."""
    probs.copy_(logits.softmax(-1))
    top = probs.max(-1).indices
    if fast is None:
        return top, None, None
    best_in = logits.max(-1).values
    best_out = fast.max(-1).values.float()
    margin = unit * (x_norm * col_bound.max() + 2.0 * best_out.abs())
    gap = best_in - best_out
    return top, gap > margin, gap < -margin


_teacher_terms = Compiled(teacher_chunk_terms, eager=_eager_teacher_terms)


def teacher_targets(
    final_hidden: torch.Tensor, verifier_head: torch.Tensor | TeacherHead, t2d: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier's next-token distribution restricted to the draft vocabulary, and where its top-1 lies in it.

    final_hidden [B, T, Ht], verifier_head [V, Ht] (or its ``TeacherHead``), t2d bool [V] -> (probs [B, T, V_draft]
    float32, in_vocab bool [B, T]). As the official EAGLE-3 code: softmax over the logits of the draft-vocabulary
    columns only, i.e. the full distribution renormalised over the draft vocabulary. The probabilities are always
    float32, even under autocast (a bf16 head flips near-tied top-1s and the teacher is cheap next to the draft);
    the in-vocabulary decision is the float32 one too (``TeacherHead``).
    """
    teacher = verifier_head if isinstance(verifier_head, TeacherHead) else TeacherHead(verifier_head, t2d)
    if teacher.t2d.shape != t2d.shape:
        raise ValueError(f"verifier_head has {teacher.t2d.shape[0]} rows, t2d {t2d.shape[0]}")
    probs, in_vocab, _ = teacher.to(final_hidden.device).targets(final_hidden, chunk)
    return probs, in_vocab


def shift_left(x: torch.Tensor, n: int, fill: float | int | bool = 0) -> torch.Tensor:
    """x[:, n:] followed by n fill values along dim 1 (what position t of a later step reads from t + n)."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat((x[:, n:], pad), dim=1)


def _draft_step(
    draft: Eagle3Draft, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, cache: TTTCache
) -> torch.Tensor:
    """One step of the unroll: the draft's forward (embedding, RoPE, the decoder layer) over the TTT cache."""
    return draft(hidden, input_ids, positions, kv_cache=cache)


_compiled_step = Compiled(_draft_step)
"""The step through ``torch.compile`` (``train.compile``): the layer's norms, concatenation, RoPE, residuals and
activation fused around its matrix products, forward and backward; the attention itself (``TTTCache.attend``) stays
eager between the two compiled halves."""


def ttt_unroll(
    draft: Eagle3Draft, fused: torch.Tensor, input_ids: torch.Tensor, steps: int, attention_chunk: int = 0,
    attention: str = "auto", compiled: bool = False,
) -> Iterator[torch.Tensor]:
    """Yield the draft's output hidden states [B, T, H] of steps 0 .. steps-1 (alignment in the module docstring).

    fused: fc(aux) [B, T, H]; input_ids [B, T] (the sequence x). Gradients flow through the whole chain, as in
    the official code: a step's loss also trains the earlier steps that produced its input. ``attention_chunk``,
    ``attention``: ``TTTConfig``'s. ``compiled``: each step's forward (and so its backward) through
    ``torch.compile`` (``_compiled_step``).
    """
    cache = TTTCache(attention_chunk, attention)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    hidden = fused
    for k in range(steps):
        # Past the end the token is a placeholder: those positions are never counted and, attending only to
        # step-0 keys before them and their own chain, never influence a counted one.
        hidden = _compiled_step(draft, hidden, shift_left(input_ids, k + 1), positions + k, cache, compiled=compiled)
        yield hidden


def _idle_row(hidden: torch.Tensor, states: list, index: list, weights: list) -> None:
    """One row of weight 0 for a head call that has nothing counted: zero gradients, the same modules run."""
    states.append(hidden[:1, 0])
    index.append(torch.zeros(1, dtype=torch.long, device=hidden.device))
    weights.append(torch.zeros(1, dtype=torch.float64, device=hidden.device))


def ttt_forward(
    draft: Eagle3Draft, batch: dict[str, torch.Tensor], verifier_head: torch.Tensor | TeacherHead, cfg: TTTConfig,
    compiled: bool = False, memo: InVocabMemo | None = None, compiled_layer: bool = False,
    steps: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted TTT loss of one batch, with per-step losses and top-1 agreement for logging.

    batch: input_ids [B, T] int64, loss_mask [B, T] 0/1, attention_mask [B, T] (1 = token, 0 = right padding),
    aux [B, T, 3*Ht], final [B, T, Ht]. Returns (loss with grad, {"ploss_k", "acc_k" for each step, "loss",
    "tokens" = positions counted at step 0, "tau_chain" = 1 + the mean number of steps in a row, from each position
    of step 0, whose top-1 agrees with the teacher's: greedy chain drafting's acceptance length on this text}).
    The metrics are detached 0-dim float32 tensors on the batch's device: reading them is a host sync, which the
    training loop does once per log record, not per micro-batch.
    (The gather of the counted positions, ``nonzero``, still syncs once per step of the unroll: its size decides
    the shape of the head's product.)

    The counted positions of all steps go through the head and the loss in one fused, chunked call
    (``models.fused_ce``; with ``cfg.mask_top_k``, one call per step, as the next step's positions depend on this
    step's top K): no [positions, V_draft] tensor outlives its chunk. Row weights decay**k / n_k make the
    weighted sum exactly sum_k decay**k * ploss_k. ``compiled`` (``train.compile``): the loss's per-chunk terms
    through ``torch.compile``; ``compiled_layer``: the unroll's steps too (``ttt_unroll``). ``memo``: the teacher's
    in-vocabulary decisions of the conversations seen before, for a batch that names its ``rows`` (``InVocabMemo``;
    the same numbers, less work). ``steps``: the unroll's length for this batch (None: ``cfg.ttt_steps``; the
    training loop gives fewer while ``cfg.step0_share`` lasts); the metrics then hold its steps only.
    """
    steps = cfg.ttt_steps if steps is None else steps
    if not 1 <= steps <= cfg.ttt_steps:
        raise ValueError(f"steps must lie in [1, ttt.ttt_steps={cfg.ttt_steps}], got {steps}")
    input_ids = batch["input_ids"]
    b, t = input_ids.shape
    for name in ("loss_mask", "attention_mask", "aux", "final"):
        if tuple(batch[name].shape[:2]) != (b, t):
            raise ValueError(f"batch[{name!r}] {tuple(batch[name].shape)} does not match input_ids {(b, t)}")
    head = verifier_head if isinstance(verifier_head, TeacherHead) else TeacherHead(verifier_head, draft.t2d)
    if head.t2d.shape != draft.t2d.shape:
        raise ValueError(f"verifier_head has {head.t2d.shape[0]} rows, the draft's t2d {draft.t2d.shape[0]}")
    trained = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    # The teacher at position p is read only where the token at p + 1 is trained (by step k at index p - k - 1):
    # prompt tokens and padding need none. Its rows are computed there only, compactly; ``slot`` maps a position to
    # its row.
    needed = shift_left(trained, 1, False).view(-1).nonzero().squeeze(1)
    if not needed.numel():
        needed = needed.new_zeros(1)  # the head still runs once (below): give it a row to read
    names = batch["rows"].tolist() if memo is not None and "rows" in batch else None
    lengths = batch["attention_mask"].sum(1).tolist() if names is not None else []
    known = memo.lookup(names, lengths, t) if names is not None else None
    teacher, needed_in_vocab, teacher_top = head.to(input_ids.device).targets(
        batch["final"].reshape(b * t, -1)[needed][None], cfg.teacher_chunk, compiled,
        in_vocab=None if known is None else known.view(-1)[needed.cpu()][None],
    )
    in_vocab = torch.zeros(b * t, dtype=torch.bool, device=input_ids.device)
    in_vocab[needed] = needed_in_vocab[0]
    in_vocab = in_vocab.view(b, t)
    if names is not None and known is None:
        memo.store(names, lengths, in_vocab)
    slot = torch.zeros(b * t, dtype=torch.long, device=input_ids.device)
    slot[needed] = torch.arange(needed.numel(), device=input_ids.device)

    fused = draft.fuse(batch["aux"])
    unroll = ttt_unroll(draft, fused, input_ids, steps, cfg.attention_chunk, cfg.attention, compiled_layer)
    device = input_ids.device
    masked = cfg.mask_top_k > 0 and torch.is_grad_enabled()
    if masked:
        to_draft = torch.cumsum(draft.t2d.long(), 0) - 1
        to_draft = torch.where(draft.t2d, to_draft, -1).to(device)
    reach = None  # [B, T] with the mask: the chains whose fed tokens were all in the draft's top K so far
    where, parts, counts = [], [], []
    states, index, weights = [], [], []
    for k, hidden in enumerate(unroll):
        counted = shift_left(trained, k + 2, False) & shift_left(in_vocab, k + 1, False)
        if reach is not None:
            counted &= reach
        rows, cols = counted.nonzero(as_tuple=True)
        n = rows.numel()
        counts.append(n)
        where.append((rows, cols))
        if n:
            # Only counted positions go through lm_head: it is the widest matrix product of the unroll.
            states.append(hidden[rows, cols])
            index.append(slot[rows * t + cols + k + 1])
            weights.append(torch.full((n,), cfg.step_decay**k / n, dtype=torch.float64, device=device))
        if not masked:
            continue
        # With the mask each step goes through the head as soon as it is unrolled: the next step's rows depend on
        # which of this step's fed tokens its top K holds. Every rank still calls the head once per step.
        if not n:
            _idle_row(hidden, states, index, weights)
        fed = to_draft[shift_left(input_ids, k + 2)[rows, cols]] if n else torch.full((1,), -1, device=device)
        loss_k, ce_k, correct_k, in_top = draft.lm_head(
            draft.norm(states[0]), teacher=teacher[0], teacher_top=teacher_top[0], index=index[0],
            row_weight=weights[0], chunk=cfg.loss_chunk, compiled=compiled, fed=fed, top_k=cfg.mask_top_k,
        )
        parts.append((loss_k, ce_k[:n], correct_k[:n]))
        reach = torch.zeros(b, t, dtype=torch.bool, device=device)
        reach[rows, cols] = in_top[:n]
        states, index, weights = [], [], []
    if masked:
        total = torch.stack([p[0] for p in parts]).sum()
        ce, correct = torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])
    else:
        if not states:
            # Nothing counted anywhere, but every rank must run the same modules every step: skipping the head and
            # norm on one rank would leave its DDP buckets unready and its ZeRO-3 all-gathers unmatched by the
            # others' (a hang). One row goes through them with weight 0: zero gradients, the same collectives
            # everywhere.
            _idle_row(hidden, states, index, weights)
        total, ce, correct = draft.lm_head(
            draft.norm(torch.cat(states)),
            teacher=teacher[0],
            teacher_top=teacher_top[0],
            index=torch.cat(index),
            row_weight=torch.cat(weights),
            chunk=cfg.loss_chunk,
            compiled=compiled,
        )
    zero = torch.zeros((), dtype=torch.float32, device=device)
    metrics: dict[str, torch.Tensor] = {"tokens": zero + counts[0]}
    # The chain's acceptance on this text: from each position of step 0, how many steps in a row agree with the
    # teacher's top-1 (a step not counted ends the chain).
    lead = torch.zeros(b, t, dtype=torch.bool, device=device)
    lead[where[0]] = True
    accepted = zero.clone()
    offset = 0
    for k, n in enumerate(counts):
        agree = torch.zeros(b, t, dtype=torch.bool, device=device)
        if n:
            metrics[f"ploss_{k}"] = ce[offset : offset + n].mean().float()
            metrics[f"acc_{k}"] = correct[offset : offset + n].float().mean()
            agree[where[k]] = correct[offset : offset + n]
        else:
            metrics[f"ploss_{k}"], metrics[f"acc_{k}"] = zero, zero
        lead &= agree
        accepted = accepted + lead.sum()
        offset += n
    metrics["tau_chain"] = 1.0 + accepted / max(counts[0], 1)
    metrics["loss"] = total.detach().float()
    return total, metrics
