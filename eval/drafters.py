"""Drafters behind the ``Drafter`` protocol of ``eval/proposals.py``: n-gram prompt lookup, a random draft for
tests, and the EAGLE-3 draft head."""

from __future__ import annotations

import torch

from eval.proposals import ChainDraft, DraftTree, TreeShape, grow_tree, propose_chain_with
from eval.sampling import SamplingParams


class PromptLookupDrafter:
    """n-gram prompt lookup: find the latest earlier occurrence of the last n tokens and propose what followed.

    No model, no training; proposals are deterministic (q one-hot), chain only. Longer n-grams are tried first.
    """

    needs_aux = False
    supports_tree = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._buffer = torch.empty(0, dtype=torch.long)
        self._length = 0

    def start(self, context: torch.Tensor, aux: torch.Tensor | None) -> None:
        self._buffer = torch.empty(max(1024, 2 * context.numel()), dtype=torch.long)
        self._length = 0
        self._append(context)

    def advance(self, new_tokens: torch.Tensor, aux: torch.Tensor | None) -> None:
        self._append(new_tokens)

    def _append(self, tokens: torch.Tensor) -> None:
        # A growing buffer, so that a round costs a slice write rather than a copy of the whole context.
        end = self._length + tokens.numel()
        if end > self._buffer.numel():
            grown = torch.empty(2 * end, dtype=torch.long)
            grown[: self._length] = self._buffer[: self._length]
            self._buffer = grown
        self._buffer[self._length : end] = tokens.cpu()
        self._length = end

    def propose_chain(self, n: int, sampling: SamplingParams, generator: torch.Generator | None) -> ChainDraft:
        context = self._buffer[: self._length]
        for size in range(min(self.max_ngram, self._length - 1), self.min_ngram - 1, -1):
            # Windows that start before the final n-gram itself, so a match always has a continuation.
            windows = context[:-1].unfold(0, size, 1)
            hits = torch.nonzero((windows == context[-size:]).all(dim=1))
            if hits.numel():
                start = int(hits[-1, 0]) + size
                return ChainDraft(tokens=context[start : start + n].clone(), q=None)
        return ChainDraft(tokens=torch.empty(0, dtype=torch.long), q=None)

    def propose_tree(self, shape: TreeShape, sampling: SamplingParams, generator: torch.Generator | None) -> DraftTree:
        raise NotImplementedError("prompt lookup proposes chains only; use method=chain")


class RandomDrafter:
    """A deliberately bad draft: random logits at every step (its own seeded generator), so its proposals are
    random tokens with a random, peaked q. Used to show that the loops stay lossless when almost nothing is
    accepted."""

    needs_aux = False
    supports_tree = True

    def __init__(self, vocab_size: int, seed: int = 0, sharpness: float = 3.0):
        self.target_vocab_size = vocab_size
        self.draft_to_target: torch.Tensor | None = None
        self.sharpness = sharpness
        self._generator = torch.Generator().manual_seed(seed)
        self._slots = 0

    def start(self, context: torch.Tensor, aux: torch.Tensor | None) -> None:
        self._slots = 0

    def advance(self, new_tokens: torch.Tensor, aux: torch.Tensor | None) -> None:
        self._slots = 0

    def root_logits(self) -> torch.Tensor:
        return torch.randn(self.target_vocab_size, generator=self._generator) * self.sharpness

    def expand(self, parent_slots: list[int], tokens: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        k = len(parent_slots)
        slots = list(range(self._slots, self._slots + k))
        self._slots += k
        return torch.randn(k, self.target_vocab_size, generator=self._generator) * self.sharpness, slots

    def propose_chain(self, n: int, sampling: SamplingParams, generator: torch.Generator | None) -> ChainDraft:
        return propose_chain_with(self, n, sampling, generator)

    def propose_tree(self, shape: TreeShape, sampling: SamplingParams, generator: torch.Generator | None) -> DraftTree:
        return grow_tree(self, shape, sampling, generator)
