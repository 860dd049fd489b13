"""Why a greedy speculative output parted from plain greedy decoding: a numerical tie, or a mismatch (a bug).

Checking k tokens in one forward rounds differently from checking one: in bf16 the two paths' logits differ by
about the dtype's rounding, and where the verifier's top two tokens are closer than that, the two decoders may pick
different ones. That is the verifier's own ambiguity, not a loss of exactness, and it cannot be told from a bug by
the outputs alone. So at each first difference the two competing tokens are scored again:

* the reference: the prefix (prompt + the common tokens) through the verifier in float32, one full forward;
* the rounding: the same prefix in the evaluation's dtype, twice: one full forward, and the prefix cached with its
  last tokens in blocks of ``ROUNDING_BLOCK``, as a speculative round checks them; δ, the largest change either
  draw makes to the two tokens' logits or to the position's top-8;
* the gap: |l32(plain's token) - l32(the loop's token)|.

Where those two draws leave a mismatch, a third is taken at that position before calling it one: the prompt cached
and every later token checked alone, as plain decoding checks them (``TieJudge._stepped``). On an AMD EPYC with
AVX512-BF16 (oneDNN's one-row bf16 products) plain decoding itself once chose a token 0.324 logits below the float32
argmax where the two block-shaped draws gave a band of 0.317: the baseline was reported as inexact. Replayed one
token at a time, both tokens' bf16 logits there were 20.5 (float32: 20.547 and 20.223), a tie that the first index
wins; the prefix cached in one forward and only its last token alone gave 20.5 and 20.25, not enough.

The difference is a **tie** when the gap is within what rounding can flip, ``gap <= 2δ + tolerance·eps·scale`` (each
logit may move by δ; ``eps`` is the dtype's machine epsilon and ``scale`` the larger |logit| of the two tokens, so
that the second term is about one unit in the last place of those logits: a floor for a float32 evaluation, whose δ
is zero), and a **mismatch** otherwise: a loop that is not exact. In float32 every difference beyond an ulp or so
is a mismatch. (The scale was once the largest |logit| of the whole vocabulary, often a large negative logit far
from the two tokens: a band of 0.5-1 logit in bf16 that forgave an injected RoPE off-by-one.)

The first difference says nothing of the tokens after it, which follow another prefix. ``TieJudge.recheck`` checks
every position of an output instead: one float32 forward over the prompt and the output, teacher-forced, gives at
each position the verifier's own argmax after the output's own prefix, and the two draws in the evaluation's dtype
(the full forward; the prompt cached, the output in blocks) give δ there. A token that is not that argmax is a tie
or a mismatch by the same rule. Plain decoding is checked alike, so a loop's count can be read against the
baseline's.

Why two draws: a bf16 logit's error depends on the shape of the forward that computed it, and one draw can
understate what another shape does. At one position of an MT-bench answer (default verifier, bf16, three tokens
within 0.22 logits in float32) the full forward moved the three logits by 0.005-0.09, the same prefix with its
last token checked through the KV cache by 0.10-0.19, and with 5 or 9 tokens checked at once by 0.09-0.21; the
tree loop's forward picked a token that neither plain decoding nor float32 picked, 0.216 below the argmax, against
a one-draw band of 0.209: reported as a mismatch although no loop was wrong (the same draft in float32 matched
plain decoding). The second draw has the loop's own kind of shape.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from fledge.decode.result import DecodeResult
from fledge.models.kernels import unpack_linears
from fledge.models.verifier import cache_kwarg

DEFAULT_TIE_TOLERANCE = 1.0
"""Multiples of eps·scale added to 2δ: about one ulp of the two logits themselves (half an ulp each), the rounding
of the output alone, which the one measured forward may happen not to show."""


@dataclass
class Divergence:
    """The first position where a loop's greedy output parts from plain greedy decoding."""

    id: str
    position: int
    """Index in the generated tokens."""
    plain_token: int | None
    loop_token: int | None
    """None where that output had ended (a length difference without a token difference)."""
    kind: str
    """``tie`` or ``mismatch``."""
    gap: float | None = None
    """|l32(plain) - l32(loop)|: how far apart the two tokens are in float32."""
    rounding: float | None = None
    """δ: the larger change the evaluation's dtype makes to the two tokens' logits at this position."""
    threshold: float | None = None
    """What the gap was compared with: 2δ + tolerance·eps·scale."""


ROUNDING_BLOCK = 8
"""The second draw of the rounding checks the output in blocks of this many tokens against the cached prompt (and
the cached blocks before), the shapes of a speculative round's verification."""
ROUNDING_SAMPLE = 8
"""δ is the largest rounding error among the two tokens and the position's top-8 float32 logits: the measured forward
is one draw of the rounding, and the loop's own forward (another shape) is another, so δ takes a high quantile of the
errors of logits of that size rather than the two tokens' own errors alone."""


def tie_band(exact: torch.Tensor, rounded: torch.Tensor | list[torch.Tensor], a: torch.Tensor, b: torch.Tensor,
             eps: float, tolerance: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gap, δ, threshold) of token pairs ``a``, ``b`` [n] at rows of float32 logits ``exact`` [n, V] and their
    rounded twins ``rounded`` [n, V] (or several draws of them: δ is the largest error of any); a pair is a tie
    where gap <= threshold."""
    rows = torch.arange(exact.shape[0], device=exact.device)
    ea, eb = exact[rows, a], exact[rows, b]
    gap = (ea - eb).abs()
    top = exact.topk(min(ROUNDING_SAMPLE, exact.shape[-1]), dim=-1).indices
    rounding = torch.zeros_like(gap)
    for draw in rounded if isinstance(rounded, list) else [rounded]:
        errors = (draw.gather(-1, top) - exact.gather(-1, top)).abs().amax(dim=-1)
        rounding = torch.maximum(rounding, torch.maximum(
            errors, torch.maximum((draw[rows, a] - ea).abs(), (draw[rows, b] - eb).abs())))
    threshold = 2 * rounding + tolerance * eps * torch.maximum(ea.abs(), eb.abs())
    return gap, rounding, threshold


@dataclass
class Recheck:
    """Every position of one greedy output against the verifier's float32 argmax after the output's own prefix."""

    id: str
    positions: int
    ties: list[dict]
    """Positions whose token is not the float32 argmax but within the band: {position, token, argmax, gap,
    rounding, threshold}."""
    mismatches: list[dict]
    """Positions whose token is not the argmax beyond the band: the loop emitted what the verifier would not."""
    bands: list[float]
    """Per position, the band a flip between the verifier's top two tokens (or the token and the argmax, where
    they differ) would have had to be within, in logits."""


class TieJudge:
    """Classifies first differences for one verifier; its float32 copy is made on first use (a bf16 verifier's
    copy doubles its memory for the length of the evaluation) and shared by every drafter and prompt set."""

    def __init__(self, model: nn.Module, tolerance: float = DEFAULT_TIE_TOLERANCE):
        self.model = model
        self.tolerance = tolerance
        self.dtype = next(model.parameters()).dtype
        self.eps = float(torch.finfo(self.dtype).eps)
        self.device = model.get_input_embeddings().weight.device
        self._reference: nn.Module | None = model if self.dtype == torch.float32 else None

    @property
    def reference(self) -> nn.Module:
        if self._reference is None:
            # The copy runs torch's default kernels: packed linears (models/kernels.py) keep the weights' dtype.
            self._reference = unpack_linears(copy.deepcopy(self.model)).float()
        return self._reference

    @torch.inference_mode()
    def _logits(self, model: nn.Module, ids: torch.Tensor, keep: int) -> torch.Tensor:
        """The last ``keep`` positions' logits [keep, V] in float32."""
        return model(input_ids=ids.view(1, -1).to(self.device), logits_to_keep=keep).logits[0].float()

    @torch.inference_mode()
    def _blocked(self, ids: torch.Tensor, keep: int) -> torch.Tensor:
        """The last ``keep`` positions' logits [keep, V] in float32, computed as a speculative loop would: the
        tokens before them (or before the last ``ROUNDING_BLOCK``, if fewer are kept) cached in one forward, the
        rest checked ``ROUNDING_BLOCK`` at a time against the cache."""
        ids = ids.view(1, -1).to(self.device)
        start = max(0, ids.shape[1] - max(keep, ROUNDING_BLOCK))
        cache = DynamicCache()
        kwarg = {cache_kwarg(self.model): cache}
        if start > 0:
            self.model(input_ids=ids[:, :start], use_cache=True, logits_to_keep=1, **kwarg)
        blocks = [self.model(input_ids=ids[:, at:at + ROUNDING_BLOCK], use_cache=True, **kwarg).logits[0].float()
                  for at in range(start, ids.shape[1], ROUNDING_BLOCK)]
        return torch.cat(blocks)[-keep:]

    @torch.inference_mode()
    def _stepped(self, ids: torch.Tensor, start: int, lengths: list[int]) -> dict[int, torch.Tensor]:
        """The next-token logits [1, V] in float32 after each prefix ``ids[:n]`` of ``lengths``, computed as plain
        decoding computes them: the first ``start`` tokens cached in one forward (the prompt but its last token),
        then every later token alone through the cache, one-row products each (which some CPU kernels round
        differently from the blocks of ``_blocked``), so that the cached keys and values are plain decoding's too."""
        ids = ids.view(1, -1).to(self.device)
        start = max(0, min(start, min(lengths) - 1))
        cache = DynamicCache()
        kwarg = {cache_kwarg(self.model): cache}
        if start > 0:
            self.model(input_ids=ids[:, :start], use_cache=True, logits_to_keep=1, **kwarg)
        out = {}
        for at in range(start, max(lengths)):
            logits = self.model(input_ids=ids[:, at : at + 1], use_cache=True, **kwarg).logits[0]
            if at + 1 in lengths:
                out[at + 1] = logits.float()
        return out

    def _third_draw(self, ids: torch.Tensor, start: int, keep: int, rows: list[int], exact: torch.Tensor,
                    rounded: list[torch.Tensor], a: torch.Tensor, b: torch.Tensor) -> dict[int, tuple]:
        """(gap, δ, threshold) again at ``rows`` (of the last ``keep`` positions after ``ids``) with a third draw of
        the rounding, in one-token steps after the first ``start`` tokens (``_stepped``, one replay for all rows):
        asked only where the first two leave a mismatch, since a decoder that checks one token at a time (plain
        decoding) rounds as neither of them does."""
        if self.reference is self.model or not rows:
            return {}
        length = {i: ids.numel() - keep + i + 1 for i in rows}
        stepped = self._stepped(ids, start, sorted(length.values()))
        out = {}
        for i in rows:
            draws = [r[i : i + 1] for r in rounded] + [stepped[length[i]]]
            gap, rounding, threshold = tie_band(exact[i : i + 1], draws, a[i : i + 1], b[i : i + 1], self.eps,
                                                self.tolerance)
            out[i] = (float(gap[0]), float(rounding[0]), float(threshold[0]))
        return out

    def _both(self, ids: torch.Tensor, keep: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The float32 logits of the last ``keep`` positions, and the evaluation dtype's draws of them."""
        exact = self._logits(self.reference, ids, keep)
        if self.reference is self.model:
            return exact, [exact]
        return exact, [self._logits(self.model, ids, keep), self._blocked(ids, keep)]

    def judge(self, prompt_id: str, prompt_ids: torch.Tensor, plain: list[int], loop: list[int]) -> Divergence:
        """Classify where ``loop`` first differs from ``plain`` (both greedy outputs after ``prompt_ids``)."""
        position = next((i for i, (a, b) in enumerate(zip(plain, loop)) if a != b), min(len(plain), len(loop)))
        a = plain[position] if position < len(plain) else None
        b = loop[position] if position < len(loop) else None
        if a is None or b is None:
            # Equal tokens up to where one output ends: the stop and length rules are exact, so this is a bug.
            return Divergence(str(prompt_id), position, a, b, "mismatch")
        prefix = torch.cat([prompt_ids.cpu(), torch.tensor(plain[:position], dtype=torch.long)])
        exact, rounded = self._both(prefix, 1)
        ta, tb = torch.tensor([a], device=exact.device), torch.tensor([b], device=exact.device)
        gap, rounding, threshold = (float(x[0]) for x in tie_band(exact, rounded, ta, tb, self.eps, self.tolerance))
        if gap > threshold:
            start = prompt_ids.numel() - 1
            gap, rounding, threshold = self._third_draw(prefix, start, 1, [0], exact, rounded, ta, tb).get(
                0, (gap, rounding, threshold))
        kind = "tie" if gap <= threshold else "mismatch"
        return Divergence(str(prompt_id), position, a, b, kind, gap, rounding, threshold)

    def recheck(self, prompt_id: str, prompt_ids: torch.Tensor, tokens: list[int]) -> Recheck:
        """Check every token of the greedy output ``tokens`` after ``prompt_ids`` (two teacher-forced forwards)."""
        n = len(tokens)
        if n == 0:
            return Recheck(str(prompt_id), 0, [], [], [])
        ids = torch.cat([prompt_ids.cpu(), torch.tensor(tokens[:-1], dtype=torch.long)])
        exact, rounded = self._both(ids, n)
        out = torch.tensor(tokens, device=exact.device)
        top2 = exact.topk(2, dim=-1).indices
        # Where the token is the argmax, the band shown is that of the runner-up; elsewhere that of token vs argmax.
        other = torch.where(out == top2[:, 0], top2[:, 1], out)
        gap, rounding, threshold = tie_band(exact, rounded, top2[:, 0], other, self.eps, self.tolerance)
        off = torch.nonzero(out != top2[:, 0]).flatten().tolist()
        wide = [i for i in off if gap[i] > threshold[i]]
        again = self._third_draw(ids, prompt_ids.numel() - 1, n, wide, exact, rounded, top2[:, 0], other)
        ties, mismatches = [], []
        for i in off:
            g, r, t = again.get(i, (float(gap[i]), float(rounding[i]), float(threshold[i])))
            row = {"position": i, "token": tokens[i], "argmax": int(top2[i, 0]), "gap": g, "rounding": r,
                   "threshold": t}
            (ties if g <= t else mismatches).append(row)
        bands = threshold.tolist()
        for i, (_, _, t) in again.items():
            bands[i] = t  # the band the position was judged by
        return Recheck(str(prompt_id), n, ties, mismatches, bands)

    def close(self) -> None:
        self._reference = self.model if self.dtype == torch.float32 else None


def recheck_summary(judge: TieJudge, encoded: list[tuple[object, torch.Tensor]], outputs: list[list[int]]) -> dict:
    """Every position of ``outputs`` (one greedy output per (id, prompt ids) of ``encoded``) against the verifier's
    float32 argmax (``TieJudge.recheck``): counts, each off-argmax position, and the tie band in logits (median,
    90th percentile and largest over positions)."""
    checks = [judge.recheck(str(pid), ids, tokens) for (pid, ids), tokens in zip(encoded, outputs)]
    bands = sorted(b for c in checks for b in c.bands)

    def quantile(q: float) -> float | None:
        return bands[min(int(q * len(bands)), len(bands) - 1)] if bands else None

    return {
        "positions": sum(c.positions for c in checks),
        "ties": sum(len(c.ties) for c in checks),
        "mismatches": sum(len(c.mismatches) for c in checks),
        "tie_band_logits": {"median": quantile(0.5), "p90": quantile(0.9), "max": bands[-1] if bands else None},
        "off_argmax": [{"id": c.id, "kind": kind, **row} for c in checks
                       for kind, rows in (("tie", c.ties), ("mismatch", c.mismatches)) for row in rows],
    }


def greedy_outcome(
    judge: TieJudge, encoded: list[tuple[Any, torch.Tensor]], results: list[DecodeResult], plain: list[DecodeResult],
    recheck: bool = True,
) -> dict:
    """Greedy losslessness: prompts whose output equals plain greedy decoding token for token, and at each other
    prompt's first difference, a numerical tie or a mismatch (``TieJudge.judge``); with ``recheck``, every position
    of every output against the float32 argmax too."""
    divergences = [judge.judge(pid, ids, b.tokens, r.tokens)
                   for (pid, ids), r, b in zip(encoded, results, plain) if r.tokens != b.tokens]
    ties = [asdict(d) for d in divergences if d.kind == "tie"]
    mismatches = [asdict(d) for d in divergences if d.kind == "mismatch"]
    outcome = {
        "greedy_match_rate": 1.0 - len(divergences) / len(results),
        "greedy_exact": len(results) - len(divergences),
        "greedy_tie_count": len(ties),
        "greedy_mismatch_count": len(mismatches),
        "greedy_ties": ties,
        "greedy_mismatches": mismatches,
    }
    if recheck:
        outcome["recheck"] = recheck_summary(judge, encoded, [r.tokens for r in results])
    return outcome
