"""Mixture-of-experts verifiers (Qwen3-MoE, Mixtral): their shapes and parameter counts (all against active), and
the whole pipeline on tiny random ones: cache, training, the real speculative loop (lossless) and the export."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM

from fledge.launch.quickstart import run_pipeline
from fledge.models.shapes import VerifierShape, shape_from_config
from fledge.plan.memory import verifier_flops

from conftest import main_exit, make_tiny_verifier, tiny_hf_config, tiny_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")

MOE = ("qwen3_moe", "mixtral")


@pytest.mark.parametrize("arch", MOE)
def test_a_moe_shape_counts_every_parameter_and_the_active_ones(arch):
    config = tiny_hf_config(arch, vocab_size=300, layers=3)
    model = AutoModelForCausalLM.from_config(config)
    shape = shape_from_config(config.to_dict())
    assert (shape.num_experts, shape.num_experts_per_tok, shape.num_dense_layers) == (4, 2, 0)
    per_expert = 3 * 32 * (16 if arch == "qwen3_moe" else 64)  # gate, up and down of one expert
    assert shape.moe_intermediate_size == (16 if arch == "qwen3_moe" else None)
    # Qwen3's per-head q/k norms, which the Llama-style count leaves out
    qk_norms = 3 * 2 * 8 if arch == "qwen3_moe" else 0
    assert shape.params() + qk_norms == sum(p.numel() for p in model.parameters())
    assert shape.params() - shape.active_params() == 3 * (4 - 2) * per_expert  # two idle experts in each layer
    dense = VerifierShape(**{**shape.__dict__, "num_experts": None})
    # a token's FLOPs: the router and two experts, not four experts
    t = 64
    assert verifier_flops(shape, t) - verifier_flops(dense, t) == pytest.approx(
        2 * t * 3 * (2 * per_expert + 4 * 32 - 3 * 32 * 64))


def test_dense_layers_of_a_moe_are_counted_from_its_config():
    config = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
              "vocab_size": 300, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
              "decoder_sparse_step": 2, "mlp_only_layers": [5]}
    # Qwen3-MoE: layer i is sparse where (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers, so
    # 1 and 3 are, and 0, 2, 4 (not sparse steps) and 5 (MLP only) are dense
    assert shape_from_config(config).num_dense_layers == 4
    config = {**config, "decoder_sparse_step": 1, "mlp_only_layers": [], "first_k_dense_replace": 1}
    assert shape_from_config(config).num_dense_layers == 1
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        VerifierShape(32, 64, 6, 4, None, None, 300, False, 4, 5).complete()


@pytest.mark.parametrize("arch", MOE)
def test_the_pipeline_on_a_tiny_moe_verifier(arch, tmp_path, smollm_tokenizer):
    verifier_dir = make_tiny_verifier(tmp_path, arch, smollm_tokenizer)
    run_pipeline(tiny_pipeline(tmp_path, verifier_dir, 16, ["cache", "train", "eval", "export"]))
    run = tmp_path / "qs"
    manifest = json.loads((run / "cache" / "manifest.json").read_text())
    assert manifest["num_conversations"] > 0 and manifest["num_loss_tokens"] > 0
    entry = json.loads((run / "eval" / "report.json").read_text())["sets"]["prompts"]["drafters"]["eagle3"]
    assert entry["greedy_match_rate"] == 1.0  # the speculative loop over a MoE verifier is its greedy decoding
    assert main_exit(["export", "check", str(run / "export"), "--verifier", str(verifier_dir)]) == 0
