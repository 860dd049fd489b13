"""Online training (``data.mode=online``): the verifier runs in the training process, and a run is the run a cache
of the same data gives — the same rows, losses and weights — in one process, under DDP and DeepSpeed ZeRO-2, and
after a kill -9 and resume. ``data.mode=cache_first_epoch`` trains the same run and leaves ``fledge cache``'s shards,
killed in its first epoch or not. Also: a tokenizer that does not fit the verifier is refused online as by
``fledge cache``, and ``fledge bench train data.mode=online`` reports both throughputs.

The cache here stores fp32 (``cache.storage_dtype=float32``) from an fp32 verifier, so that nothing is rounded away
that could hide a difference; the plan has many batches (``cache.batch_tokens=512``), so conversations are padded
to many different lengths, and many shards.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fledge.core.errors import MismatchError
from fledge.data.cache import CacheConfig, CacheReader
from fledge.data.online import OnlineSource, TrainDataConfig
from fledge.launch.cli import run_stage
from fledge.models.draft_folder import complete_checkpoints
from fledge.models.verifier import VerifierConfig

from conftest import read_jsonl, tiny_hf_config, write_sharegpt_jsonl
from test_train_fixtures import peaked_verifier, run_cli, shared_root, train_overrides

CONVERSATIONS = 24
SHARED = {  # what `fledge cache` and `fledge train data.mode=online` are both given
    "data.max_conversations": "null",
    "data.max_length": 256,
    "verifier.dtype": "float32",
    "cache.draft_vocab_size": 64,
    "cache.storage_dtype": "float32",
    "cache.batch_tokens": 512,
    "cache.shard_bytes": 20000,  # several shards: under two ranks each writes its own
}
RUN = {"train.max_steps": 6, "train.lr": 1e-2, "train.warmup_steps": 1, "train.micro_batch_size": 2,
       "ttt.ttt_steps": 2, "checkpoint.every": 2, "validation.every": 3, "validation.holdout": 4}
FIRST_EPOCH = {**RUN, "train.max_steps": 0, "train.epochs": 1.5}  # into the second epoch: from the cache there


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm_tokenizer) -> dict[str, Path]:
    """The conversations, the peaked tiny verifier, and an fp32 cache of them."""
    root = shared_root(tmp_path_factory)
    root.mkdir(parents=True, exist_ok=True)
    source = write_sharegpt_jsonl(root / f"online-convs-{CONVERSATIONS}.jsonl", CONVERSATIONS, max_words=30)
    verifier = peaked_verifier(root, smollm_tokenizer, source)
    cache = root / "online-cache-fp32"
    if not (cache / "manifest.json").is_file():
        run_stage("cache", [f"{k}={v}" for k, v in {**SHARED, "verifier.name_or_path": verifier, "data.source": source,
                                                    "cache.dir": cache, "cache.device": "cpu"}.items()])
    return {"source": source, "verifier": verifier, "cache": cache}


@pytest.fixture(scope="module")
def online_run(setup, tmp_path_factory) -> Path:
    """An uninterrupted one-process online run."""
    out = tmp_path_factory.mktemp("online") / "run"
    run_cli(train_overrides(setup["cache"], out, **{**RUN, **online(setup)}))
    return out


@pytest.fixture(scope="module")
def offline_first_epoch(setup, tmp_path_factory) -> Path:
    """One process, offline, 1.5 epochs: what ``cache_first_epoch`` must reproduce."""
    out = tmp_path_factory.mktemp("offline-1.5") / "run"
    run_cli(train_overrides(setup["cache"], out, **FIRST_EPOCH))
    return out


def online(setup: dict[str, Path]) -> dict[str, object]:
    return {**SHARED, "data.mode": "online", "data.source": setup["source"], "verifier.name_or_path": setup["verifier"],
            "cache_dir": "/nonexistent"}  # online reads no cache


def open_online(setup: dict[str, Path]) -> OnlineSource:
    from fledge.core.dist import DistInfo

    return OnlineSource.open(
        VerifierConfig(name_or_path=str(setup["verifier"]), dtype="float32"),
        TrainDataConfig(source=str(setup["source"]), max_conversations=None, max_length=256, mode="online"),
        CacheConfig(draft_vocab_size=64, storage_dtype="float32", batch_tokens=512),
        DistInfo(), torch.device("cpu"), setup["cache"],  # the cache of the same job: refuse_another_job passes
    )


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "draft" / "model.safetensors"))


def history(run: Path) -> list[dict]:
    return [r for r in read_jsonl(run / "metrics.jsonl") if "params/trainable" not in r]


LOGGED = ("step", "loss", "ploss_1", "acc_0", "grad_norm", "lr", "tokens_seen", "eval/loss")


def assert_same_training(got: Path, want: Path, what: str) -> None:
    """Same logged losses (and norms, LR, tokens) and weights within 1e-6; prints the largest differences."""
    a, b = history(got), history(want)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    loss_diff = max(abs(x[k] - y[k]) for x, y in zip(a, b) for k in LOGGED if k in x or k in y)
    w_got, w_want = weights(got), weights(want)
    weight_diff = max_diff(w_got, w_want)
    print(f"\n{what}: max |Δ| losses {loss_diff:.3g}, weights {weight_diff:.3g}")
    assert loss_diff <= 1e-6 and weight_diff <= 1e-6


def test_online_rows_are_the_cache_rows(setup):
    """Every row bitwise, whether read alone or in a micro-batch; the same lengths, draft vocabulary and manifest."""
    cached, source = CacheReader(setup["cache"]), open_online(setup)
    assert len(source) == len(cached) == CONVERSATIONS and source.lengths() == cached.lengths()
    for got, want in zip(source.draft_vocab(), cached.draft_vocab()):
        assert torch.equal(got, want)
    assert len(set(source._padded)) > 2, "the test needs conversations padded to several lengths"
    for i in range(len(source)):
        got, want = source[i], cached[i]
        assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}
        assert all(torch.equal(got[k], want[k]) for k in want), f"conversation {i} differs from its cached row"
    mixed = [5, 0, 17, 3, 11, 0]  # several padded lengths, and a repeat
    for got, i in zip(source.rows(mixed), mixed):
        assert all(torch.equal(got[k], cached[i][k]) for k in got)
    for manifest in (source.manifest, cached.manifest):
        for key in ("created", "shards", "bytes"):  # what only a cache on disk has
            manifest.pop(key)
        manifest["source"]["report"].pop("seconds")  # how long reading the source took
    assert source.manifest == cached.manifest


def test_one_process_online_training_equals_offline(setup, online_run, tmp_path):
    offline = tmp_path / "offline"
    run_cli(train_overrides(setup["cache"], offline, **RUN))
    assert_same_training(online_run, offline, "one process")
    # The checkpoints describe the same data; only the cache they name differs (online names none).
    meta = [json.loads((run / "draft" / "fledge.json").read_text()) for run in (online_run, offline)]
    assert meta[0].pop("cache") is None and meta[1].pop("cache") == str(setup["cache"])
    assert meta[0] == meta[1]




def first_epoch(setup: dict[str, Path], cache_dir: Path) -> dict[str, object]:
    return {**online(setup), "data.mode": "cache_first_epoch", "cache_dir": cache_dir}


def assert_same_cache(got: Path, want: Path) -> None:
    """The same shards and sidecars, byte for byte, and the same manifest but for its date."""
    files = sorted(p.name for p in (want / "shards").iterdir())
    assert sorted(p.name for p in (got / "shards").iterdir()) == files and len(files) > 2
    for name in files + ["../draft_vocab.safetensors", "../cache_plan.json"]:
        assert (got / "shards" / name).read_bytes() == (want / "shards" / name).read_bytes(), name
    manifests = [json.loads((d / "manifest.json").read_text()) for d in (got, want)]
    for m in manifests:
        m.pop("created")
        m["source"]["report"].pop("seconds")
    assert manifests[0] == manifests[1]
    assert not (got / "pending").exists()


def test_cache_first_epoch_trains_as_offline_and_leaves_the_cache(setup, offline_first_epoch, tmp_path):
    offline, run, cache = offline_first_epoch, tmp_path / "first-epoch", tmp_path / "cache"
    run_cli(train_overrides(cache, run, **{**FIRST_EPOCH, **first_epoch(setup, cache)}))
    assert_same_training(run, offline, "cache_first_epoch, one process")
    assert_same_cache(cache, setup["cache"])
    meta = [json.loads((r / "draft" / "fledge.json").read_text()) for r in (run, offline)]
    assert meta[0].pop("cache") == str(cache) and meta[1].pop("cache") == str(setup["cache"])
    assert meta[0] == meta[1]


def test_a_tokenizer_that_does_not_fit_the_verifier_is_refused_online_as_by_the_cache(tmp_path, smollm_tokenizer):
    from transformers import AutoModelForCausalLM

    verifier = tmp_path / "small-vocab"  # SmolLM2's tokenizer (49k ids) on a 1000-token embedding
    AutoModelForCausalLM.from_config(tiny_hf_config("llama", vocab_size=1000)).save_pretrained(verifier)
    smollm_tokenizer.save_pretrained(verifier)
    source = write_sharegpt_jsonl(tmp_path / "convs.jsonl", 4)
    common = {"verifier.name_or_path": verifier, "verifier.dtype": "float32", "data.source": source}
    errors = []
    for stage, extra in (("cache", {"cache.dir": tmp_path / "cache", "cache.device": "cpu"}),
                         ("train", {"data.mode": "online", "output_dir": tmp_path / "run", "log.wandb_mode": "disabled",
                                    "train.dtype": "fp32", "engine.device": "cpu", "cache_dir": tmp_path / "none"})):
        with pytest.raises(MismatchError, match="the tokenizer does not fit the verifier") as e:
            run_stage(stage, [f"{k}={v}" for k, v in {**common, **extra}.items()])
        errors.append((str(e.value), e.value.fix))
    assert errors[0] == errors[1] and "outside the verifier vocabulary of 1000" in errors[0][0]
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


@pytest.mark.parametrize("mode", ["online", "cache_first_epoch"])
def test_online_training_against_another_verifier_or_data_than_the_cache_is_refused_before_any_weight_loads(
    setup, tiny_verifier_dir, tmp_path, monkeypatch, mode
):
    import fledge.data.cache_job as cache_job

    def no_load(*args, **kwargs):
        raise AssertionError("the verifier's weights were loaded before the refusal")

    monkeypatch.setattr(cache_job, "load_verifier", no_load)

    def train(**overrides) -> str:
        args = {**SHARED, **RUN, "data.mode": mode, "data.source": setup["source"], "cache_dir": setup["cache"],
                "verifier.name_or_path": setup["verifier"], "output_dir": tmp_path / "run", "log.wandb_mode": "disabled",
                "engine.device": "cpu", **overrides}
        with pytest.raises(MismatchError) as e:
            run_stage("train", [f"{k}={v}" for k, v in args.items()])
        return str(e.value)

    other = train(**{"verifier.name_or_path": tiny_verifier_dir})
    assert f"cache_dir={setup['cache']} was cached from {setup['verifier']}" in other
    assert f"would run verifier.name_or_path={tiny_verifier_dir}" in other
    shorter = train(**{"data.max_length": 128})
    assert "holds other data" in shorter and "data.max_length: the cache has 256, this run 128" in shorter
    # The data's own verifier: a regenerate output names the model that wrote its answers.
    regen = tmp_path / "regen"
    regen.mkdir()
    (regen / "conversations.jsonl").write_text(setup["source"].read_text())
    (regen / "manifest.json").write_text(json.dumps({"verifier": "meta-llama/Llama-3.1-8B-Instruct",
                                                     "verifier_fingerprint": "0" * 64}))
    answers = train(**{"data.source": regen / "conversations.jsonl", "cache_dir": tmp_path / "no-cache"})
    assert f"holds the answers of meta-llama/Llama-3.1-8B-Instruct, but verifier.name_or_path={setup['verifier']}" \
        in answers
    assert not (tmp_path / "run").exists() and not (tmp_path / "no-cache").exists()


def test_a_misspelt_mode_is_refused():
    from fledge.core.errors import ConfigError

    with pytest.raises(ConfigError, match="data.mode must be one of cache, online"):
        TrainDataConfig(mode="onlien")


@pytest.mark.slow
@pytest.mark.parametrize("engine", [{"engine.kind": "ddp"}, {"engine.kind": "deepspeed", "engine.zero_stage": 2}],
                         ids=["ddp", "zero2"])
def test_two_ranks_online_equal_two_ranks_offline(setup, tmp_path, engine):
    """Each rank runs its own verifier on its own micro-batches; under DDP also ``cache_first_epoch``, whose ranks
    write their shards of the cache (1.5 epochs: 5 steps of the second one read the cache)."""
    offline, online_run = tmp_path / "offline", tmp_path / "online"
    name = engine["engine.kind"] + str(engine.get("engine.zero_stage", ""))
    run_cli(train_overrides(setup["cache"], offline, **{**FIRST_EPOCH, **engine}), nproc=2)
    run_cli(train_overrides(setup["cache"], online_run, **{**FIRST_EPOCH, **engine, **online(setup)}), nproc=2)
    assert_same_training(online_run, offline, name)
    if engine["engine.kind"] == "ddp":
        run, cache = tmp_path / "first-epoch", tmp_path / "cache"
        run_cli(train_overrides(cache, run, **{**FIRST_EPOCH, **engine, **first_epoch(setup, cache)}), nproc=2)
        assert_same_training(run, offline, "cache_first_epoch, " + name)
        assert_same_cache(cache, setup["cache"])


@pytest.mark.slow
def test_online_kill9_and_resume_is_bitwise_the_uninterrupted_run(setup, online_run, tmp_path):
    reference, run = online_run, tmp_path / "killed"
    args = train_overrides(setup["cache"], run, **{**RUN, **online(setup)})
    proc = run_cli(args, env={"FLEDGE_TRAIN_FAULT": "save:4"}, check=False)  # SIGKILL while saving step 4
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert [s for s, _ in complete_checkpoints(run / "checkpoints")] == [2]
    proc = run_cli(args)
    assert f"resumed from {run / 'checkpoints' / 'step-000002'}" in proc.stdout + proc.stderr
    w_ref, w_run = weights(reference), weights(run)
    assert all(torch.equal(w_ref[k], w_run[k]) for k in w_ref)
    assert [tuple(r.get(k) for k in LOGGED) for r in history(run)] == [
        tuple(r.get(k) for k in LOGGED) for r in history(reference)]


def test_bench_train_online_reports_both_throughputs(setup, capsys):
    """``fledge bench train data.mode=online`` on the tiny verifier: the stable labels, and the offline steps train
    on exactly the states the online steps compute (the same final loss)."""
    shapes = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  target_hidden_size=32, vocab_size=49152, draft_vocab_size=128, seq_len=24, ttt_steps=2)
    out = run_stage("bench_train", [f"{k}={v}" for k, v in shapes.items()] + [
        "steps=1", "warmup=1", "matmul_size=256", "dtypes=[fp32]", "device=cpu", "data.mode=online",
        f"verifier.name_or_path={setup['verifier']}", "verifier.dtype=float32"])
    text = capsys.readouterr().out
    for label in ("tokens_per_s offline fp32 ", "tokens_per_s online fp32 ", "online_ratio fp32 ",
                  "verifier_forward_ms_per_token fp32 "):
        assert label in text
    (offline,), (online_,) = out["results"], out["online"]
    assert online_["capture_s"] > 0 and offline["capture_s"] == 0
    assert online_["loss"] == offline["loss"]
    assert online_["step_s"] > online_["capture_s"]


@pytest.mark.slow
def test_cache_first_epoch_killed_in_the_first_epoch_resumes_both(setup, offline_first_epoch, tmp_path):
    offline, run, cache = offline_first_epoch, tmp_path / "killed", tmp_path / "cache"
    args = train_overrides(cache, run, **{**FIRST_EPOCH, **first_epoch(setup, cache)})
    proc = run_cli(args, env={"FLEDGE_TRAIN_FAULT": "save:4"}, check=False)  # SIGKILL at step 4, in the first epoch
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert not (cache / "manifest.json").exists() and any((cache / "pending").iterdir())
    run_cli(args)
    w_ref, w_run = weights(offline), weights(run)
    assert all(torch.equal(w_ref[k], w_run[k]) for k in w_ref)
    assert [tuple(r.get(k) for k in LOGGED) for r in history(run)] == [
        tuple(r.get(k) for k in LOGGED) for r in history(offline)]
    assert_same_cache(cache, setup["cache"])
