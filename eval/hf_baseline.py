"""Hugging Face ``generate`` on the same prompts, as a check of the baseline every speed-up divides by.

A speed-up is only as honest as the plain decoding it is measured against: a slow plain loop makes any drafter look
good. ``generate`` (KV cache, greedy or sampled with the same temperature / top-k / top-p) is the reference every
user already has; the evaluator times it prompt by prompt beside fledge's own plain loop and divides by the faster
of the two.
"""

from __future__ import annotations

import torch
from torch import nn

from fledge.decode.result import DecodeResult, clock, stop_index
from fledge.models.sampling import SamplingParams


@torch.inference_mode()
def generate_hf_batch(
    model: nn.Module,
    prompts: list[torch.Tensor],
    *,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_ids: frozenset[int] = frozenset(),
    seed: int = 0,
) -> tuple[list[DecodeResult], float]:
    """``model.generate`` over the prompts as one left-padded batch, as fledge's batched plain loop decodes them
    (batch 1: one prompt alone): each row's tokens (cut as the other loops cut them) and the batch's wall time."""
    from transformers import GenerationConfig

    device = model.get_input_embeddings().weight.device
    pad = min(stop_ids, default=0)
    # A fresh generation config (none of the checkpoint's own defaults, such as a repetition penalty, that plain
    # decoding does not apply): the same sampling, stops and length as fledge's loops.
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy,
                              temperature=sampling.temperature if not sampling.greedy else 1.0,
                              top_k=sampling.top_k or None, top_p=sampling.top_p, eos_token_id=sorted(stop_ids) or None,
                              pad_token_id=pad, use_cache=True)
    longest = max(int(p.numel()) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - p.numel():] = p.cpu()
        mask[i, longest - p.numel():] = 1
    ids, mask = ids.to(device), mask.to(device)
    if not sampling.greedy:
        torch.manual_seed(seed)  # generate samples from torch's global generator
    start = clock(device)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    seconds = clock(device) - start
    return [DecodeResult(tokens=row[: stop_index(row, stop_ids, max_new_tokens)], seconds=seconds)
            for row in out[:, longest:].tolist()], seconds
