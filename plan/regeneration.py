"""What regenerating a job's answers through vLLM costs (``fledge regenerate regenerate.engine=vllm``), the first
stage of a job that trains on the verifier's own answers: ``fledge plan`` prices it before the cache and training.

A roofline of one decoding step. A conversation's answers are the loss's share of its tokens (as long as the
source's answers); the rest is read once (prefill, at the GPUs' rate of FLOPs, over every GPU). A replica holds the
weights on the fewest GPUs (a power of two) that leave half their memory to the KV cache, and decodes as many
sequences at once as the job's batch allows and that cache holds. A decoding step reads the weights and every
sequence's KV cache (2 · layers · KV heads · head dim · dtype bytes a token, at a sequence's mean length while it
is answered: the prompt and half the answer) and computes 2 x active parameters per sequence; it takes the longer of
the two. A mixture of experts reads every weight and computes with the active ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fledge.models.shapes import VerifierShape

KV_SHARE = 0.5
"""A regeneration replica spans the fewest GPUs (a power of two) whose memory leaves at least this share beside the
weights for the KV cache."""


@dataclass(frozen=True)
class GpuRates:
    """One GPU, as the plan assumes it runs."""

    usable_bytes: float
    """Memory, less what the plan holds back."""
    flops: float
    """FLOP/s reached (peak x MFU)."""
    bandwidth: float
    """Bytes/s a decoding step streams at (bandwidth x the share reached)."""


def regeneration(shape: VerifierShape, dtype_bytes: int, conversations: int, tokens_per_conversation: float,
                 answer_share: float, gpu: GpuRates, world: int, batch: int) -> dict[str, Any]:
    """The replicas, the decoding step, tokens/s and hours to answer ``conversations`` of ``tokens_per_conversation``
    tokens (``answer_share`` of them answers) on ``world`` GPUs, ``batch`` sequences a replica at most, and the
    ``fledge regenerate`` overrides that run it so."""
    s = shape.complete()
    weight_bytes = dtype_bytes * shape.params()
    tokens = conversations * tokens_per_conversation
    answers = tokens * answer_share
    gpus = 1
    while weight_bytes > (1 - KV_SHARE) * gpus * gpu.usable_bytes and gpus < world:
        gpus *= 2
    gpus = min(gpus, world)
    replicas = max(1, world // gpus)
    kv_per_token = 2 * s.num_hidden_layers * s.num_key_value_heads * s.head_dim * dtype_bytes
    context = tokens_per_conversation * (1 - answer_share / 2)
    room = gpus * gpu.usable_bytes - weight_bytes
    fit = int(room // (kv_per_token * context)) if room > 0 else 0
    sequences = max(1, min(batch, fit))
    read_s = (weight_bytes + sequences * context * kv_per_token) / (gpus * gpu.bandwidth)
    compute_s = 2 * shape.active_params() * sequences / (gpus * gpu.flops)
    step_s = max(read_s, compute_s)
    decode_rate = replicas * sequences / step_s
    prefill_s = 2 * shape.active_params() * (tokens - answers) / (world * gpu.flops)
    seconds = prefill_s + answers / decode_rate
    return {
        "engine": "vllm", "answer_tokens": answers, "prompt_tokens": tokens - answers, "gpus_per_replica": gpus,
        "replicas": replicas, "sequences": sequences, "sequences_that_fit": fit,
        "kv_bytes_per_token": kv_per_token, "step_ms": 1e3 * step_s, "bound": "memory" if read_s >= compute_s else
        "compute", "tokens_per_s": decode_rate, "tokens_per_s_per_gpu": decode_rate / (replicas * gpus),
        "prefill_h": prefill_s / 3600, "hours": seconds / 3600,
        "overrides": (f"regenerate.engine=vllm regenerate.vllm_tensor_parallel_size={gpus} "
                      f"regenerate.vllm_data_parallel_size={replicas} regenerate.batch_size={sequences}"),
    }
