"""A weighted mixture of conversation sources (``data.sources``): the draft learns the kinds of text it will meet.

Each source gives weight / Σ weights of the conversations. ``max_conversations`` and ``offset`` count the whole
mixture and are shared out by the same apportionment (largest remainders), so that a held-out slice taken with
``offset`` = the training slice's ``max_conversations`` starts, in every source, where the training slice ended.
The offset passes over what the mixture without it kept (in each source, the first conversations whose prompt no
earlier source had), and the slice after it skips every prompt passed over in any source, so the two slices share no
prompt even when sources overlap (ShareGPT and the verifier's answers to ShareGPT's prompts). This holds exactly when
the training mixture filled its shares; after a shrunk one, take the held-out slice from another source.
A source too short for its share shrinks the whole mixture (the weights hold; the report says which source
bound it). A conversation whose user turns were already taken from an earlier source is skipped and counted
(``duplicates``): the same prompt twice, once with each source's answer, would weigh it double. The result is
interleaved by position (each source's j-th of n at (j + ½) / n), so that any prefix, and so any split of it, keeps
the mixture's shares. Every source is read lazily and is refused, by name, when it yields no conversation: before
the verifier loads or anything is tokenised (``data/sources.py: load_conversations`` reads the sources with these
helpers).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any


def apportion(total: int, weights: dict[str, float]) -> dict[str, int]:
    """``total`` split by ``weights`` (largest remainders; ties to the earlier source): the parts sum to ``total``."""
    scale = sum(weights.values())
    exact = {name: total * w / scale for name, w in weights.items()}
    parts = {name: math.floor(x) for name, x in exact.items()}
    order = sorted(weights, key=lambda name: (-(exact[name] - parts[name]), list(weights).index(name)))
    for name in order[: total - sum(parts.values())]:
        parts[name] += 1
    return parts


def prompt_key(conversation: list[dict[str, Any]]) -> str:
    """What makes two conversations the same prompt: their user turns, whitespace and case folded."""
    text = "\x00".join(" ".join(m["content"].split()).lower() for m in conversation if m["role"] == "user")
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def largest_total(available: dict[str, int], weights: dict[str, float], cap: int | None) -> int:
    """The largest mixture whose every share the sources can fill (at most ``cap``)."""
    scale = sum(weights.values())
    # A share is at least the floor of its exact part, so a source of n cannot fill totals of (n + 1) / w or more.
    total = min(math.ceil((n + 1) * scale / weights[name]) for name, n in available.items())
    if cap is not None:
        total = min(total, cap)
    while total > 0 and any(part > available[name] for name, part in apportion(total, weights).items()):
        total -= 1
    return total


def interleave(parts: dict[str, int]) -> list[tuple[str, int]]:
    """(source, index) of every kept conversation, each source's j-th of n placed at (j + ½) / n (ties in source
    order), so that any prefix holds the sources in their shares."""
    return [(name, j) for _, _, j, name in sorted(((j + 0.5) / n, index, j, name)
                                                  for index, (name, n) in enumerate(parts.items()) for j in range(n))]
