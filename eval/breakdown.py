"""Where the draft's first token fails: the ceiling of a prompt set before any tuning.

For every position of plain decoding's answers, the draft's first token is read as a speculative round would
propose it there: the draft over the verifier's aux states of the answer so far (one verifier forward and one draft
forward over prompt + answer, the draft's step 0 as in training). The verifier's token is its own greedy choice
after the same prefix. Each position falls in the first class that holds:

* ``accepted``: the draft's top-1 is the verifier's token;
* ``outside_vocab``: the verifier's token is not in the draft vocabulary, so no training can propose it (the lever:
  a larger or better-counted vocabulary);
* ``in_top_k``: it is among the draft's 2nd..k-th choices (the lever: a tree k wide, or a sharper draft);
* ``verifier_unsure``: the verifier's own top-1 probability is below ½ there, so no drafter is reliably right
  (the ceiling of the verifier, not of the draft);
* ``mispredicted``: the rest (the lever: data, capacity, training).

Agreement is also binned by the verifier's top-1 probability and by the position in the answer. Greedy rounds
accept the first token exactly when it agrees, so the ``accepted`` share is the depth-1 acceptance over every
position of the answer (rounds start at a subset of them); under sampling it is the top-1 agreement, not the
acceptance probability.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fledge.decode.loop import rank_among
from fledge.eval.summary import new_figure, save_figure
from fledge.models.capture import capture_hidden
from fledge.models.draft import DraftKVCache

CLASSES = ("accepted", "outside_vocab", "in_top_k", "verifier_unsure", "mispredicted")
"""The first-token outcome of a position, in the order they are tested (each position in the first that holds)."""
UNSURE_BELOW = 0.5
"""The verifier's top-1 probability under which a position counts as one where the verifier itself is unsure."""
PROBABILITY_EDGES = (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)
"""Bins of the verifier's top-1 probability: [0, .25), [.25, .5), [.5, .75), [.75, .9), [.9, 1]."""
POSITION_EDGES = (0, 8, 16, 32, 64, 128)
"""Bins of the position in the answer: [0, 8), [8, 16), ..., [64, 128), and 128 on."""


@dataclass(frozen=True)
class FirstToken:
    """One answer position: what the verifier chose there and where the draft ranked it."""

    position: int
    """Index of the token in the answer (0: the first generated token)."""
    verifier_prob: float
    """The verifier's top-1 probability there (softmax of its logits, temperature 1)."""
    rank: int
    """0-based rank of the verifier's token among the draft's top k; k when it is not among them."""
    in_vocab: bool
    """Whether the draft vocabulary holds the verifier's token at all."""
    top_k: int
    """The k the rank was read against."""

    def outcome(self) -> str:
        """The first of ``CLASSES`` that holds."""
        if self.rank == 0:
            return "accepted"
        if not self.in_vocab:
            return "outside_vocab"
        if self.rank < self.top_k:
            return "in_top_k"
        return "verifier_unsure" if self.verifier_prob < UNSURE_BELOW else "mispredicted"


@torch.inference_mode()
def first_tokens(
    model: nn.Module, eagle: Any, prompt_ids: torch.Tensor, answer: Sequence[int], top_k: int,
) -> list[FirstToken]:
    """Every answer position's ``FirstToken`` for one prompt (``eagle``: an ``EagleDrafter``; ``answer``: plain
    decoding's tokens). Empty for a one-token prompt (the draft has no features there) or an empty answer."""
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    length = prompt_ids.numel()
    if length < 2 or not answer:
        return []
    draft = eagle.draft
    device = eagle.device
    sequence = torch.cat([prompt_ids.cpu(), torch.tensor(list(answer), dtype=torch.long)])
    total = sequence.numel()
    embed_device = model.get_input_embeddings().weight.device
    with capture_hidden(model, list(eagle.aux_layer_ids), final=False) as captured:
        logits = model(input_ids=sequence[:-1].to(embed_device).view(1, -1)).logits[0]
        aux = torch.cat([a[0].to(embed_device) for a in captured.aux], dim=-1)
    # Row length - 1 + j of the verifier's logits chooses answer token j.
    chosen = logits[length - 1 :].float()
    probs = torch.softmax(chosen, dim=-1)
    top_prob, target = probs.max(dim=-1)
    # Draft position t reads the verifier's features at t with token t + 1 and proposes token t + 2; answer token j
    # sits at length + j, so it is proposed at t = length - 2 + j (the last t is total - 3).
    reach = total - 2
    positions = torch.arange(reach, device=device).view(1, reach)
    hidden = draft(draft.fuse(aux[:reach].to(device).unsqueeze(0)), sequence[1 : reach + 1].to(device).view(1, reach),
                   positions, kv_cache=DraftKVCache())
    draft_logits = draft.logits(hidden[:, length - 2 :])[0].float()
    k = min(top_k, draft_logits.shape[-1])
    top = draft_logits.topk(k, dim=-1).indices
    mapping = eagle.draft_to_target
    proposed = top if mapping is None else mapping.to(top.device)[top]
    target = target.to(proposed.device)
    ranks, in_vocab = rank_among(proposed, target), in_draft_vocab(eagle, target)
    return [FirstToken(position=j, verifier_prob=float(p), rank=int(r), in_vocab=bool(v), top_k=k)
            for j, (p, r, v) in enumerate(zip(top_prob.tolist(), ranks.tolist(), in_vocab.tolist()))]


def in_draft_vocab(eagle: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Whether the draft vocabulary of ``eagle`` (an ``EagleDrafter``) holds each of ``tokens`` (verifier ids)."""
    if eagle.draft_to_target is None:
        return torch.ones_like(tokens, dtype=torch.bool)
    holds = torch.zeros(eagle.target_vocab_size, dtype=torch.bool, device=tokens.device)
    holds[eagle.draft_to_target.to(tokens.device)] = True
    return holds[tokens]


def _binned(records: list[FirstToken], key: str, edges: Sequence[float], open_end: bool) -> list[dict[str, Any]]:
    bins = len(edges) if open_end else len(edges) - 1
    rows = []
    for i in range(bins):
        lo = edges[i]
        hi = edges[i + 1] if i + 1 < len(edges) else math.inf
        last = i == bins - 1
        inside = [r for r in records
                  if lo <= getattr(r, key) and (getattr(r, key) < hi or (last and getattr(r, key) <= hi))]
        label = f"{lo:g}+" if hi == math.inf else f"[{lo:g}, {hi:g}" + ("]" if last and not open_end else ")")
        rows.append({"bin": label, "positions": len(inside),
                     "share": len(inside) / len(records) if records else 0.0,
                     "agreement": sum(r.rank == 0 for r in inside) / len(inside) if inside else None,
                     "among_top_k": sum(r.rank < r.top_k for r in inside) / len(inside) if inside else None})
    return rows


def breakdown(records: list[FirstToken], top_k: int) -> dict[str, Any]:
    """The report's ``first_token`` entry from every position of a prompt set."""
    outcomes = [r.outcome() for r in records]
    counts = {c: outcomes.count(c) for c in CLASSES}
    n = len(records)
    shares = {c: counts[c] / n if n else 0.0 for c in CLASSES}
    return {
        "positions": n,
        "top_k": top_k,
        "unsure_below": UNSURE_BELOW,
        "counts": counts,
        "shares": shares,
        # Upper bounds on what each lever can add to the first token's acceptance (a share of positions each).
        "ceilings": {
            "accepted": shares["accepted"],
            "with_top_k": shares["accepted"] + shares["in_top_k"],
            "all_in_vocab": 1.0 - shares["outside_vocab"] if n else 0.0,
            "verifier_sure": sum(r.verifier_prob >= UNSURE_BELOW for r in records) / n if n else 0.0,
        },
        "by_verifier_prob": _binned(records, "verifier_prob", PROBABILITY_EDGES, open_end=False),
        "by_position": _binned(records, "position", POSITION_EDGES, open_end=True),
    }


def breakdown_lines(report: dict[str, Any]) -> list[str]:
    """The failure table of every prompt set that has one: shares of positions by class, then agreement by the
    verifier's top-1 probability and by position in the answer."""
    sets = [(name, entry["first_token"]) for name, entry in report.get("sets", {}).items() if "first_token" in entry]
    if not sets:
        return []
    rows = ["where the draft's first token fails (share of answer positions; plain decoding's answers)",
            f"{'prompt set':<14}{'positions':>9}  " + "  ".join(f"{c:>15}" for c in CLASSES)]
    for name, b in sets:
        rows.append(f"{name:<14}{b['positions']:>9}  " + "  ".join(f"{b['shares'][c]:>15.1%}" for c in CLASSES))
    for title, key in (("verifier top-1 p", "by_verifier_prob"), ("answer position", "by_position")):
        header = sets[0][1][key]
        rows += ["", f"draft top-1 agreement by {title} (share of positions in brackets)",
                 f"{'prompt set':<14}" + "".join(f"{row['bin']:>16}" for row in header)]
        for name, b in sets:
            cells = ["-" if row["agreement"] is None else f"{row['agreement']:.2f} ({row['share']:.0%})"
                     for row in b[key]]
            rows.append(f"{name:<14}" + "".join(f"{c:>16}" for c in cells))
    return rows


def breakdown_figures(report: dict[str, Any]) -> list[str]:
    """Stable labels: ``first_token <set> <class> <share>`` for every class."""
    return [f"first_token {name} {c} {entry['first_token']['shares'][c]:.3f}"
            for name, entry in report.get("sets", {}).items() if "first_token" in entry for c in CLASSES]


def plot_breakdown(report: dict[str, Any], path: Path) -> bool:
    """first_token.png: the classes as stacked bars per prompt set, and agreement against the verifier's top-1
    probability and against the position in the answer. False (nothing written) when no set has a breakdown."""
    sets = [(name, entry["first_token"]) for name, entry in report.get("sets", {}).items() if "first_token" in entry]
    if not sets:
        return False
    fig, axes = new_figure(1, 3, figsize=(16, 4.2))
    names = [name for name, _ in sets]
    left = [0.0] * len(sets)
    for c in CLASSES:
        widths = [b["shares"][c] for _, b in sets]
        axes[0].barh(names, widths, left=left, label=c)
        left = [a + w for a, w in zip(left, widths)]
    axes[0].set(xlim=(0, 1), xlabel="share of answer positions", title="where the draft's first token fails")
    axes[0].legend(fontsize=7, loc="lower right")
    for ax, key, xlabel in ((axes[1], "by_verifier_prob", "verifier's top-1 probability"),
                            (axes[2], "by_position", "position in the answer")):
        for name, b in sets:
            rows = b[key]
            ax.plot(range(len(rows)), [math.nan if r["agreement"] is None else r["agreement"] for r in rows],
                    marker="o", label=name)
        ax.set_xticks(range(len(sets[0][1][key])), [r["bin"] for r in sets[0][1][key]], fontsize=7)
        ax.set(ylim=(0, 1.05), xlabel=xlabel, ylabel="draft top-1 agreement")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[1].set_title("agreement against the verifier's certainty")
    axes[2].set_title("agreement along the answer")
    save_figure(fig, path)
    return True
