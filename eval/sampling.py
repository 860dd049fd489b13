"""Target distributions and the acceptance rules that keep speculative sampling lossless.

Two rules, both exact (the emitted token is distributed as the verifier's processed distribution ``p``):

* Chain (Leviathan et al. 2023): accept draft ``d_i ~ q_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the
  first rejection sample from ``norm(max(0, p_i - q_i))``; when every draft passes, sample a bonus token from
  ``p_{n+1}``.
* Tree node with several candidates (SpecInfer; recursive rejection sampling without replacement, Jeon et al. 2024):
  candidates ``x_1..x_m`` drawn one after another *without replacement* from ``q``; try them in that order, each
  with ``min(1, p(x)/q(x))`` against the residual-updated ``p``; after a rejection ``p <- norm(max(0, p - q))`` and
  ``q <- q`` without ``x``, renormalised. Deterministic candidates (``q=None``, the EAGLE-2 top-k tree) are the same
  rule with point-mass proposals: accept with ``p(x)``, else zero ``p(x)`` and renormalise (EAGLE's
  ``evaluate_posterior`` with q = 1).

Everything is vectorised over the vocabulary; the only Python loops run over draft positions or siblings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    """0 means greedy (argmax). Otherwise the verifier's logits are divided by it before top-k / top-p, and the
    draft's logits by the same value (its q uses the same temperature, no top-k / top-p: any q keeps the rule exact)."""
    top_p: float = 1.0
    """Nucleus sampling on the verifier's distribution: keep the smallest set of tokens whose mass reaches top_p."""
    top_k: int = 0
    """Keep only the top_k most likely verifier tokens; 0 keeps all."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The verifier's sampling distribution: temperature, then top-k, then top-p (the order of HF ``generate``).

    ``logits`` [..., V] -> float32 probabilities [..., V]. Direct sampling and the speculative loops both call
    this, so "distributed as the verifier" means distributed as this function's output.
    """
    if params.greedy:
        raise ValueError("target_probs is for sampling; greedy decoding uses argmax")
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the mass before it already reaches top_p; the most likely token always survives.
        drop_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def draft_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The draft's proposal distribution q: softmax at the verifier's temperature (float32)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of ``probs`` ([V] -> [1], [R, V] -> [R, 1])."""
    return torch.multinomial(probs, 1, generator=generator)


def _normalised(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    # A residual can only be empty when rejection had probability zero; rounding can still get there, and then
    # the untouched distribution is the right answer.
    total = weights.sum()
    return weights / total if total > 1e-12 else fallback


def leviathan_accept(
    p: torch.Tensor,
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative sampling over a chain of n drafts.

    Args:
        p: [n+1, V] verifier distributions at the positions of [last token, d_1..d_n].
        draft_tokens: [n] the drafts d_1..d_n.
        q: [n, V] the distributions the drafts were sampled from, or None for deterministic drafts (q one-hot).
    Returns:
        (k, token): the number of accepted drafts and the token emitted after them (residual sample or bonus).
    """
    n = draft_tokens.numel()
    k = n
    if n:
        rows = torch.arange(n)
        p_draft = p[rows, draft_tokens]
        u = torch.rand(n, generator=generator)
        # u < p/q  <=>  u * q < p; accepts with probability min(1, p/q) and never divides by zero.
        threshold = p_draft if q is None else p_draft / q[rows, draft_tokens].clamp_min(1e-30)
        rejected = torch.nonzero(u >= threshold)
        if rejected.numel():
            k = int(rejected[0, 0])
    if k < n:
        if q is None:
            residual = p[k].clone()
            residual[draft_tokens[k]] = 0.0
        else:
            residual = (p[k] - q[k]).clamp_min(0.0)
        return k, int(sample(_normalised(residual, p[k]), generator))
    return k, int(sample(p[n], generator))


def multi_candidate_accept(
    p: torch.Tensor,
    candidates: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Recursive rejection sampling at one tree node.

    Args:
        p: [V] the verifier's distribution at the node.
        candidates: [m] the node's children in the order they were drawn from q (without replacement), or any
            fixed order for deterministic candidates.
        q: [V] the draft distribution the candidates were drawn from, or None for deterministic candidates.
    Returns:
        (j, token): j is the index of the accepted candidate (token = candidates[j]), or -1 when all were rejected
        and ``token`` was sampled from the final residual.
    """
    m = candidates.numel()
    if m == 0:
        return -1, int(sample(p, generator))
    u = torch.rand(m, generator=generator).tolist()
    tokens = candidates.tolist()
    q = q.clone() if q is not None else None
    for j, x in enumerate(tokens):
        px = float(p[x])
        qx = 1.0 if q is None else float(q[x])
        if u[j] * qx < px:
            return j, x
        if q is None:
            residual = p.clone()
            residual[x] = 0.0
            p = _normalised(residual, p)
        else:
            p = _normalised((p - q).clamp_min(0.0), p)
            q[x] = 0.0
            q = _normalised(q, q)
    return -1, int(sample(p, generator))
