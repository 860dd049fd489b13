"""``fledge cache cache.engine=vllm``: the verifier's states captured by vLLM fill the same shards and manifest as
the hf engine's, within the storage dtype's rounding; a vLLM that cannot capture is refused before any work.

The comparison needs vLLM's own environment (``make vllm-env`` -> ``.venv-vllm``, or ``$FLEDGE_VLLM_PYTHON``) and is
skipped without it; it runs the default verifier (SmolLM2-135M-Instruct) on real ShareGPT conversations.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fledge.core.errors import ConfigError
from fledge.data.cache import CacheConfig, CacheReader
from fledge.data.vllm_capture import check_capture
from fledge.data.vllm_engine import EngineError
from fledge.launch.cli import run_stage

from test_regenerate_vllm import needs_vllm

REPO = Path(__file__).resolve().parent.parent


def overrides(cache_dir: Path, **extra) -> list[str]:
    args = {"verifier.dtype": "float32", "data.max_conversations": 16, "data.max_length": 384,
            "cache.dir": cache_dir, "cache.draft_vocab_size": 512, "cache.batch_tokens": 2048,
            "cache.shard_bytes": 4 * 2**20, "cache.device": "cpu", **extra}
    return [f"{k}={v}" for k, v in args.items()]


def test_an_engine_that_cannot_capture_is_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="cache.engine must be hf or vllm"):
        CacheConfig(engine="sglang")
    # fledge's own Python has no vLLM: the probe says so, naming the way on
    with pytest.raises(EngineError, match="has no hidden-state capture fledge can use") as err:
        check_capture(Path(sys.executable))
    assert "cache.engine=hf" in err.value.fix
    missing = subprocess.run(
        [sys.executable, "-m", "fledge.launch.cli", "cache", *overrides(tmp_path / "cache"), "cache.engine=vllm",
         f"cache.vllm_python={tmp_path / 'nowhere' / 'python'}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert missing.returncode == 2, missing.stderr[-2000:]
    last = missing.stderr.strip().splitlines()[-1]
    assert "engine=vllm needs a Python with vLLM installed" in last and "make vllm-env" in last
    assert not (tmp_path / "cache").exists()


def assert_within_rounding(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal up to a few units in the last place of the storage dtype (two sums of the same terms in other orders
    round apart by that much; the largest states are ~2.5e4 here)."""
    unit = torch.finfo(a.dtype).eps
    gap = (a.float() - b.float()).abs()
    assert bool((gap <= 4 * unit * torch.maximum(a.float().abs(), b.float().abs()) + 1e-3).all()), float(gap.max())


@pytest.mark.slow
@needs_vllm
def test_vllm_capture_fills_the_shards_hf_does(tmp_path):
    hf = run_stage("cache", overrides(tmp_path / "hf"))
    vllm = run_stage("cache", overrides(tmp_path / "vllm", **{"cache.engine": "vllm"}))
    a, b = CacheReader(hf), CacheReader(vllm)
    # the same layout: shards of the same conversations, the same tensors of the same shapes and dtypes
    def layout(folder: Path) -> list[tuple]:
        shards = json.loads((folder / "manifest.json").read_text())["shards"]
        return [(s["file"], s["index"], s["lengths"]) for s in shards]

    assert layout(hf) == layout(vllm) and len(a) == len(b) == 16
    assert a.manifest["aux_layer_ids"] == b.manifest["aux_layer_ids"] and b.manifest["storage_dtype"] == "bfloat16"
    assert "engine" not in a.manifest and b.manifest["engine"]["name"] == "vllm" and b.manifest["engine"]["version"]
    assert torch.equal(a.draft_vocab()[0], b.draft_vocab()[0])
    exact = 0
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert set(x) == set(y)
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        for key in ("aux", "final"):
            assert x[key].shape == y[key].shape and x[key].dtype == y[key].dtype == torch.bfloat16
            assert_within_rounding(x[key], y[key])
            exact += int(torch.equal(x[key], y[key]))
    print(f"rows bitwise equal: {exact} of {2 * len(a)}")
    # a cache begun by one engine is not finished by the other
    json_plan = json.loads((vllm / "cache_plan.json").read_text())
    assert json_plan["engine"] == "vllm" and "engine" not in json.loads((hf / "cache_plan.json").read_text())
