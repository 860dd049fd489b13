"""The acceptance rules that keep speculative sampling lossless, and the walks that apply them to a draft tree.

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

Everything is vectorised over the vocabulary; the only Python loops run over draft positions or siblings. The
distributions themselves (the verifier's ``p``, the draft's ``q``) are defined once, in ``models/sampling.py``.
"""

from __future__ import annotations

import torch

from fledge.decode.proposals import DraftTree
from fledge.models.sampling import SamplingParams, sample, target_probs


def _normalised(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    # A residual can only be empty when rejection had probability zero; rounding can still get there, and then
    # the untouched distribution is the right answer.
    total = weights.sum()
    return weights / total if total > 1e-12 else fallback


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax over the last dimension, the first index on ties, as ``torch.argmax``. ``max`` with its
    indices gives the same (torch documents the first maximal value's index for both, and a test holds them equal
    on rows with planted ties), and on a CPU it is ~5x faster over a block's [q, V] bf16 logits."""
    return logits.max(dim=-1).indices


def greedy_from_top(values: torch.Tensor, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``greedy_tokens(logits)`` read off the rows' top-k (``torch.topk``'s values and ids [..., k], k >= 2): the
    smallest id among those equal to the row's maximum. Every entry equal to the maximum is among the top k when
    fewer than k share it; a row where all k do is left to ``greedy_tokens``. The same first maximum, without a
    second pass over [q, V] when the top-k is wanted anyway (token recycling)."""
    first = torch.where(values == values[..., :1], ids, torch.iinfo(ids.dtype).max).amin(-1)
    crowded = values[..., -1] == values[..., 0]
    if bool(crowded.any()):
        first[crowded] = greedy_tokens(logits[crowded])
    return first


def greedy_accept(logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """Greedy verification of a chain: how many drafts equal the verifier's argmax one after another, the argmax
    after them (the bonus token), and every row's argmax.

    Args:
        logits: [n+1, V] the verifier's logits at the positions of [last token, d_1..d_n].
        draft_tokens: [n] the drafts, on the logits' device.
    """
    predicted = greedy_tokens(logits)
    n = draft_tokens.numel()
    accepted = int(torch.cumprod(predicted[:n] == draft_tokens, dim=0).sum())
    return accepted, int(predicted[accepted]), predicted


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
        u = torch.rand(n, generator=generator, device=p.device)
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
    u = torch.rand(m, generator=generator, device=p.device).tolist()
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


def pick_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> int:
    """The verifier's own next token from logits [V]: argmax, or a sample of its processed distribution."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    probs = target_probs(logits, sampling)
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)  # a CPU generator (regeneration's) draws the same on any device
    return int(sample(probs, generator))


def children_lists(parents: list[int]) -> list[list[int]]:
    """Per tree row (0 = root, i+1 = node i): its children's node indices, in the order they are to be tried."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        children[parent + 1].append(node)
    return children


def walk_greedy(logits: torch.Tensor, tree: DraftTree, predicted: torch.Tensor | None = None
                ) -> tuple[list[int], int]:
    """Follow the children that match the verifier's argmax: (accepted node path, the next token). ``predicted``:
    the rows' argmax when the caller has it."""
    predicted = (greedy_tokens(logits) if predicted is None else predicted).tolist()
    tokens = tree.tokens.tolist()
    children = children_lists(tree.parents.tolist())
    path: list[int] = []
    row = 0
    while True:
        want = predicted[row]
        child = next((c for c in children[row] if tokens[c] == want), None)
        if child is None:
            return path, want
        path.append(child)
        row = child + 1


def walk_sampled(
    logits: torch.Tensor, tree: DraftTree, sampling: SamplingParams, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Recursive rejection sampling down the tree: (accepted node path, residual or bonus token)."""
    children = children_lists(tree.parents.tolist())
    vocab = logits.shape[-1]
    path: list[int] = []
    row = 0
    while True:
        p = target_probs(logits[row], sampling)
        kids = children[row]
        if not kids:
            return path, int(sample(p, generator))
        candidates = tree.tokens[kids].to(logits.device)
        q = tree.q_target(row, vocab)
        chosen, token = multi_candidate_accept(p, candidates, None if q is None else q.to(p.device), generator)
        if chosen < 0:
            return path, token
        path.append(kids[chosen])
        row = kids[chosen] + 1
