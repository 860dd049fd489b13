"""Capturing the verifier's aux hidden states with hooks, without materialising all L+1 hidden states.

Index convention (Hugging Face ``output_hidden_states``): index 0 is the embedding output, index i < L is the
input of decoder layer i, and index L is the output of the final norm.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn


def decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
    """(base model, decoder layers, final norm) of a Llama-style causal LM (Llama, Qwen2/3, Mistral, ...)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    norm = getattr(base, "norm", None)
    if layers is None or norm is None:
        raise TypeError(f"{type(model).__name__}: cannot find decoder layers and final norm (model.model.layers/norm)")
    return base, layers, norm


@dataclass
class Captured:
    aux: list[torch.Tensor]
    """The three aux states, each [B, T, H], in the order of ``aux_layer_ids``."""
    final: torch.Tensor | None
    """The final normed hidden state [B, T, H] (what the verifier's lm_head reads)."""


@contextmanager
def capture_hidden(model: nn.Module, aux_layer_ids: list[int], final: bool = True) -> Iterator[Captured]:
    """Within the block, every forward of ``model`` fills the yielded ``Captured`` (overwritten per forward)."""
    _, layers, norm = decoder_parts(model)
    num_layers = len(layers)
    out = Captured(aux=[None] * len(aux_layer_ids), final=None)  # type: ignore[list-item]
    handles = []

    def pre_hook(slot: int):
        def hook(_module, args, kwargs):
            out.aux[slot] = args[0] if args else kwargs["hidden_states"]

        return hook

    def norm_hook(slots: list[int], keep_final: bool):
        def hook(_module, _args, output):
            for s in slots:
                out.aux[s] = output
            if keep_final:
                out.final = output

        return hook

    try:
        final_slots = []
        for slot, idx in enumerate(aux_layer_ids):
            if idx == num_layers:
                final_slots.append(slot)
            elif 0 <= idx < num_layers:
                handles.append(layers[idx].register_forward_pre_hook(pre_hook(slot), with_kwargs=True))
            else:
                raise ValueError(f"aux layer id {idx} outside 0..{num_layers}")
        if final or final_slots:
            handles.append(norm.register_forward_hook(norm_hook(final_slots, final)))
        yield out
    finally:
        for h in handles:
            h.remove()


@torch.inference_mode()
def forward_hidden(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    aux_layer_ids: list[int],
) -> Captured:
    """One forward of the verifier's decoder (no lm_head: the cache stores the final state instead of logits)."""
    base, _, _ = decoder_parts(model)
    with capture_hidden(model, aux_layer_ids) as captured:
        base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return captured
