"""The verifier's side of decoding: one KV cache over the B rows of a batch (B = 1 included), with commit, rollback,
tree compaction and rows leaving the batch, and the capture of the aux states the EAGLE-3 draft reads.

The cache holds the rows left-aligned at their own start column: row r's committed keys/values are the contiguous
columns ``[start_r, end_r)``, and the columns after ``end_r`` (up to the cache's width, the longest row's end) are
holes that the attention mask hides. A round appends the rows' inputs as one block (padded to the longest), runs one
verifier forward with a 4D mask (each row sees its own committed columns and, in the block, its own causal chain or
tree ancestry), then moves each row's kept entries (a chain's accepted prefix, a tree's accepted path) down to its
end: one indexed copy of the kept entries per layer (``decode/ragged.py``). Finished rows leave (``keep_rows``), so
no compute is spent on them, and padding never reaches a real token's attention.

Invariant: the cache holds keys/values of every committed token except each row's newest one, which is the first
input of the row's next block (the "root" of its next chain or tree).

Batch 1 takes a fast path where the general form would only add work: a chain block or the prefill goes through
the model's own causal mask (no 4D mask is built), and a commit that keeps a prefix in place moves nothing.

transformers 5.24's ``create_causal_mask`` returns a 4D ``attention_mask`` unchanged (``_preprocess_mask_arguments``:
"If the mask is already 4D, simply return as-is"), and both the sdpa and the eager attention of Llama / Qwen2 /
Qwen3 / Mistral take an additive float mask, so no model code is patched. A sliding window (Mistral) is applied by
this mask too, since the model's own mask is bypassed.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
from torch import nn
from transformers import DynamicCache

from fledge.decode.ragged import committed_columns, move_kept
from fledge.models.capture import Captured, capture_hidden
from fledge.models.verifier import cache_kwarg

PAD = 0
"""The token id padding positions carry (never seen by a real position, so any id does)."""


def sliding_window_of(model: nn.Module) -> int | None:
    """The sliding window the model's own masks would apply (Mistral; Qwen only with use_sliding_window)."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


class VerifierSession:
    """The verifier's KV cache over the rows of a batch (see the module docstring); a context manager, since with
    ``aux_layer_ids`` the capture hooks stay installed for its lifetime."""

    def __init__(self, model: nn.Module, aux_layer_ids: list[int] | None = None):
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.dtype = next(model.parameters()).dtype
        self.window = sliding_window_of(model)
        # No config: every layer is a plain DynamicLayer that keeps all positions, which ``commit`` relies on; a
        # sliding window is enforced by the masks (``_mask``, or the model's own on the batch-1 fast path).
        self.cache = DynamicCache()
        self._cache_kwarg = cache_kwarg(model)
        self._hooks = ExitStack()
        self._captured: Captured | None = None
        if aux_layer_ids:
            self._captured = self._hooks.enter_context(capture_hidden(model, list(aux_layer_ids), final=False))
        self.starts = torch.zeros(0, dtype=torch.long, device=self.device)
        self.ends = torch.zeros(0, dtype=torch.long, device=self.device)
        self._block_start = 0

    def __enter__(self) -> VerifierSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.close()

    @property
    def width(self) -> int:
        """Columns in the cache (the longest row's end)."""
        return self.cache.get_seq_length()

    def _mask(self, visible_block: torch.Tensor, block_positions: torch.Tensor) -> torch.Tensor:
        """[B, 1, q, width + q] additive mask: committed columns of the row, then the block's own visibility."""
        batch, q = block_positions.shape
        width = self.width
        cols = torch.arange(width, device=self.device)
        committed = committed_columns(self.starts, self.ends, width)
        visible = torch.cat([committed[:, None, :].expand(batch, q, width), visible_block], dim=2)
        if self.window is not None:
            key_pos = torch.cat([cols[None, :] - self.starts[:, None], block_positions], dim=1)  # [B, width + q]
            visible &= (block_positions[:, :, None] - key_pos[:, None, :]) < self.window
        mask = torch.zeros(batch, 1, q, width + q, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~visible[:, None], torch.finfo(self.dtype).min)

    def forward(
        self, inputs: list[torch.Tensor], parents: list[torch.Tensor | None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append one block: row i's ``inputs[i]`` [q_i] (a chain: root then drafts; a tree: root then nodes, with
        ``parents[i]`` [q_i - 1] the node parents as in ``DraftTree``, -1 = the root). Returns logits [B, q, V] and
        aux [B, q, 3H] (or None); row i's entries past q_i are padding."""
        batch, q = len(inputs), max(int(x.numel()) for x in inputs)
        self._block_start = self.width
        chain = batch == 1 and (parents is None or parents[0] is None)
        if chain and int(self.starts[0]) == 0 and int(self.ends[0]) == self.width:
            # One row's chain whose committed entries fill the cache from column 0 (no hole for a mask to hide)
            # continues its sequence causally: the model's own mask and positions are this mask.
            out = self.model(input_ids=inputs[0].to(self.device).view(1, -1), use_cache=True,
                             **{self._cache_kwarg: self.cache})
            return out.logits.to(self.device), self._aux() if self._captured is not None else None
        ids = torch.full((batch, q), PAD, dtype=torch.long, device=self.device)
        depth = torch.zeros(batch, q, dtype=torch.long, device=self.device)
        visible = torch.eye(q, dtype=torch.bool, device=self.device).repeat(batch, 1, 1)  # pads see themselves
        causal = torch.ones(q, q, dtype=torch.bool, device=self.device).tril()
        for i, x in enumerate(inputs):
            n = int(x.numel())
            ids[i, :n] = x.to(self.device)
            if parents is None or parents[i] is None:
                depth[i, :n] = torch.arange(n, device=self.device)
                visible[i, :n, :n] = causal[:n, :n]
            else:
                sees, node_depth = _tree_visibility(parents[i].to(self.device))
                depth[i, :n] = node_depth
                visible[i, :n, :n] = sees
        positions = (self.ends - self.starts)[:, None] + depth  # after each row's committed positions
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=self._mask(visible, positions),
                         use_cache=True, **{self._cache_kwarg: self.cache})
        return out.logits.to(self.device), self._aux() if self._captured is not None else None

    def _aux(self) -> torch.Tensor:
        """[B, q, 3H] the last forward's aux states (with a device_map, the captured layers may sit on other GPUs)."""
        return torch.cat([a.to(self.device) for a in self._captured.aux], dim=-1)

    def prefill(self, prompts: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Cache every prompt token but the last (the first round's root), left-padded to the longest; returns each
        row's aux states of those positions (None for a one-token prompt)."""
        heads = [p[:-1] for p in prompts]
        longest = max(int(h.numel()) for h in heads)
        self.starts = torch.tensor([longest - int(h.numel()) for h in heads], dtype=torch.long, device=self.device)
        self.ends = torch.full((len(prompts),), longest, dtype=torch.long, device=self.device)
        if longest == 0:
            return [None] * len(prompts)
        if len(prompts) == 1:
            self.model(input_ids=heads[0].to(self.device).view(1, -1), use_cache=True, logits_to_keep=1,
                       **{self._cache_kwarg: self.cache})
            return [self._aux()[0]] if self._captured is not None else [None]
        ids = torch.full((len(prompts), longest), PAD, dtype=torch.long, device=self.device)
        for i, h in enumerate(heads):
            ids[i, longest - h.numel():] = h.to(self.device)
        cols = torch.arange(longest, device=self.device)
        keys = cols[None, :] >= self.starts[:, None]  # [B, longest]
        sees = keys[:, None, :] & (cols[None, :, None] >= cols[None, None, :])  # causal, real keys only
        sees |= torch.eye(longest, dtype=torch.bool, device=self.device)[None]  # padding rows see themselves
        positions = (cols[None, :] - self.starts[:, None]).clamp_min(0)
        # The cache is empty: ``_mask`` adds no committed column, only the sliding window (within the prompt).
        self.model(input_ids=ids, position_ids=positions, attention_mask=self._mask(sees, positions), use_cache=True,
                   logits_to_keep=1, **{self._cache_kwarg: self.cache})
        if self._captured is None:
            return [None] * len(prompts)
        aux = self._aux()
        return [aux[i, int(self.starts[i]):] if heads[i].numel() else None for i in range(len(prompts))]

    def commit(self, kept: list[list[int]]) -> None:
        """Row i keeps the entries ``kept[i]`` (offsets into the last block, ascending; 0 is its root) after its
        committed ones; everything else of the block is dropped. One indexed copy per layer moves all rows; a row
        whose block starts at its end and keeps a prefix of it (batch 1's chains) has nothing to move."""
        if all(k == list(range(len(k))) for k in kept) and bool((self.ends == self._block_start).all()):
            self.ends = self.ends + torch.tensor([len(k) for k in kept], dtype=torch.long, device=self.device)
        else:
            self.ends = move_kept([(layer.keys, layer.values) for layer in self.cache.layers], self.ends,
                                  self._block_start, kept)
        extra = self.width - int(self.ends.max())
        if extra > 0:
            self.cache.crop(-extra)

    def keep_rows(self, rows: list[int]) -> None:
        """Only these rows (indices into the current batch, in order) stay; the others' cache goes."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        # Columns every remaining row has left behind (before all starts) are dead weight: dropped too.
        shift = int(self.starts[index].min()) if rows else 0
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, shift:, :].contiguous()
            layer.values = layer.values.index_select(0, index)[:, :, shift:, :].contiguous()
        self.starts, self.ends = self.starts[index] - shift, self.ends[index] - shift
        extra = self.width - int(self.ends.max()) if rows else 0
        if extra > 0:
            self.cache.crop(-extra)


def _tree_visibility(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For [root, nodes] with node parents (-1 = root): [M+1, M+1] ancestor-or-self visibility and [M+1] depths."""
    size = parents.numel() + 1
    parent_rows = torch.cat([torch.zeros(1, dtype=torch.long, device=parents.device), parents + 1])
    sees = torch.eye(size, dtype=torch.bool, device=parents.device)
    for _ in range(size):
        grown = sees | sees[parent_rows]
        if torch.equal(grown, sees):
            break
        sees = grown
    depth = sees.sum(dim=1) - 1  # ancestors, root included, minus itself
    return sees, depth
