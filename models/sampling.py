"""How logits become the distribution a model samples from: the one definition both sides of the loop share.

``target_probs`` is the verifier's processed distribution (temperature, then top-k, then top-p: the order of
Hugging Face ``generate``): "distributed as the verifier" means distributed as its output, for plain sampling, for
regeneration and for every speculative loop. ``draft_probs`` is a draft's proposal distribution q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fledge.core.errors import ConfigError


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
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

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
