"""Known user errors: one line naming the stage, the reason and the fix, exit status 2; --debug shows the stack.
And the mismatches that must be refused, not trained through."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from fledge.core.errors import ConfigError, FledgeError, MismatchError
from fledge.launch.cli import run_stage

from test_train_fixtures import build_cache, train_overrides

pytestmark = pytest.mark.usefixtures("one_thread")


def fledge(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", "fledge.launch.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error" in line.lower() or "Traceback" in line]


def test_bad_data_is_one_line_and_status_2(tmp_path, tiny_verifier_dir):
    latin1 = tmp_path / "latin1.jsonl"
    record = '{"conversations": [{"from": "human", "value": "caf\u00e9"}]}\n'.encode("latin-1")
    latin1.write_bytes(record)
    args = ["cache", f"verifier.name_or_path={tiny_verifier_dir}", f"data.source={latin1}",
            f"cache.dir={tmp_path / 'cache'}", "cache.device=cpu"]
    done = fledge(*args)
    assert done.returncode == 2, done.stderr
    assert error_lines(done.stderr) == [
        f"fledge cache: error: latin1.jsonl line 1: not JSON: 'utf-8' codec can't decode byte 0xe9 in position "
        f"{record.index(0xE9)}: invalid continuation byte (fix: give a UTF-8 JSON Lines file, one ShareGPT or OpenAI "
        "record per line)"
    ]
    debug = fledge("--debug", *args)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "DataError" in debug.stderr


def test_config_errors_are_one_line_and_status_2(tmp_path):
    misspelt = fledge("cache", "cache.dirr=x")
    assert misspelt.returncode == 2
    assert error_lines(misspelt.stderr) == [
        "fledge cache: error: Could not override 'cache.dirr'; Key 'dirr' not in 'CacheConfig' "
        "(fix: check the key and its value; `fledge cache --cfg job` prints them all)"
    ]
    inconsistent = fledge("train", "validation.every=10", "validation.holdout=0")
    assert inconsistent.returncode == 2
    [line] = error_lines(inconsistent.stderr)
    assert line.startswith("fledge train: error: validation.every=10 needs held-out data")
    preset = fledge("train", "preset=qwen3-9b")
    assert preset.returncode == 2 and "Available options in 'preset': llama3.1-8b-instruct" in preset.stderr


def test_a_renamed_key_is_refused_with_its_new_name():
    from fledge.launch.cli import compose_config

    old = fledge("train", "eval.holdout=4")
    assert old.returncode == 2
    assert error_lines(old.stderr) == ["fledge train: error: fledge train's eval.holdout is now validation.holdout "
                                       "(fix: pass validation.holdout=4)"]
    with pytest.raises(ConfigError, match="fledge plan's eval.every is now validation.every"):
        compose_config("plan", ["eval.every=0"])
    with pytest.raises(ConfigError, match="fledge tune's lookup_tokens is now num_draft_tokens"):
        compose_config("tune", ["lookup_tokens=3"])
    assert compose_config("tune", ["num_draft_tokens=3"]).num_draft_tokens == 3
    assert compose_config("eval", ["eval.max_prompts=3"]).eval.max_prompts == 3  # fledge eval's `eval.` is its own


def test_a_refused_resume_is_one_line_naming_the_field(tmp_path_factory, tmp_path, smollm_tokenizer):
    from test_train_fixtures import shared_root

    cache = build_cache(shared_root(tmp_path_factory), smollm_tokenizer)
    out = tmp_path / "run"
    run_stage("train", train_overrides(cache, out, **{"train.max_steps": 2}))
    done = fledge("train", *train_overrides(cache, out, **{"train.max_steps": 4, "train.seed": 1}))
    assert done.returncode == 2
    [line] = error_lines(done.stderr)
    assert line.startswith(f"fledge train: error: cannot resume from {out / 'checkpoints' / 'step-000002'}")
    assert "train.seed: checkpoint has 0, this run has 1" in line and "(fix: resume with the checkpoint's values" in line
    # a checkpoint of fledge before `validation.` was named (its config says `eval:`) resumes: the same settings
    saved = out / "checkpoints" / "step-000002" / "train_config.yaml"
    saved.write_text(saved.read_text().replace("\nvalidation:\n", "\neval:\n"))
    assert "\neval:\n" in saved.read_text()
    resumed = run_stage("train", train_overrides(cache, out, **{"train.max_steps": 3}))
    assert resumed.step == 3


def test_training_refuses_a_verifier_with_other_weights(tmp_path, smollm_tokenizer):
    """The cache's states came from one verifier; another's head would teach other distributions."""
    cache = build_cache(tmp_path / "own", smollm_tokenizer, conversations=8, draft_vocab=32)
    verifier_dir = tmp_path / "own" / "peaked-llama"
    weights = load_file(str(verifier_dir / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 1.5
    save_file(weights, str(verifier_dir / "model.safetensors"))
    with pytest.raises(MismatchError, match=f"{verifier_dir} is not the verifier the cache .* was made with"):
        run_stage("train", train_overrides(cache, tmp_path / "run"))


def test_every_known_error_carries_its_fix_on_one_line():
    error = MismatchError("a\n  b: 1\n  c: 2", fix="do d")
    assert error.one_line() == "a; b: 1; c: 2 (fix: do d)"
    assert isinstance(ConfigError("x"), ValueError) and isinstance(ConfigError("x"), FledgeError)
    assert FledgeError("plain").one_line() == "plain"


def test_the_quickstart_reports_a_bad_stage_list_on_one_line(capsys):
    from fledge.launch.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["quickstart", "stages=[cache,trian]"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fledge quickstart: error: quickstart.stages: unknown ['trian']; choose from "
                   "['regenerate', 'cache', 'train', 'eval', 'export']"]


def test_a_source_whose_only_conversation_is_too_long_says_its_length_and_the_limit(tmp_path, tiny_verifier_dir):
    from fledge.data.cache import CacheError

    long = tmp_path / "long.jsonl"
    long.write_text('{"conversations": [{"from": "human", "value": "' + "tell me more " * 40 + '"}, '
                    '{"from": "gpt", "value": "no"}]}\n')
    with pytest.raises(CacheError) as e:
        run_stage("cache", [f"verifier.name_or_path={tiny_verifier_dir}", f"data.source={long}", "data.max_length=32",
                            f"cache.dir={tmp_path / 'cache'}", "cache.device=cpu"])
    message = str(e.value)
    assert "kept 1 conversations" in message
    length = int(message.split("(the first is ")[1].split(" tokens long)")[0].replace(",", ""))
    assert "1 had no assistant token within data.max_length=32 (the first is" in message and length > 100
