"""Serving export and import: training checkpoint -> export -> import reproduces the draft, in both formats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fledge.core.errors import ConfigError
from fledge.export.check import check_checkpoint
from fledge.export.job import ExportJobConfig, default_out_dir, run
from fledge.export.write import export_draft, speculators_dir, tau_from_report
from fledge.models.draft import DraftKVCache, Eagle3Config, Eagle3Draft
from fledge.models.draft_folder import load_draft, write_draft, write_final_draft
from fledge.models.serving import load_exported
from fledge.models.verifier import load_embed_and_head, weight_fingerprint

V, H, LAYERS, DRAFT_V = 300, 32, 8, 64
AUX = [2, 4, 5]


def make_verifier(path: Path, rope_scaling: dict | None = None, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=2 * H,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_theta=50000.0,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,  # transformers adds keys in place
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def draft_vocab() -> tuple[torch.Tensor, torch.Tensor]:
    """Like a frequency-chosen vocabulary: the low ids plus a scattering of others, sorted; as (d2t, t2d)."""
    g = torch.Generator().manual_seed(3)
    others = 40 + torch.randperm(V - 40, generator=g)[: DRAFT_V - 40]
    ids = torch.sort(torch.cat([torch.arange(40), others])).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(DRAFT_V), t2d


def make_draft(verifier_dir: Path, seed: int = 0) -> Eagle3Draft:
    """A draft with every weight random (norms too, so that a dropped or swapped tensor shows in the logits)."""
    from transformers import AutoConfig

    cfg = Eagle3Config.from_verifier(AutoConfig.from_pretrained(verifier_dir), DRAFT_V, AUX)
    draft = Eagle3Draft(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    draft.load_verifier_embedding(load_embed_and_head(verifier_dir)[0])
    draft.set_draft_vocab(*draft_vocab())
    return draft.eval()


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory) -> Path:
    return make_verifier(tmp_path_factory.mktemp("export") / "tiny-llama")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, verifier_dir) -> Path:
    """A training run as the trainer leaves it: a step checkpoint and the final draft/, written by its own writer."""
    run = tmp_path_factory.mktemp("run")
    draft = make_draft(verifier_dir)
    meta = {
        "format": "fledge-draft-1",
        "verifier": {"name": "tiny-llama", "path": str(verifier_dir), "fingerprint": weight_fingerprint(verifier_dir)},
        "aux_layer_ids": AUX,
        "cache": str(run / "no-cache"),
        "ttt_steps": 7,
    }
    write_draft(run / "checkpoints" / "step-000010", draft.trainable_state_dict(), draft.config, {**meta, "step": 10})
    write_final_draft(run, draft.trainable_state_dict(), draft.config, {**meta, "step": 10})
    return run


def draft_outputs(draft: Eagle3Draft, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a 3-step chained draft after a 6-token prefix, and the verifier ids of each step's argmax.

    Exercises fc, the decoder layer through the KV cache, norm, lm_head and d2t: every exported tensor.
    """
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(2, 6, 3 * H, generator=g)
    ids = torch.randint(0, V, (2, 6), generator=g)
    cache = DraftKVCache()
    with torch.no_grad():
        out = draft(draft.fuse(aux), ids, torch.arange(6), kv_cache=cache)
        logits = [draft.logits(out[:, -1:])]
        for step in range(2):
            token = draft.d2t[logits[-1].argmax(-1)] + logits[-1].argmax(-1)
            out = draft(out[:, -1:], token, torch.tensor([6 + step]), kv_cache=cache)
            logits.append(draft.logits(out))
    logits_t = torch.cat(logits, dim=1)
    top = logits_t.argmax(-1)
    return logits_t, top + draft.d2t[top]


def rounded(draft: Eagle3Draft, dtype: torch.dtype) -> Eagle3Draft:
    """The draft with its weights rounded through ``dtype``: what a bf16 export holds, exactly (the embedding is
    the verifier's and is not exported, so it is not rounded)."""
    copy = Eagle3Draft(draft.config)
    copy.load_verifier_embedding(draft.embed_tokens.weight)
    copy.load_trainable_state_dict(
        {k: (v.to(dtype).float() if v.is_floating_point() else v) for k, v in draft.trainable_state_dict().items()}
    )
    return copy.eval()


def test_training_checkpoint_export_import_float32_is_exact(run_dir, verifier_dir, tmp_path):
    trained = load_draft(run_dir)
    out = run(ExportJobConfig(draft=str(run_dir), out_dir=str(tmp_path / "serving"), dtype="float32", tau=2.5))
    imported = load_exported(out, verifier_dir)
    for key, value in trained.state_dict().items():
        assert torch.equal(imported.state_dict()[key], value), key
    logits_a, ids_a = draft_outputs(trained)
    logits_b, ids_b = draft_outputs(imported)
    assert torch.equal(logits_a, logits_b)
    assert torch.equal(ids_a, ids_b)
    assert imported.config == trained.config
    assert check_checkpoint(out, verifier_dir) == []


def test_training_checkpoint_export_import_bfloat16(run_dir, verifier_dir, tmp_path):
    trained = load_draft(run_dir / "checkpoints" / "step-000010")
    out = run(ExportJobConfig(draft=str(run_dir / "checkpoints" / "step-000010"), out_dir=str(tmp_path / "bf16")))
    weights = load_file(str(out / "model.safetensors"))
    assert {t.dtype for k, t in weights.items() if k not in ("d2t", "t2d")} == {torch.bfloat16}
    imported = load_exported(out, verifier_dir)
    logits_a, ids_a = draft_outputs(trained)
    logits_b, ids_b = draft_outputs(imported)
    # bf16 rounding of the weights alone: relative error well under 2 %, and most argmaxes survive it.
    assert (logits_b - logits_a).norm() / logits_a.norm() < 0.02
    assert (ids_a == ids_b).float().mean() >= 0.8
    # And exactly what the original draft computes with bf16-rounded weights.
    logits_r, ids_r = draft_outputs(rounded(trained, torch.bfloat16))
    assert torch.equal(logits_b, logits_r) and torch.equal(ids_b, ids_r)


def test_serving_config_and_tensors(run_dir, verifier_dir, tmp_path):
    out = run(ExportJobConfig(draft=str(run_dir), out_dir=str(tmp_path / "s"), training_data="tiny chats"))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert (config["hidden_size"], config["head_dim"]) == (H, H // 4)
    # Equal to hidden_size, so left out: the official EAGLE code would otherwise expect a shipped embedding.
    assert "target_hidden_size" not in config
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]) == (4, 2, 2 * H)
    assert (config["vocab_size"], config["draft_vocab_size"]) == (V, DRAFT_V)
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in AUX], "use_aux_hidden_state": True}
    assert config["rope_theta"] == 50000.0 and config["rope_scaling"] is None
    assert config["max_position_embeddings"] == 512 and config["torch_dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    weights = load_file(str(out / "model.safetensors"))
    shapes = {k: tuple(v.shape) for k, v in weights.items()}
    assert shapes == {
        "fc.weight": (H, 3 * H),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (H, 2 * H),
        "midlayer.self_attn.k_proj.weight": (H // 2, 2 * H),
        "midlayer.self_attn.v_proj.weight": (H // 2, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, H),
        "midlayer.mlp.gate_proj.weight": (2 * H, H),
        "midlayer.mlp.up_proj.weight": (2 * H, H),
        "midlayer.mlp.down_proj.weight": (H, 2 * H),
        "norm.weight": (H,),
        "lm_head.weight": (DRAFT_V, H),
        "d2t": (DRAFT_V,),
        "t2d": (V,),
    }
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert torch.equal(weights["d2t"], draft_vocab()[0]) and torch.equal(weights["t2d"], draft_vocab()[1])
    card = (out / "README.md").read_text()
    assert "tiny-llama" in card and "tiny chats" in card and "not measured" in card


def test_every_consumer_reads_the_verifier_embedding(verifier_dir, tmp_path):
    """By default neither target_hidden_size nor an embedding: vLLM and SGLang fall back to hidden_size and the
    official EAGLE code loads the verifier's embedding. ship_embedding=true writes both, the embedding the
    verifier's, and the served draft is the same one."""
    draft = make_draft(verifier_dir, seed=7)
    plain = export_draft(draft, verifier_dir, tmp_path / "plain", dtype="float32")
    shipped = export_draft(draft, verifier_dir, tmp_path / "shipped", dtype="float32", ship_embedding=True)
    plain_config = json.loads((plain / "config.json").read_text())
    shipped_config = json.loads((shipped / "config.json").read_text())
    assert "target_hidden_size" not in plain_config and shipped_config["target_hidden_size"] == H
    assert "embed_tokens.weight" not in load_file(str(plain / "model.safetensors"))
    embed = load_file(str(shipped / "model.safetensors"))["embed_tokens.weight"]
    assert torch.equal(embed, load_embed_and_head(verifier_dir)[0])
    assert check_checkpoint(plain, verifier_dir) == [] and check_checkpoint(shipped, verifier_dir) == []
    assert "(shipped too)" in (shipped / "README.md").read_text()
    # The shipped folder imports without the verifier; both serve exactly the trained draft.
    reference = draft_outputs(draft)[0]
    assert torch.equal(draft_outputs(load_exported(shipped))[0], reference)
    assert torch.equal(draft_outputs(load_exported(plain, verifier_dir))[0], reference)


def test_the_card_names_the_verifiers_hub_id(tmp_path):
    """The serving commands of the model card name what the engines would serve: the Hub id."""
    from fledge.models.verifier import SOURCE_FILE, verifier_hub_id

    converted = tmp_path / "verifiers" / "smollm2-135m-instruct"
    converted.mkdir(parents=True)
    (converted / SOURCE_FILE).write_text(json.dumps({"gguf": "/x/SmolLM2-135M-Instruct.Q4_1.gguf",
                                                     "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct"}))
    assert verifier_hub_id(converted) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    # Converted before the id was recorded: the embedded GGUF's file name still tells.
    (converted / SOURCE_FILE).write_text(json.dumps({"gguf": "/x/SmolLM2-135M-Instruct.Q4_1.gguf"}))
    assert verifier_hub_id(converted) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B-Instruct" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    assert verifier_hub_id(snapshot) == "meta-llama/Llama-3.1-8B-Instruct"
    assert verifier_hub_id(tmp_path / "hub") == "hub"  # any other folder: its name


def test_rope_scaling_reaches_the_config_and_back(tmp_path):
    """A llama3-scaled verifier: vLLM/SGLang read rope_theta + rope_scaling, transformers 5 rope_parameters."""
    from transformers import AutoConfig

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128}
    vdir = make_verifier(tmp_path / "scaled", rope_scaling=scaling, seed=1)
    draft = make_draft(vdir, seed=2)
    assert draft.config.rope_scaling == scaling
    out = export_draft(draft, vdir, tmp_path / "out", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == scaling and config["rope_theta"] == 50000.0
    assert config["rope_parameters"] == {"rope_theta": 50000.0, **scaling}
    read_back = AutoConfig.from_pretrained(out)  # what an engine built on transformers 5 sees
    assert read_back.rope_parameters["rope_type"] == "llama3" and read_back.rope_parameters["factor"] == 8.0
    assert read_back.rope_parameters["rope_theta"] == 50000.0
    imported = load_exported(out, vdir)
    assert imported.config.rope_scaling == scaling
    assert torch.equal(imported._inv_freq, draft._inv_freq)
    assert torch.equal(draft_outputs(imported)[0], draft_outputs(draft)[0])


def test_speculators_format(verifier_dir, tmp_path):
    draft = make_draft(verifier_dir, seed=4)
    out = export_draft(draft, verifier_dir, tmp_path / "flat", dtype="float32", speculators=True,
                       card={"num_speculative_tokens": 5})
    spec = speculators_dir(out)
    assert spec == tmp_path / "flat-speculators"
    config = json.loads((spec / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    # Explicit: vLLM reads an absent norm_before_residual as true.
    assert config["norm_before_residual"] is False and config["norm_before_fc"] is False
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX
    assert (config["draft_vocab_size"], config["target_hidden_size"]) == (DRAFT_V, H)
    layer = config["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["vocab_size"], layer["hidden_size"]) == ("llama", 1, V, H)
    method = config["speculators_config"]["proposal_methods"][0]
    assert method["proposal_type"] == "greedy" and method["speculative_tokens"] == 5
    assert config["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    names = set(load_file(str(spec / "model.safetensors")))
    assert "layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer.") for n in names)
    assert "embed_tokens.weight" not in names
    assert check_checkpoint(spec, verifier_dir) == []
    assert torch.equal(draft_outputs(load_exported(spec, verifier_dir))[0], draft_outputs(draft)[0])


def test_third_party_layout_imports(verifier_dir, tmp_path):
    """Another trainer's spelling: model./layers.0. names, its own copy of the embedding, draft ids in no
    particular order, no layer ids (engines then use [2, L//2, L-3]). Import reproduces it over the verifier vocab."""
    from transformers import AutoConfig

    cfg = Eagle3Config.from_verifier(AutoConfig.from_pretrained(verifier_dir), DRAFT_V, [2, LAYERS // 2, LAYERS - 3])
    draft = Eagle3Draft(cfg, seed=6)
    draft.load_verifier_embedding(load_embed_and_head(verifier_dir)[0])
    draft.set_draft_vocab(*draft_vocab())
    out = export_draft(draft, verifier_dir, tmp_path / "ours", dtype="float32")
    third = tmp_path / "third"
    third.mkdir()
    config = json.loads((out / "config.json").read_text())
    for key in ("eagle_aux_hidden_state_layer_ids", "eagle_config", "fledge", "rope_parameters"):
        del config[key]
    (third / "config.json").write_text(json.dumps(config))
    weights = load_file(str(out / "model.safetensors"))
    perm = torch.randperm(DRAFT_V, generator=torch.Generator().manual_seed(0))
    targets = (torch.arange(DRAFT_V) + weights["d2t"])[perm]
    renamed = {("model." + k.replace("midlayer.", "layers.0.")): v for k, v in weights.items() if k not in ("d2t", "t2d", "lm_head.weight")}
    renamed["lm_head.weight"] = weights["lm_head.weight"][perm]
    renamed["d2t"] = targets - torch.arange(DRAFT_V)
    renamed["embed_tokens.weight"] = draft.embed_tokens.weight.detach().clone()
    save_file(renamed, str(third / "model.safetensors"))

    with pytest.raises(ValueError, match="aux layer ids"):
        load_exported(third)  # neither ids nor the verifier's depth: nothing to choose the layers from
    imported = load_exported(third, verifier_dir)
    assert imported.config.aux_layer_ids == [2, LAYERS // 2, LAYERS - 3]
    # Sorted back into verifier-id order, the draft is the original one, row for row.
    assert torch.equal(imported.d2t, draft.d2t) and torch.equal(imported.t2d, draft.t2d)
    assert torch.equal(draft_outputs(imported)[0], draft_outputs(draft)[0])


def test_import_without_embedding_needs_the_verifier(verifier_dir, tmp_path):
    out = export_draft(make_draft(verifier_dir), verifier_dir, tmp_path / "out")
    with pytest.raises(ValueError, match="ships no embedding"):
        load_exported(out)


def test_export_refuses_a_draft_without_the_verifier_embedding(verifier_dir, tmp_path):
    draft = make_draft(verifier_dir)
    with torch.no_grad():
        draft.embed_tokens.weight.normal_(0, 0.02)
    with pytest.raises(ValueError, match="embed_tokens differs"):
        export_draft(draft, verifier_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_is_atomic_and_replaces_only_exports(verifier_dir, tmp_path):
    out = export_draft(make_draft(verifier_dir, seed=1), verifier_dir, tmp_path / "out")
    first = load_file(str(out / "model.safetensors"))["fc.weight"]
    export_draft(make_draft(verifier_dir, seed=2), verifier_dir, out)  # a re-export replaces the old one
    assert not torch.equal(load_file(str(out / "model.safetensors"))["fc.weight"], first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary or old folders left
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        export_draft(make_draft(verifier_dir), verifier_dir, other)
    assert (other / "keep.txt").read_text() == "mine"
    # A draft whose served form would be wrong (here: a tied head) is refused before anything is renamed in place.
    tied = make_draft(verifier_dir, seed=3)
    with torch.no_grad():
        tied.lm_head.weight.copy_(tied.embed_tokens.weight[torch.arange(DRAFT_V) + tied.d2t])
    with pytest.raises(ValueError, match="tied-head"):
        export_draft(tied, verifier_dir, out)
    assert not torch.equal(load_file(str(out / "model.safetensors"))["lm_head.weight"].float(), tied.lm_head.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "out"]


def test_model_card_from_a_report(run_dir, tmp_path):
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"sets": {"mt_bench": {"chain": {"tau": 2.25, "alpha": [0.6]}}, "sharegpt": {"tau": 1.75}}}))
    out = run(ExportJobConfig(draft=str(run_dir), out_dir=str(tmp_path / "s"), report=str(report)))
    card = (out / "README.md").read_text()
    assert "sets/mt_bench/chain: 2.250" in card and "sets/sharegpt: 1.750" in card and str(report) in card
    assert tau_from_report([{"name": "mt", "tau": 3}, {"tau": float("nan")}]) == {"mt": 3.0}
    with pytest.raises(ValueError, match="both"):
        ExportJobConfig(tau=2.0, report=str(report))


def test_default_out_dir(run_dir):
    from fledge.models.draft_folder import draft_folder

    assert default_out_dir(draft_folder(run_dir)) == run_dir / "serving"
    step = run_dir / "checkpoints" / "step-000010"
    assert default_out_dir(draft_folder(step)) == run_dir / "serving-step-000010"


def test_cli_composes_and_dispatches(run_dir, verifier_dir, tmp_path, capsys):
    from hydra.errors import ConfigCompositionException

    from fledge.launch.cli import compose_config, main, run_stage

    with pytest.raises(ConfigError, match="checkpoint= is now draft="):
        ExportJobConfig(checkpoint=str(run_dir))
    cfg = compose_config("export", [f"draft={run_dir}", "dtype=float32", "speculators=true"])
    assert isinstance(cfg, ExportJobConfig) and cfg.dtype == "float32" and cfg.speculators
    with pytest.raises(ConfigCompositionException):
        compose_config("export", ["dtyp=float32"])
    out = run_stage("export", [f"draft={run_dir}", f"out_dir={tmp_path / 'cli'}", "speculators=true"])
    assert out == tmp_path / "cli" and (tmp_path / "cli-speculators" / "config.json").is_file()
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "check", str(out), "--verifier", str(verifier_dir)])
    assert exit_info.value.code == 0
    assert "OK" in capsys.readouterr().out


@pytest.mark.slow
def test_cache_train_export_check_import(tmp_path, smollm_tokenizer):
    """The whole pipeline on a tiny verifier: fledge cache -> fledge train (2 steps) -> fledge export -> check -> import."""
    from fledge.launch.cli import run_stage

    from conftest import make_tiny_verifier, write_sharegpt_jsonl

    vdir = make_tiny_verifier(tmp_path, "llama", smollm_tokenizer)
    convs = write_sharegpt_jsonl(tmp_path / "convs.jsonl", 16)
    run_stage("cache", [f"verifier.name_or_path={vdir}", "verifier.dtype=float32", f"data.source={convs}",
                        f"cache.dir={tmp_path / 'cache'}", "cache.draft_vocab_size=200", "data.max_length=256"])
    run_stage("train", [f"cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'train'}", "train.max_steps=2",
                        "validation.holdout=0", "validation.every=0"])
    out = run_stage("export", [f"draft={tmp_path / 'train'}", "dtype=float32", "speculators=true"])
    assert out == tmp_path / "train" / "serving"
    assert check_checkpoint(out, vdir) == [] and check_checkpoint(speculators_dir(out), vdir) == []
    trained, imported = load_draft(tmp_path / "train"), load_exported(out, vdir)
    for key, value in trained.state_dict().items():
        assert torch.equal(imported.state_dict()[key], value), key


def test_a_draft_over_the_whole_vocabulary_ships_no_d2t_and_a_d2t_there_is_refused(verifier_dir, tmp_path):
    """vLLM builds no draft-to-target mapping when the draft vocabulary is the verifier's, and refuses a d2t."""
    from transformers import AutoConfig

    cfg = Eagle3Config.from_verifier(AutoConfig.from_pretrained(verifier_dir), V, AUX)
    draft = Eagle3Draft(cfg, seed=4)
    draft.load_verifier_embedding(load_embed_and_head(verifier_dir)[0])
    draft.eval()
    out = export_draft(draft, verifier_dir, tmp_path / "full", dtype="float32")
    weights = load_file(str(out / "model.safetensors"))
    assert "d2t" not in weights and "t2d" not in weights
    assert "all: no `d2t`" in (out / "README.md").read_text()
    imported = load_exported(out, verifier_dir)
    assert torch.equal(imported.lm_head.weight, draft.lm_head.weight) and not imported.d2t.any()
    assert torch.equal(draft_outputs(imported)[1], draft_outputs(draft)[1])
    assert check_checkpoint(out, verifier_dir) == []

    weights["d2t"] = torch.zeros(V, dtype=torch.int64)
    weights["t2d"] = torch.ones(V, dtype=torch.bool)
    save_file(weights, str(out / "model.safetensors"))
    problems = check_checkpoint(out, verifier_dir)
    assert [(p.level, p.code) for p in problems] == [("error", "d2t-full-vocab")]
    assert "draft_id_to_target_id" in problems[0].message


def test_aux_scale_is_folded_into_fc_so_the_export_is_a_plain_head_that_drafts_the_same(verifier_dir, tmp_path):
    """``Eagle3Config.aux_scale``: fc reads aux_i / s_i; the draft folder keeps the divisors, the export folds them
    into fc's columns (engines feed it the raw states) and imports as a head without them, drafting the same."""
    import dataclasses

    plain = make_draft(verifier_dir)
    scaled = Eagle3Draft(dataclasses.replace(plain.config, aux_scale=[2.0, 5.0, 20.0]))
    scaled.load_verifier_embedding(plain.embed_tokens.weight)
    scaled.load_trainable_state_dict(plain.trainable_state_dict())
    scaled.eval()
    aux = torch.randn(2, 6, 3 * H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    divisors = torch.tensor([2.0, 5.0, 20.0], dtype=torch.float64).repeat_interleave(H)
    w = plain.fc.weight.double()
    assert torch.allclose(scaled.double().fuse(aux), aux @ (w / divisors).T, rtol=1e-12, atol=0)
    assert torch.allclose(plain.double().fuse(aux), aux @ w.T, rtol=1e-12, atol=0)
    scaled.float()
    plain.float()

    meta = {"format": "fledge-draft-1", "aux_layer_ids": AUX, "step": 1,
            "verifier": {"name": "tiny-llama", "path": str(verifier_dir), "fingerprint": weight_fingerprint(verifier_dir)}}
    write_final_draft(tmp_path / "run", scaled.trainable_state_dict(), scaled.config, meta)
    reloaded = load_draft(tmp_path / "run")
    assert reloaded.config.aux_scale == [2.0, 5.0, 20.0]
    assert torch.equal(draft_outputs(reloaded)[0], draft_outputs(scaled)[0])

    out = run(ExportJobConfig(draft=str(tmp_path / "run"), out_dir=str(tmp_path / "serving"), dtype="float32"))
    assert "aux_scale" not in json.dumps(json.loads((out / "config.json").read_text()))
    imported = load_exported(out, verifier_dir)
    assert imported.config.aux_scale is None
    assert torch.allclose(imported.fc.weight, scaled.fc.weight / divisors.float(), rtol=1e-6, atol=0)
    logits_a, ids_a = draft_outputs(scaled)
    logits_b, ids_b = draft_outputs(imported)
    assert torch.allclose(logits_a, logits_b, rtol=1e-4, atol=1e-5) and torch.equal(ids_a, ids_b)
    assert check_checkpoint(out, verifier_dir) == []
    with pytest.raises(ConfigError, match="aux_scale must hold 3 positive numbers"):
        dataclasses.replace(plain.config, aux_scale=[1.0, 0.0, 2.0])
