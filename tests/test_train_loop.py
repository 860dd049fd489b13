"""The training loop end to end on a tiny cache, in-process: run directory, logs (JSONL and offline wandb),
checkpoints and the final draft, load_draft, resume checks, the non-finite guard."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from fledge.core.errors import ConfigError, MismatchError
from fledge.launch.cli import run_stage
from fledge.models.draft_folder import complete_checkpoints, load_draft
from fledge.train.logger import tau_sim

from conftest import read_jsonl
from test_train_fixtures import build_cache, shared_root, train_overrides
from wandb_reader import read_wandb_history

TRAIN_KEYS = {"loss", "ploss_0", "ploss_1", "ploss_2", "acc_0", "acc_1", "acc_2", "tau_sim", "tau_chain", "lr",
              "grad_norm", "tokens_per_s", "skipped_steps"}
EVAL_KEYS = {"eval/loss", "eval/ploss_0", "eval/acc_0", "eval/acc_2", "eval/tau_sim", "eval/tau_chain"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory, smollm_tokenizer) -> Path:
    return build_cache(shared_root(tmp_path_factory), smollm_tokenizer)


@pytest.fixture(scope="module")
def short_run(cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("loop") / "run"
    result = run_stage(
        "train",
        train_overrides(
            cache, out, **{"train.max_steps": 4, "train.lr": 1e-2, "checkpoint.every": 2, "checkpoint.keep_last": 1,
                           "validation.every": 2, "validation.holdout": 4, "log.wandb_mode": "offline"}
        ),
    )
    return out, result


def test_run_directory_and_metrics(short_run):
    out, result = short_run
    assert result.step == 4
    assert {p.name for p in out.iterdir()} >= {"checkpoints", "metrics.jsonl", "wandb", "draft"}
    # keep_last=1: the step-2 checkpoint was pruned after step 4 was complete; no temporary folder is left.
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000004"]
    step_dir = out / "checkpoints" / "step-000004"
    assert {p.name for p in step_dir.iterdir()} == {
        "model.safetensors", "draft_config.json", "fledge.json", "train_state.pt", "rng-00000.pt",
        "train_config.yaml", "optimizer.pt", "scheduler.pt",
    }
    state = torch.load(step_dir / "train_state.pt", weights_only=True)
    assert state["step"] == 4 and state["world_size"] == 1 and state["tokens_seen"] > 0

    records = read_jsonl(out / "metrics.jsonl")
    setup = records[0]
    assert setup["step"] == 0 and setup["total_steps"] == 4
    # Only the draft's own weights are optimised: the verifier's embedding (49152 x 32) is frozen and left out.
    assert setup["params/in_optimizer"] == setup["params/trainable"] > 0
    assert setup["params/frozen"] == 49152 * 32
    # What ran, beside the config in every checkpoint and in the first record: engine, dtype, world size, versions.
    runtime = OmegaConf.load(step_dir / "train_config.yaml").runtime
    assert (runtime.engine, runtime.compute_dtype, runtime.device) == ("single", "float32", "cpu")
    assert runtime.versions.torch == torch.__version__ and "transformers" in runtime.versions
    assert (setup["engine"], setup["compute_dtype"], setup["world_size"]) == ("single", "float32", 1)
    assert setup["version/torch"] == torch.__version__
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [r["step"] for r in evals] == [2, 4]
    for r in train:
        assert TRAIN_KEYS <= set(r), TRAIN_KEYS - set(r)
        assert r["tau_sim"] == pytest.approx(tau_sim([r["acc_0"], r["acc_1"], r["acc_2"]]))
        assert r["skipped_steps"] == 0 and math.isfinite(r["loss"]) and r["tokens_per_s"] > 0
    assert EVAL_KEYS <= set(evals[-1])
    # Smoke check of learning (the slow test overfits): lr 1e-2 lowers the loss within 4 steps.
    assert train[-1]["loss"] < train[0]["loss"]
    assert state["tokens_seen"] == train[-1]["tokens_seen"]


def test_wandb_offline_run_holds_the_logged_keys(short_run):
    out, _ = short_run
    rows = read_wandb_history(out / "wandb")
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["_step"] for r in train] == [1, 2, 3, 4]
    assert TRAIN_KEYS <= set(train[0]) and EVAL_KEYS <= set(evals[-1])
    jsonl = {r["step"]: r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r}
    for r in train:
        assert r["loss"] == pytest.approx(jsonl[r["_step"]]["loss"], rel=1e-12)
        assert r["acc_2"] == pytest.approx(jsonl[r["_step"]]["acc_2"], rel=1e-12)


def test_load_draft_gives_the_final_weights(short_run, cache):
    out, _ = short_run
    saved = load_file(str(out / "draft" / "model.safetensors"))
    assert "embed_tokens.weight" not in saved and {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= set(saved)
    for path in (out, out / "draft", out / "checkpoints" / "step-000004"):
        draft = load_draft(path)
        state = draft.state_dict()
        for k, v in saved.items():
            assert torch.equal(state[k], v), k
    meta = json.loads((out / "draft" / "fledge.json").read_text())
    from fledge.models.verifier import load_embed_and_head

    embed, _ = load_embed_and_head(Path(meta["verifier"]["path"]))
    assert torch.equal(draft.embed_tokens.weight, embed.float())
    assert not draft.embed_tokens.weight.requires_grad
    # A verifier with other weights would give the draft a wrong embedding: refused.
    other = cache.parent / "tiny-llama-0-8"  # the random verifier the peaked one was made from
    with pytest.raises(ValueError, match="not the verifier"):
        load_draft(out, verifier_dir=other)


def test_resume_refuses_a_breaking_change_and_allows_a_longer_run(short_run, cache, tmp_path):
    out, _ = short_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    base = {"train.max_steps": 4, "train.lr": 1e-2, "checkpoint.every": 2, "checkpoint.keep_last": 1,
            "validation.every": 2, "validation.holdout": 4}
    with pytest.raises(ValueError, match=r"ttt\.ttt_steps: checkpoint has 3, this run has 2"):
        run_stage("train", train_overrides(cache, copy, **{**base, "ttt.ttt_steps": 2}))
    with pytest.raises(ValueError, match=r"train\.grad_accum"):
        run_stage("train", train_overrides(cache, copy, **{**base, "train.grad_accum": 2}))
    # max_steps may grow: the run continues from step 4 and logs step 5 once.
    result = run_stage("train", train_overrides(cache, copy, **{**base, "train.max_steps": 5}))
    assert result.step == 5
    steps = [r["step"] for r in read_jsonl(copy / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2, 3, 4, 5]
    assert [s for s, _ in complete_checkpoints(copy / "checkpoints")] == [5]


def test_non_finite_step_is_skipped_and_counted(cache, tmp_path, monkeypatch):
    import fledge.train.sampler

    real = fledge.train.sampler.pad_batch
    calls = {"n": 0}

    def poisoned(samples, pin_memory=False):
        batch = real(samples, pin_memory)
        calls["n"] += 1
        if calls["n"] == 2:  # the micro-batch of step 2 (the data thread reads them in order)
            batch["aux"][0, 0, 0] = float("nan")
        return batch

    monkeypatch.setattr(fledge.train.sampler, "pad_batch", poisoned)
    out = tmp_path / "run"
    run_stage("train", train_overrides(cache, out, **{"train.max_steps": 3, "checkpoint.every": 1, "checkpoint.keep_last": 3}))
    records = {r["step"]: r for r in read_jsonl(out / "metrics.jsonl")}
    assert [records[s]["skipped_steps"] for s in (1, 2, 3)] == [0, 1, 1]
    assert not math.isfinite(records[2]["grad_norm"])
    weights = {s: load_file(str(out / "checkpoints" / f"step-{s:06d}" / "model.safetensors")) for s in (1, 2, 3)}
    optim = {s: torch.load(out / "checkpoints" / f"step-{s:06d}" / "optimizer.pt", weights_only=True) for s in (1, 2, 3)}
    # Step 2 changed nothing (weights, Adam moments, step count, LR schedule); step 3 trained again.
    assert all(torch.equal(weights[1][k], weights[2][k]) for k in weights[1])
    assert not all(torch.equal(weights[2][k], weights[3][k]) for k in weights[2])
    first = lambda s: optim[s]["state"][0]  # noqa: E731
    assert torch.equal(first(1)["exp_avg"], first(2)["exp_avg"]) and float(first(2)["step"]) == 1.0
    assert float(first(3)["step"]) == 2.0
    for s in (2, 3):
        assert all(torch.isfinite(v).all() for k, v in weights[s].items() if v.is_floating_point())


def test_eval_on_a_second_cache(cache, tmp_path, smollm_tokenizer):
    # Same verifier (same session root), another cache: evaluated whole, and nothing of the training cache held out.
    other = build_cache(cache.parent, smollm_tokenizer, conversations=6)
    out = tmp_path / "run"
    result = run_stage(
        "train", train_overrides(cache, out, **{"train.max_steps": 2, "validation.every": 2,
                                                "validation.cache_dir": other})
    )
    assert result.last_eval["eval/tokens"] > 0 and 0 <= result.last_eval["eval/acc_0"] <= 1
    assert result.last_eval["eval/tau_sim"] >= 1
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "eval/loss" in r] == [2]


def test_dtype_auto_is_settled_by_a_timing_and_recorded(cache, tmp_path):
    from fledge.train.engine import choose_train_dtype

    assert choose_train_dtype("fp32", torch.device("cpu"), (8, 16, 32)) == "fp32"
    assert choose_train_dtype("bf16", torch.device("cpu"), (8, 16, 32)) == "bf16"
    auto = choose_train_dtype("auto", torch.device("cpu"), (64, 32, 64))
    assert auto in ("fp32", "bf16")
    out = tmp_path / "auto"
    run_stage("train", train_overrides(cache, out, **{"train.max_steps": 1, "train.dtype": "auto"}))
    saved = (out / "checkpoints" / "step-000001" / "train_config.yaml").read_text()
    assert "dtype: fp32" in saved or "dtype: bf16" in saved  # what ran, never "auto"


def test_head_from_the_verifier_and_frozen(cache, tmp_path):
    from safetensors.torch import load_file

    from fledge.data.cache import CacheReader
    from fledge.models.verifier import load_embed_and_head, load_final_norm

    reader = CacheReader(cache)
    _, head = load_embed_and_head(reader.verifier_dir)
    d2t, _ = reader.draft_vocab()
    rows = head.float()[torch.arange(d2t.numel()) + d2t]
    norm = load_final_norm(reader.verifier_dir).float()
    frozen = tmp_path / "frozen"
    run_stage("train", train_overrides(cache, frozen, **{"train.max_steps": 2, "train.head_init": "verifier",
                                                          "train.freeze_head": True}))
    weights = load_file(str(frozen / "draft" / "model.safetensors"))
    assert torch.equal(weights["lm_head.weight"], rows) and torch.equal(weights["norm.weight"], norm)
    trained = tmp_path / "trained"
    run_stage("train", train_overrides(cache, trained, **{"train.max_steps": 2, "train.head_init": "verifier"}))
    weights = load_file(str(trained / "draft" / "model.safetensors"))
    moved = (weights["lm_head.weight"] - rows).abs().max()
    assert 0 < moved < 0.1 * rows.abs().max()  # it started there and took two small steps away
    with pytest.raises(ConfigError, match="train.head_init must be one of"):
        run_stage("train", train_overrides(cache, tmp_path / "x", **{"train.head_init": "copy"}))


def test_muon_trains_the_hidden_matrices_and_resumes_exactly(cache, tmp_path):
    from fledge.models.draft import Eagle3Config, Eagle3Draft
    from fledge.train.config import TrainConfig
    from fledge.train.engine import OptimizerPair, make_optimizer

    # Muon takes the decoder layer's matrices and fc; AdamW keeps lm_head and the norms.
    config = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, vocab_size=100, draft_vocab_size=50, target_hidden_size=32)
    draft = Eagle3Draft(config, seed=0)
    optimizer, _ = make_optimizer(draft, TrainConfig(optimizer="muon", max_steps=4), 4)
    assert isinstance(optimizer, OptimizerPair)
    muon, adamw = optimizer.optimizers
    names = {id(p): n for n, p in draft.named_parameters()}
    muon_names = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    adamw_names = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert "fc.weight" in muon_names and any("mlp" in n for n in muon_names)
    assert "lm_head.weight" in adamw_names and not any("lm_head" in n or "norm" in n for n in muon_names)

    # A run, and one resumed from its step-2 checkpoint (both optimizers' states), end with the same weights.
    args = {"train.max_steps": 4, "train.optimizer": "muon", "train.lr": 1e-2, "checkpoint.every": 2,
            "checkpoint.keep_last": 2}
    whole = tmp_path / "whole"
    run_stage("train", train_overrides(cache, whole, **args))
    part = tmp_path / "part"
    shutil.copytree(whole / "checkpoints" / "step-000002", part / "checkpoints" / "step-000002")
    run_stage("train", train_overrides(cache, part, **args))
    a = load_file(str(whole / "draft" / "model.safetensors"))
    b = load_file(str(part / "draft" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [r["loss"] for r in read_jsonl(whole / "metrics.jsonl") if "loss" in r]
    assert losses[-1] < losses[0]
    with pytest.raises(ConfigError, match="torch engines only"):
        run_stage("train", train_overrides(cache, tmp_path / "x", **{"train.optimizer": "muon",
                                                                       "engine.kind": "deepspeed"}))


def test_the_lens_initialisation_reads_the_top_aux_layer_through_the_copied_head(cache):
    import dataclasses

    from fledge.data.cache import CacheReader
    from fledge.models.verifier import load_final_norm
    from fledge.train.config import TrainConfig
    from fledge.train.loop import build_draft

    reader = CacheReader(cache)
    norm = load_final_norm(reader.verifier_dir).float()
    draft, _ = build_draft(reader, dataclasses.replace(TrainConfig(), head_init="lens", head_init_scale=0.5))
    h = draft.config.hidden_size
    assert torch.equal(draft.norm.weight, 0.5 * norm)
    assert torch.equal(draft.fc.weight[:, 2 * h:], torch.eye(h)) and not draft.fc.weight[:, : 2 * h].any()
    assert not draft.midlayer.self_attn.o_proj.weight.any() and not draft.midlayer.mlp.down_proj.weight.any()
    # The residual stream is the top aux state: the draft's output is that state, whatever the next token.
    aux = torch.randn(1, 5, 3 * h)
    fused = draft.fuse(aux)
    assert torch.equal(fused, aux[..., 2 * h:])
    with pytest.raises(ConfigError, match="head_init_scale must be > 0"):
        TrainConfig(head_init="lens", head_init_scale=0)


def test_the_layer_initialisation_computes_the_verifiers_next_layer_on_the_top_aux_state(cache):
    """``train.layer_init=verifier``: with its embedding columns left out, the draft's decoder layer maps the top aux
    state (``output_hidden_states[i]``) to the verifier's next one (``[i + 1]``), also on a residual scaled down."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from fledge.data.cache import CacheReader
    from fledge.models.verifier import load_layer
    from fledge.train.config import TrainConfig
    from fledge.train.loop import build_draft

    reader = CacheReader(cache)
    draft, _ = build_draft(reader, dataclasses.replace(TrainConfig(), head_init="lens", layer_init="verifier"))
    lens, _ = build_draft(reader, dataclasses.replace(TrainConfig(), head_init="lens"))
    h, top = draft.config.hidden_size, draft.config.aux_layer_ids[2]
    attn, layer = draft.midlayer.self_attn, draft.midlayer
    # The embedding's columns keep the seed's initialisation; everything the verifier has is copied.
    assert torch.equal(attn.q_proj.weight[:, :h], lens.midlayer.self_attn.q_proj.weight[:, :h])
    assert not torch.equal(attn.o_proj.weight, lens.midlayer.self_attn.o_proj.weight)
    model = AutoModelForCausalLM.from_pretrained(reader.verifier_dir, dtype=torch.float32)
    ids = torch.tensor([[5, 17, 3, 42, 8, 9, 11]])
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.weight[:, :h] = 0
        cos, sin = draft.rope(torch.arange(ids.shape[1])[None])
        embeds = draft.embed_tokens(ids)
        out = layer(embeds, states[top], cos, sin, None, None)
        torch.testing.assert_close(out, states[top + 1], rtol=1e-5, atol=1e-5 * states[top + 1].abs().max().item())
        # aux_scale divides the residual stream by s: the copied outputs are divided too, and the layer's output is
        # the same one divided by s (the norms' epsilon set to 0, as the tiny verifier's states are small enough
        # for it to show).
        for norm in (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm):
            norm.eps = 0.0
        plain = layer(embeds, states[top], cos, sin, None, None)
        left = draft.init_layer_from_verifier(load_layer(reader.verifier_dir, top), residual_scale=4.0)
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.weight[:, :h] = 0
        out = layer(embeds, states[top] / 4, cos, sin, None, None)
        torch.testing.assert_close(out, plain / 4, rtol=1e-5, atol=1e-6 * plain.abs().max().item())
    assert left == []  # a Llama layer: nothing the draft has no place for
    with pytest.raises(MismatchError, match="mlp.gate_proj.weight .* does not fit"):
        build_draft(reader, dataclasses.replace(TrainConfig(), layer_init="verifier", draft_intermediate_size=3 * h))
    with pytest.raises(ConfigError, match="train.layer_init must be one of"):
        TrainConfig(layer_init="copy")


def test_train_draft_vocab_size_chooses_the_vocabulary_again_from_the_caches_counts(cache, tmp_path):
    """``train.draft_vocab_size=N``: the N tokens most often in the loss, from the counts the cache kept, without
    caching again; the trained draft carries that vocabulary into its folder."""
    import dataclasses

    from fledge.data.cache import CacheReader
    from fledge.data.vocab import build_draft_vocab, load_token_counts
    from fledge.models.draft_folder import load_draft
    from fledge.train.config import TrainConfig
    from fledge.train.loop import build_draft

    reader = CacheReader(cache)
    cached_d2t, _ = reader.draft_vocab()
    counts = load_token_counts(cache / "draft_vocab.safetensors")
    size = cached_d2t.numel() // 2
    draft, _ = build_draft(reader, dataclasses.replace(TrainConfig(), draft_vocab_size=size))
    d2t, t2d = build_draft_vocab(counts, size)
    assert draft.config.draft_vocab_size == size and torch.equal(draft.d2t, d2t) and torch.equal(draft.t2d, t2d)
    # The most frequent tokens are kept: every kept token is counted at least as often as any left out.
    kept = draft.d2t + torch.arange(size)
    assert counts[kept].min() >= counts[~t2d].max()
    same, _ = build_draft(reader, TrainConfig())
    assert torch.equal(same.d2t, cached_d2t)  # 0: the cache's own
    out = tmp_path / "run"
    run_stage("train", train_overrides(cache, out, **{"train.max_steps": 1, "train.draft_vocab_size": size}))
    trained = load_draft(out / "draft")
    assert trained.config.draft_vocab_size == size and torch.equal(trained.d2t, d2t)
    with pytest.raises(ConfigError, match="larger than the verifier's vocabulary"):
        build_draft(reader, dataclasses.replace(TrainConfig(), draft_vocab_size=counts.numel() + 1))
    with pytest.raises(ConfigError, match="draft_vocab_size must be >= 0"):
        TrainConfig(draft_vocab_size=-1)


def test_train_draft_intermediate_size_widens_the_mlp_and_the_draft_folder_carries_it(cache, tmp_path):
    """``train.draft_intermediate_size=N``: the draft's MLP is N wide (0: the verifier's), and the trained draft's
    folder says so, so that export writes it into ``config.json``."""
    import dataclasses

    from fledge.data.cache import CacheReader
    from fledge.train.config import TrainConfig
    from fledge.train.loop import build_draft

    reader = CacheReader(cache)
    default, _ = build_draft(reader, TrainConfig())
    wide = 2 * default.config.intermediate_size
    draft, _ = build_draft(reader, dataclasses.replace(TrainConfig(), draft_intermediate_size=wide))
    assert draft.config.intermediate_size == wide
    assert [tuple(p.shape) for n, p in draft.named_parameters() if n.endswith("up_proj.weight")] == [
        (wide, draft.config.hidden_size)
    ]
    out = tmp_path / "run"
    run_stage("train", train_overrides(cache, out, **{"train.max_steps": 1, "train.draft_intermediate_size": wide}))
    assert load_draft(out / "draft").config.intermediate_size == wide
    with pytest.raises(ConfigError, match="draft_intermediate_size must be >= 0"):
        TrainConfig(draft_intermediate_size=-1)


def test_train_aux_scale_divides_each_aux_state_by_its_median_rms_in_the_data(cache, tmp_path):
    """``train.aux_scale``: the draft's fc reads each aux state over its typical size, the median over positions of
    its RMS in the data (a few positions are hundreds of times larger); the trained draft keeps the divisors."""
    import dataclasses

    from fledge.data.cache import CacheReader
    from fledge.train.config import TrainConfig
    from fledge.train.loop import aux_scales, build_draft

    reader = CacheReader(cache)
    rows = torch.cat([reader[i]["aux"].float() for i in range(min(32, len(reader)))])
    h = rows.shape[-1] // 3
    expected = [float(rows[:, j * h:(j + 1) * h].pow(2).mean(-1).sqrt().median()) for j in range(3)]
    assert aux_scales(reader) == pytest.approx(expected, rel=1e-6)
    with_outlier = dict(reader[0])
    with_outlier["aux"] = reader[0]["aux"].clone()
    with_outlier["aux"][0] *= 1000  # one position's state a thousand times larger moves a median by one rank at most
    assert aux_scales([with_outlier] * 3) == pytest.approx(aux_scales([reader[0]] * 3), rel=0.5)
    draft, _ = build_draft(reader, dataclasses.replace(TrainConfig(), aux_scale=True))
    assert draft.config.aux_scale == pytest.approx(expected, rel=1e-6)
    assert build_draft(reader, TrainConfig())[0].config.aux_scale is None
    out = tmp_path / "run"
    run_stage("train", train_overrides(cache, out, **{"train.max_steps": 1, "train.aux_scale": True}))
    assert load_draft(out / "draft").config.aux_scale == pytest.approx(expected, rel=1e-6)


def test_a_resume_keeps_the_checkpoints_aux_scale_and_refuses_to_switch_it(cache, tmp_path):
    """A resumed run divides by the divisors its checkpoint's weights were trained with (another machine may measure
    them a last bit apart), and turning ``train.aux_scale`` on or off across a resume is refused."""
    out = tmp_path / "run"
    args = {"train.aux_scale": True, "checkpoint.every": 1}
    run_stage("train", train_overrides(cache, out, **{**args, "train.max_steps": 1}))
    config_file = out / "checkpoints" / "step-000001" / "draft_config.json"
    saved = json.loads(config_file.read_text())
    saved["aux_scale"] = [s * 1.001 for s in saved["aux_scale"]]
    config_file.write_text(json.dumps(saved))
    run_stage("train", train_overrides(cache, out, **{**args, "train.max_steps": 2}))
    assert load_draft(out / "draft").config.aux_scale == saved["aux_scale"]
    with pytest.raises(MismatchError, match="train.aux_scale: checkpoint has True, this run has False"):
        run_stage("train", train_overrides(cache, out, **{"train.aux_scale": False, "train.max_steps": 3}))


def test_a_time_limit_ends_the_run_at_a_step_boundary_with_its_final_draft(cache, tmp_path):
    import time

    from fledge.train.stopping import TIME_LIMIT, PreemptionSignals, stop_reason

    cpu, no_signal = torch.device("cpu"), PreemptionSignals()
    assert stop_reason(None, 0.0, no_signal, cpu) is None
    assert stop_reason(1e-9, time.perf_counter() - 1, no_signal, cpu) == TIME_LIMIT
    assert stop_reason(60.0, time.perf_counter(), no_signal, cpu) is None
    out = tmp_path / "limited"
    result = run_stage("train", train_overrides(cache, out, **{"train.max_steps": 4, "train.time_limit_minutes": 1e-9}))
    assert result.step == 1  # the first step boundary is past the limit
    assert (out / "draft" / "model.safetensors").is_file()
    assert [step for step, _ in complete_checkpoints(out / "checkpoints")] == [1]


def test_a_run_sized_by_time_trains_until_its_time_is_spent_and_ends_at_the_schedules_floor(cache, tmp_path):
    out = tmp_path / "timed"
    args = {"train.max_steps": 100_000, "train.time_budget_minutes": 0.02, "checkpoint.every": 0,
            "train.lr": 1e-3, "train.min_lr": 1e-4}
    result = run_stage("train", train_overrides(cache, out, **args))
    assert 1 <= result.step < 100_000  # the time ended it, not the steps
    assert result.last["lr"] == pytest.approx(1e-4)  # the cosine followed the time to its floor
    lrs = [r["lr"] for r in read_jsonl(out / "metrics.jsonl") if "lr" in r]
    assert len(lrs) >= 3 and all(a >= b for a, b in zip(lrs, lrs[1:])) and lrs[0] > lrs[-1]
    (step, last), = complete_checkpoints(out / "checkpoints")
    seconds = torch.load(last / "train_state.pt", weights_only=True)["seconds"]
    assert step == result.step and seconds >= 1.2
    # A rerun resumes with its time spent: no step. A larger budget goes on from the checkpoint's seconds.
    assert run_stage("train", train_overrides(cache, out, **args)).step == result.step
    longer = run_stage("train", train_overrides(cache, out, **{**args, "train.time_budget_minutes": 0.04}))
    assert longer.step > result.step and longer.last["lr"] == pytest.approx(1e-4)
    spent = torch.load(complete_checkpoints(out / "checkpoints")[-1][1] / "train_state.pt", weights_only=True)
    assert spent["seconds"] >= 2.4
    # the clock went on from the first process's seconds (half the new budget), not from zero: its first learning
    # rate is already half-way down the cosine
    resumed = [r["lr"] for r in read_jsonl(out / "metrics.jsonl") if "lr" in r and r["step"] > result.step]
    assert resumed and resumed[0] < 0.6e-3
    with pytest.raises(ConfigError, match="train.time_budget_minutes must be > 0"):
        run_stage("train", train_overrides(cache, out, **{"train.time_budget_minutes": 0}))


def test_later_epochs_take_the_teachers_in_vocabulary_decisions_from_the_memo_with_the_same_weights(
    cache, tmp_path, monkeypatch
):
    from fledge.train.ttt import InVocabMemo

    hits: list[int] = []
    lookup = InVocabMemo.lookup

    def counted(self, rows, lengths, t):
        found = lookup(self, rows, lengths, t)
        hits.append(found is not None)
        return found

    args = {"train.max_steps": 9, "checkpoint.every": 0}  # 6 micro-batches an epoch: the last 3 steps repeat rows
    monkeypatch.setattr(InVocabMemo, "lookup", counted)
    run_stage("train", train_overrides(cache, tmp_path / "memo", **args))
    assert hits[:6] == [False] * 6 and hits[6:] == [True] * 3
    monkeypatch.setattr(InVocabMemo, "lookup", lambda self, rows, lengths, t: None)
    run_stage("train", train_overrides(cache, tmp_path / "fresh", **args))
    got, want = (load_file(tmp_path / run / "draft" / "model.safetensors") for run in ("memo", "fresh"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_step0_share_trains_step_0_alone_then_the_whole_unroll(cache, tmp_path, caplog):
    """``ttt.step0_share=0.5`` of a 4-step run: steps 1-2 are a 1-step unroll's own (the same losses, bit for bit,
    as a run with ``ttt.ttt_steps=1``), steps 3-4 train all 3 steps, and held-out figures always run all 3."""
    args = {"train.max_steps": 4, "log.every": 1, "validation.every": 2, "validation.holdout": 4,
            "checkpoint.every": 0}
    with caplog.at_level("INFO", logger="fledge.train.loop"):
        run_stage("train", train_overrides(cache, tmp_path / "share", **args, **{"ttt.step0_share": 0.5}))
    assert "ttt.step0_share=0.5 reached after step 2: the whole 3-step unroll from here" in caplog.text
    records = read_jsonl(tmp_path / "share" / "metrics.jsonl")
    train = {r["step"]: r for r in records if "loss" in r}
    held_out = [r for r in records if "eval/acc_0" in r]
    later = [("acc_1" in train[s], "acc_2" in train[s]) for s in (1, 2, 3, 4)]
    assert later == [(False, False)] * 2 + [(True, True)] * 2
    assert [r["step"] for r in held_out] == [2, 4] and all("eval/acc_2" in r for r in held_out)
    run_stage("train", train_overrides(cache, tmp_path / "one", **args, **{"ttt.ttt_steps": 1}))
    one = {r["step"]: r for r in read_jsonl(tmp_path / "one" / "metrics.jsonl") if "loss" in r}
    assert [train[s]["loss"] for s in (1, 2)] == [one[s]["loss"] for s in (1, 2)]
    assert train[3]["loss"] != one[3]["loss"]
    with pytest.raises(ConfigError, match=r"ttt.step0_share must lie in \[0, 1\)"):
        run_stage("train", train_overrides(cache, tmp_path / "bad", **{"ttt.step0_share": 1.0}))


def test_a_metric_window_averages_each_key_over_the_micro_batches_that_had_it():
    from fledge.train.loop import MetricWindow

    window = MetricWindow()
    t = torch.tensor
    window.add({"acc_0": t(0.2), "loss": t(1.0), "tokens": t(10.0)}, tokens=12)
    window.add({"acc_0": t(0.4), "acc_1": t(0.1), "loss": t(3.0), "tokens": t(20.0)}, tokens=24)
    window.add({"acc_0": t(0.6), "acc_1": t(0.3), "loss": t(5.0), "tokens": t(30.0)}, tokens=36)
    record = window.reduce(seconds=2.0)
    assert record["acc_0"] == pytest.approx(0.4) and record["loss"] == pytest.approx(3.0)
    assert record["acc_1"] == pytest.approx(0.2)  # the two micro-batches that had it, not three
    assert record["loss_tokens"] == 60.0 and record["tokens_per_s"] == 36.0 and record["tokens_total"] == 72
