"""``fledge regenerate engine=vllm``: the same answers as engine=hf in float32 greedy, seeded sampling that a killed
run resumes exactly, and a clear refusal when vLLM's environment is missing.

The vLLM tests need vLLM's own environment (``make vllm-env`` -> ``.venv-vllm``, or ``$FLEDGE_VLLM_PYTHON``) and are
skipped without it; they run the default verifier (SmolLM2-135M-Instruct) on ShareGPT prompts (~3 min on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fledge.core.errors import ConfigError
from fledge.data.regenerate import RegenerateOptions
from fledge.data.vllm_engine import EngineError, find_vllm_python
from fledge.launch.cli import run_stage

from conftest import read_jsonl, write_sharegpt_jsonl

REPO = Path(__file__).resolve().parent.parent


def vllm_python() -> Path | None:
    try:
        return find_vllm_python(None)
    except EngineError:
        return None


needs_vllm = pytest.mark.skipif(vllm_python() is None, reason="no vLLM environment (make vllm-env)")


def test_a_missing_engine_is_refused_before_anything_loads(tmp_path, tiny_verifier_dir):
    source = write_sharegpt_jsonl(tmp_path / "convs.jsonl", 4, seed=0, max_words=10)
    proc = subprocess.run(
        [sys.executable, "-m", "fledge.launch.cli", "regenerate", f"verifier.name_or_path={tiny_verifier_dir}",
         f"data.source={source}", f"regenerate.out_dir={tmp_path / 'out'}", "regenerate.engine=vllm",
         f"regenerate.vllm_python={tmp_path / 'nowhere' / 'python'}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "engine=vllm needs a Python with vLLM installed" in last and str(tmp_path / "nowhere") in last
    assert "make vllm-env" in last
    assert not (tmp_path / "out").exists()


def test_engine_settings_are_checked():
    with pytest.raises(ConfigError, match="regenerate.engine"):
        RegenerateOptions(engine="sglang")
    with pytest.raises(ConfigError, match="vllm_tensor_parallel_size"):
        RegenerateOptions(engine="vllm", vllm_tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="vllm_data_parallel_size"):
        RegenerateOptions(engine="vllm", vllm_data_parallel_size=0)


def test_replicas_take_gpus_of_their_own(monkeypatch):
    from fledge.data.regenerate import replica_devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    opts = RegenerateOptions(engine="vllm", vllm_tensor_parallel_size=2, vllm_data_parallel_size=2)
    assert replica_devices(opts, 2, torch.device("cuda")) == ["4,5", "6,7"]
    with pytest.raises(ConfigError, match="3 replica\\(s\\) of 2 GPU\\(s\\) need 6 GPUs; this process sees 4"):
        replica_devices(opts, 3, torch.device("cuda"))
    assert replica_devices(opts, 2, torch.device("cpu")) == [None, None]


def overrides(source: Path, out: Path, **extra) -> list[str]:
    args = {
        "verifier.dtype": "float32",
        "data.source": source,
        "data.max_conversations": 12,
        "data.max_length": 512,
        "regenerate.out_dir": out,
        "regenerate.batch_size": 4,
        "regenerate.max_new_tokens": 24,
        "regenerate.device": "cpu",
        "regenerate.vllm_enforce_eager": "true",  # a faster start (no compiled graphs)
        **extra,
    }
    return [f"{k}={v}" for k, v in args.items()]


@pytest.fixture(scope="module")
def sharegpt(tmp_path_factory) -> Path:
    """Twelve real ShareGPT conversations, two turns at most (the second turn follows the engine's own answer)."""
    from fledge.data.sources import DataConfig, load_conversations

    convs, _ = load_conversations(DataConfig(max_conversations=40, require_assistant=False, max_length=512))
    kept = [c[:4] for c in convs if sum(m["role"] == "user" for m in c) >= 1][:12]
    path = tmp_path_factory.mktemp("sharegpt") / "convs.jsonl"
    path.write_text("".join(json.dumps({"id": i, "messages": c}) + "\n" for i, c in enumerate(kept)))
    return path


@pytest.mark.slow
@needs_vllm
def test_vllm_answers_equal_hf_in_float32_greedy(tmp_path, sharegpt):
    # two vLLM replicas (data parallelism: parts dealt in turn to two engines) answer what one hf loop answers
    hf = read_jsonl(run_stage("regenerate", overrides(sharegpt, tmp_path / "hf")))
    vllm = read_jsonl(run_stage("regenerate", overrides(sharegpt, tmp_path / "vllm", **{
        "regenerate.engine": "vllm", "regenerate.vllm_data_parallel_size": 2})))
    assert len(hf) == 12 and [r["id"] for r in vllm] == [r["id"] for r in hf]
    assert sum(len(r["finish"]) for r in hf) > 12  # second turns were answered too
    for a, b in zip(hf, vllm):
        assert a["messages"] == b["messages"] and a["finish"] == b["finish"], a["id"]
    manifest = json.loads((tmp_path / "vllm" / "manifest.json").read_text())
    assert manifest["options"]["engine"] == "vllm" and manifest["engine_this_run"]["vllm"]
    assert manifest["engine_this_run"]["replicas"] == 2 and (tmp_path / "vllm" / "vllm-1.log").is_file()
    assert manifest["new_tokens_this_run"] > 0
    assert "engine" not in json.loads((tmp_path / "hf" / "manifest.json").read_text())["options"]


@pytest.mark.slow
@needs_vllm
def test_vllm_sampling_is_seeded_and_a_killed_run_resumes_to_the_same_answers(tmp_path, sharegpt):
    sampled = {"regenerate.engine": "vllm", "regenerate.temperature": 1.0, "regenerate.top_p": 0.9,
               "data.max_conversations": 8}
    ref = run_stage("regenerate", overrides(sharegpt, tmp_path / "ref", **sampled))
    args = overrides(sharegpt, tmp_path / "killed", **sampled)
    cmd = [sys.executable, "-m", "fledge.launch.cli", "regenerate", *args]
    env = {**os.environ, "FLEDGE_FAULT": "regenerate_after_part_0"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 137, proc.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "killed" / "parts").iterdir()) == ["part-00000.jsonl"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "1 of 2 parts already generated" in proc.stdout + proc.stderr
    assert (tmp_path / "killed" / "conversations.jsonl").read_bytes() == ref.read_bytes()
    greedy = read_jsonl(run_stage("regenerate", overrides(sharegpt, tmp_path / "greedy", **{
        **sampled, "regenerate.temperature": 0.0})))
    assert [r["messages"] for r in greedy] != [r["messages"] for r in read_jsonl(ref)]  # it did sample
