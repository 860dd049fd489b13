"""The ragged KV-cache layout both batched caches use (the verifier's in ``decode/session.py``, the draft's in
``decode/batch_draft.py``): row r's committed entries are the contiguous columns ``[start_r, end_r)``; every column
after ``end_r`` is a hole the mask hides, or a block appended by the round in flight."""

from __future__ import annotations

import torch


def committed_columns(starts: torch.Tensor, ends: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] True where a column holds one of the row's committed entries."""
    cols = torch.arange(width, device=starts.device)
    return (cols[None, :] >= starts[:, None]) & (cols[None, :] < ends[:, None])


def move_kept(
    tensors: list[tuple[torch.Tensor, torch.Tensor]], ends: torch.Tensor, block_start: int, kept: list[list[int]]
) -> torch.Tensor:
    """Row i keeps the entries ``kept[i]`` of the block that starts at column ``block_start`` (offsets, ascending):
    they move to its end, in order, with one indexed copy per [B, heads, columns, d] tensor; returns the new ends.
    A chain's rollback (its accepted prefix) and a tree's compaction (its accepted path) are the same move."""
    device = ends.device
    if len(kept) == 1:
        return _move_kept_one(tensors, ends, block_start, kept[0])
    rows = [i for i, k in enumerate(kept) for _ in k]
    counts = torch.tensor([len(k) for k in kept], dtype=torch.long, device=device)
    if rows:
        row_idx = torch.tensor(rows, device=device)
        src = torch.tensor([j for k in kept for j in k], device=device) + block_start
        first = torch.cumsum(counts, 0) - counts
        dst = ends[row_idx] + torch.arange(len(rows), device=device) - first[row_idx]
        for keys, values in tensors:
            # Advanced indexing reads before it writes: overlapping source and destination are safe.
            keys[row_idx, :, dst, :] = keys[row_idx, :, src, :]
            values[row_idx, :, dst, :] = values[row_idx, :, src, :]
    return ends + counts


def _move_kept_one(tensors: list[tuple[torch.Tensor, torch.Tensor]], ends: torch.Tensor, block_start: int,
                   kept: list[int]) -> torch.Tensor:
    """``move_kept`` of one row: only the entries not already in their place move, one column selection per
    tensor (half the time of the rows-and-columns indexing over a verifier's 30 layers)."""
    end = int(ends[0])
    moved = [(block_start + j, end + i) for i, j in enumerate(kept) if block_start + j != end + i]
    if moved:
        src = torch.tensor([a for a, _ in moved], device=ends.device)
        dst = torch.tensor([b for _, b in moved], device=ends.device)
        for keys, values in tensors:
            keys.index_copy_(2, dst, keys.index_select(2, src))
            values.index_copy_(2, dst, values.index_select(2, src))
    return ends + len(kept)
