"""Token recycling: the verifier's own top-k successors of each token, kept from earlier rounds, as free draft
candidates (Luo et al. 2024, "Turning Trash into Treasure"; Spec-Bench: 2.73 accepted tokens a step on Vicuna-7B
with no training).

Every verification computes the verifier's logits at each row of the block (the root and every tree node), and only
the accepted path's are used. ``RecycleTable`` keeps, for each token, the k most likely next tokens the verifier
gave the last time that token was checked (an adjacency table [V, k]); a round's candidates are the tree read off
the table from the root: the root's ``widths[0]`` recorded successors, each of their ``widths[1]`` successors, and
so on. No model forward, no training; the candidates are deterministic, so the loop verifies them like prompt
lookup's (exact for greedy and sampled decoding).

A fresh sequence starts from a seed rather than an empty table: for each token, its k most frequent successors in a
corpus of the verifier's own answers (the hybrid's datastore, ``hybrid_datastore``), counted once. On the default
verifier the seed alone carries most of the gain (``docs/experiments/2026-12-05-recycling.md``). The table is per
sequence (a copy of the seed), so a row of a batch proposes what it would alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from fledge.core.errors import ConfigError

UNKNOWN = -1
"""A table entry with no successor recorded."""


def check_widths(widths: Sequence[int]) -> tuple[int, ...]:
    widths = tuple(int(w) for w in widths)
    if any(w < 1 for w in widths):
        raise ConfigError(f"recycle widths must be >= 1 per level, got {list(widths)}",
                          fix="e.g. hybrid_recycle=[4,1]: 4 successors of the root, 1 of each of those")
    return widths


def bigram_successors(sequences: Iterable[Sequence[int]], vocab_size: int, k: int) -> torch.Tensor:
    """[V, k] the k most frequent next tokens of each token over ``sequences`` (ties: the smaller id), ``UNKNOWN``
    where a token has fewer successors."""
    pairs = [torch.tensor(s, dtype=torch.long) for s in sequences if len(s) > 1]
    # 4 bytes a slot: a 128k vocabulary at k = 8 is 4 MB a sequence
    table = torch.full((vocab_size, k), UNKNOWN, dtype=torch.int32)
    if not pairs:
        return table
    ids = torch.cat(pairs)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ConfigError(f"recycle seed: a token id outside the verifier's vocabulary of {vocab_size}")
    codes = torch.cat([s[:-1] * vocab_size + s[1:] for s in pairs])
    found, counts = torch.unique(codes, return_counts=True)  # sorted by (first, next)
    first, nxt = found // vocab_size, found % vocab_size
    # Order by token, then count descending, then next id ascending (unique sorted it so: a stable sort keeps it).
    order = torch.sort(counts, descending=True, stable=True).indices
    order = order[torch.sort(first[order], stable=True).indices]
    first, nxt = first[order], nxt[order]
    starts = torch.searchsorted(first, torch.arange(vocab_size))
    rank = torch.arange(first.numel()) - starts[first]
    keep = rank < k
    table[first[keep], rank[keep]] = nxt[keep].to(table.dtype)
    return table


class RecycleTable:
    """One sequence's adjacency table: token -> the verifier's (or the seed's) k most likely successors."""

    def __init__(self, seed: torch.Tensor, widths: Sequence[int]):
        self.widths = check_widths(widths)
        if seed.dim() != 2 or seed.shape[1] < max(self.widths, default=1):
            raise ConfigError(f"recycle table: a [V, k] seed with k >= {max(self.widths, default=1)} is needed, "
                              f"got {list(seed.shape)}")
        self.seed = seed
        self.table = seed.clone()
        self.recorded = 0
        """Rows of verified blocks recorded (``observe``)."""

    @property
    def k(self) -> int:
        return int(self.table.shape[1])

    def restart(self) -> None:
        """A new sequence on this table: the seed again."""
        self.table = self.seed.clone()

    def fresh(self) -> RecycleTable:
        """A table for another sequence: the seed again."""
        return RecycleTable(self.seed, self.widths)

    def observe(self, tokens: torch.Tensor, top_ids: torch.Tensor) -> None:
        """A verified block: ``tokens`` [q] (the root, then the nodes) and ``top_ids`` [q, >=k] the verifier's most
        likely next tokens at each, best first. Where a token appears twice, its last row wins."""
        last = {token: row for row, token in enumerate(tokens.tolist())}
        rows = torch.tensor(list(last.values()), dtype=torch.long)
        successors = top_ids.cpu()[rows, : self.k].to(self.table.dtype)
        self.table[torch.tensor(list(last.keys()), dtype=torch.long)] = successors
        self.recorded += len(last)

    def paths(self, root: int) -> list[tuple[tuple[int, ...], list[int]]]:
        """The candidate tree from ``root`` as its root-to-leaf paths, best first (pre-order), each with its ranks
        (the place of each of its tokens among its recorded siblings): each node of level d gets its first
        ``widths[d]`` recorded successors; a token already a sibling is not repeated."""
        leaves: list[tuple[tuple[int, ...], list[int]]] = []  # (ranks among siblings along the path, path)
        frontier: list[tuple[tuple[int, ...], list[int]]] = [((), [])]
        for width in self.widths:
            grown = []
            for ranks, path in frontier:
                children = dict.fromkeys(t for t in self.table[path[-1] if path else root, :width].tolist()
                                         if t != UNKNOWN)
                if not children and path:
                    leaves.append((ranks, path))
                grown += [(ranks + (i,), path + [t]) for i, t in enumerate(children)]
            frontier = grown
        leaves += frontier
        return sorted(leaves, key=lambda leaf: leaf[0])
