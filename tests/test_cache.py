"""The hidden-state cache: contents, resume after kill -9, damage and mismatch detection, torchrun equality."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fledge.core.errors import ConfigError
from fledge.core.files import sha256_file
from fledge.data.cache import CacheError, CacheReader, plan_shards
from fledge.launch.cli import run_stage

from conftest import make_tiny_verifier, write_sharegpt_jsonl

REPO = Path(__file__).resolve().parent.parent


def cache_overrides(verifier_dir: Path, source: Path, cache_dir: Path, **extra: object) -> list[str]:
    args = {
        "verifier.name_or_path": verifier_dir,
        "verifier.dtype": "float32",
        "data.source": source,
        "data.max_conversations": "null",
        "data.max_length": 256,
        "cache.dir": cache_dir,
        "cache.shard_bytes": 20000,
        "cache.batch_tokens": 512,
        "cache.draft_vocab_size": 64,
        "cache.device": "cpu",
    }
    args.update(extra)
    return [f"{k}={v}" for k, v in args.items()]


def run_cli(overrides: list[str], env: dict[str, str] | None = None, nproc: int = 1, check: bool = True):
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if nproc == 1:
        cmd = [sys.executable, "-m", "fledge.launch.cli", "cache", *overrides]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port=29533",
               "-m", "fledge.launch.cli", "cache", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def shard_bytes(cache_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((cache_dir / "shards").glob("shard-*.safetensors"))}


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_verifier_dir):
    root = tmp_path_factory.mktemp("cache")
    source = write_sharegpt_jsonl(root / "convs.jsonl", 24, max_words=40)
    cache_dir = root / "clean"
    run_stage("cache", cache_overrides(tiny_verifier_dir, source, cache_dir))
    return source, cache_dir


def test_reader_serves_the_verifier_states(built, tiny_verifier_dir):
    from transformers import AutoModelForCausalLM

    _, cache_dir = built
    reader = CacheReader(cache_dir)
    m = reader.manifest
    assert m["num_conversations"] == len(reader) > 0
    assert len(m["shards"]) > 3, "the test wants several shards"
    assert m["aux_layer_ids"] == [2, 4, 5]
    model = AutoModelForCausalLM.from_pretrained(tiny_verifier_dir, dtype=torch.float32).eval()
    for i in (0, len(reader) - 1):
        sample = reader[i]
        T = len(sample["input_ids"])
        assert sample["aux"].shape == (T, 3 * 32) and sample["final"].shape == (T, 32)
        assert sample["aux"].dtype == torch.bfloat16
        assert 0 < int(sample["loss_mask"].sum()) < T
        with torch.no_grad():
            out = model(sample["input_ids"][None], output_hidden_states=True)
        hs = out.hidden_states
        # Aux ids are output_hidden_states indices; the final state is the normed output (hidden_states[-1]).
        expected = torch.cat([hs[2], hs[4], hs[5]], dim=-1)[0]
        torch.testing.assert_close(sample["aux"].float(), expected, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(sample["final"].float(), hs[-1][0], atol=2e-2, rtol=2e-2)
    d2t, t2d = reader.draft_vocab()
    assert d2t.shape == (64,) and t2d.sum() == 64


def test_rerun_of_a_complete_cache_does_nothing(built, tiny_verifier_dir):
    source, cache_dir = built
    before = {p: p.stat().st_mtime_ns for p in (cache_dir / "shards").iterdir()}
    run_stage("cache", cache_overrides(tiny_verifier_dir, source, cache_dir))
    assert before == {p: p.stat().st_mtime_ns for p in (cache_dir / "shards").iterdir()}


def test_a_cpu_cache_keeps_freed_host_memory_and_a_complete_one_does_not_ask(built, tiny_verifier_dir, tmp_path,
                                                                            monkeypatch):
    import fledge.data.cache_job as cache_job

    calls = []
    monkeypatch.setattr(cache_job, "keep_freed_memory", lambda device: calls.append(device.type) or True)
    source, cache_dir = built
    run_stage("cache", cache_overrides(tiny_verifier_dir, source, cache_dir))  # complete: nothing runs
    assert calls == []
    run_stage("cache", cache_overrides(tiny_verifier_dir, source, tmp_path / "fresh"))
    assert calls == ["cpu"]
    assert shard_bytes(tmp_path / "fresh") == shard_bytes(cache_dir)


def test_a_cache_of_an_earlier_fledge_reads_reruns_and_resumes(built, tiny_verifier_dir, tmp_path):
    # its plan was plan.json before 2026-12-05
    source, clean = built
    old = tmp_path / "old"
    shutil.copytree(clean, old)
    (old / "cache_plan.json").rename(old / "plan.json")
    assert len(CacheReader(old)) == len(CacheReader(clean))
    before = {p: p.stat().st_mtime_ns for p in (old / "shards").iterdir()}
    run_stage("cache", cache_overrides(tiny_verifier_dir, source, old))  # complete: nothing to do
    assert before == {p: p.stat().st_mtime_ns for p in (old / "shards").iterdir()}
    # an unfinished one resumes, and its plan takes the current name
    (old / "manifest.json").unlink()
    last = sorted((old / "shards").glob("shard-*"))[-2:]
    for path in last:
        path.unlink()
    with pytest.raises(CacheError, match="incomplete"):
        CacheReader(old)
    run_stage("cache", cache_overrides(tiny_verifier_dir, source, old))
    assert shard_bytes(old) == shard_bytes(clean)
    assert (old / "cache_plan.json").is_file() and not (old / "plan.json").exists()


@pytest.mark.parametrize("fault", ["after_shard:2", "before_rename:3"])
def test_killed_run_resumes_to_identical_shards(built, tiny_verifier_dir, tmp_path, fault):
    source, clean = built
    cache_dir = tmp_path / "resumed"
    proc = run_cli(cache_overrides(tiny_verifier_dir, source, cache_dir), env={"FLEDGE_FAULT": fault}, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not (cache_dir / "manifest.json").exists()
    with pytest.raises(CacheError, match="incomplete"):
        CacheReader(cache_dir)
    run_cli(cache_overrides(tiny_verifier_dir, source, cache_dir))
    assert shard_bytes(cache_dir) == shard_bytes(clean)
    assert not list((cache_dir / "shards").glob("*.tmp-*"))
    CacheReader(cache_dir).verify_all()


def test_kill_minus_nine_at_a_random_moment(built, tiny_verifier_dir, tmp_path):
    source, clean = built
    cache_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "fledge.launch.cli", "cache", *cache_overrides(tiny_verifier_dir, source, cache_dir)]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not list((cache_dir / "shards").glob("*.json")) and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run_cli(cache_overrides(tiny_verifier_dir, source, cache_dir))
    assert shard_bytes(cache_dir) == shard_bytes(clean)


def damaged_copy(clean: Path, tmp_path: Path, k: int = 1) -> tuple[Path, Path, list[int]]:
    """A copy of the clean cache, its k-th shard file and the conversations that shard holds."""
    cache_dir = tmp_path / "damaged"
    shutil.copytree(clean, cache_dir)
    victim = sorted((cache_dir / "shards").glob("shard-*.safetensors"))[k]
    convs = json.loads((cache_dir / "manifest.json").read_text())["shards"][k]["index"]
    return cache_dir, victim, convs


def test_truncated_shard_is_refused_on_read_and_the_fix_rebuilds_it(built, tiny_verifier_dir, tmp_path):
    source, clean = built
    cache_dir, victim, convs = damaged_copy(clean, tmp_path)
    victim.write_bytes(victim.read_bytes()[:-1])
    reader = CacheReader(cache_dir)
    reader[next(i for i in range(len(reader)) if i not in convs)]  # the other shards still serve
    with pytest.raises(CacheError, match=f"{victim.name}: damaged shard: .* bytes, the manifest records") as e:
        reader[convs[0]]
    assert "manifest.json" in e.value.fix and "python -m fledge.data.cache verify" in e.value.fix
    # The fix as it says: drop the manifest and rerun the cache; only the damaged shard is rewritten.
    (cache_dir / "manifest.json").unlink()
    run_stage("cache", cache_overrides(tiny_verifier_dir, source, cache_dir))
    assert shard_bytes(cache_dir) == shard_bytes(clean)


def test_flipped_byte_passes_the_cheap_check_and_not_the_full_one(built, tmp_path, capsys):
    from fledge.data.cache import main

    _, clean = built
    cache_dir, victim, convs = damaged_copy(clean, tmp_path)
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF  # in the last tensor's data; the size and the header are intact
    victim.write_bytes(bytes(data))
    reader = CacheReader(cache_dir)
    assert [len(row["input_ids"]) for row in reader] == reader.lengths()  # reading sees nothing wrong
    with pytest.raises(CacheError, match=f"{victim.name}: damaged shard: sha256"):
        reader.verify_all()
    with pytest.raises(CacheError, match=f"{victim.name}: damaged shard: sha256"):
        CacheReader(cache_dir, verify=True)  # what cache.verify_on_read=true passes
    assert main(["verify", str(cache_dir)]) == 1
    assert victim.name in capsys.readouterr().err
    assert main(["verify", str(clean)]) == 0


def test_header_naming_another_shape_is_refused_on_read(built, tmp_path):
    _, clean = built
    cache_dir, victim, convs = damaged_copy(clean, tmp_path)
    data = victim.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    tokens, width = header["aux"]["shape"]
    assert tokens != width
    header["aux"]["shape"] = [width, tokens]  # as many bytes: safetensors itself would serve it
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    victim.write_bytes(data[:8] + text.ljust(n) + data[8 + n:])
    with pytest.raises(CacheError, match=(rf"{victim.name}: damaged shard: aux is BF16 \[{width}, {tokens}\], "
                                          rf"expected BF16 \[{tokens}, {width}\]")):
        CacheReader(cache_dir)[convs[0]]


def test_reading_hashes_nothing(built, monkeypatch):
    import fledge.data.cache as cache_module

    _, clean = built

    def refuse(path):
        raise AssertionError(f"hashed {path} on read")

    monkeypatch.setattr(cache_module, "sha256_file", refuse)
    reader = CacheReader(clean)
    assert [len(row["input_ids"]) for row in reader] == reader.lengths()
    with pytest.raises(AssertionError, match="hashed"):  # the patch is where the full check hashes
        CacheReader(clean, verify=True)


def test_writer_refuses_a_shard_that_reads_back_other_than_written(tmp_path, monkeypatch):
    import fledge.data.cache as cache_module

    write = cache_module._write_bytes

    def write_then_flip(path, data):
        write(path, data)
        with open(path, "r+b") as fh:
            fh.seek(-1, os.SEEK_END)
            last = fh.read(1)
            fh.seek(-1, os.SEEK_END)
            fh.write(bytes([last[0] ^ 1]))

    monkeypatch.setattr(cache_module, "_write_bytes", write_then_flip)
    (tmp_path / "shards").mkdir()
    rows = [torch.arange(n) for n in (3, 5)]
    with pytest.raises(CacheError, match="shard-00000.safetensors: the shard read back differs from what was written"):
        cache_module.write_shard(tmp_path, 0, [0, 1], rows, [torch.ones(len(r)) for r in rows],
                                 [torch.zeros(len(r), 6) for r in rows], [torch.zeros(len(r), 2) for r in rows])
    assert not list((tmp_path / "shards").iterdir())  # neither the shard, nor its sidecar, nor a temporary
    monkeypatch.setattr(cache_module, "_write_bytes", write)
    record = cache_module.write_shard(tmp_path, 0, [0, 1], rows, [torch.ones(len(r)) for r in rows],
                                      [torch.zeros(len(r), 6) for r in rows], [torch.zeros(len(r), 2) for r in rows])
    assert record["sha256"] == sha256_file(tmp_path / record["file"])


def test_mismatched_verifier_is_refused(built, tmp_path_factory, smollm_tokenizer, tiny_verifier_dir):
    from fledge.data.cache import CacheIdentity

    _, cache_dir = built
    reader = CacheReader(cache_dir)
    other = make_tiny_verifier(tmp_path_factory.mktemp("other"), "llama", smollm_tokenizer, seed=1)
    from fledge.models.verifier import weight_fingerprint

    expect = CacheIdentity(**{**reader.identity.__dict__, "verifier_fingerprint": weight_fingerprint(other)})
    with pytest.raises(CacheError, match="verifier_fingerprint"):
        CacheReader(cache_dir, expect=expect)
    expect = CacheIdentity(**{**reader.identity.__dict__, "aux_layer_ids": [1, 4, 5]})
    with pytest.raises(CacheError, match="aux_layer_ids"):
        CacheReader(cache_dir, expect=expect)
    expect = CacheIdentity(**{**reader.identity.__dict__, "chat_template_hash": "0" * 16})
    with pytest.raises(CacheError, match="chat_template_hash"):
        CacheReader(cache_dir, expect=expect)
    assert reader.identity.verifier_fingerprint == weight_fingerprint(tiny_verifier_dir)


def test_other_inputs_in_the_same_directory_are_refused(built, tiny_verifier_dir, tmp_path_factory, smollm_tokenizer):
    source, clean = built
    other = make_tiny_verifier(tmp_path_factory.mktemp("other2"), "llama", smollm_tokenizer, seed=2)
    with pytest.raises(CacheError, match="identity"):
        run_stage("cache", cache_overrides(other, source, clean))


def test_two_process_torchrun_cache_equals_one_process(built, tiny_verifier_dir, tmp_path):
    source, clean = built
    cache_dir = tmp_path / "torchrun"
    run_cli(cache_overrides(tiny_verifier_dir, source, cache_dir), nproc=2)
    assert shard_bytes(cache_dir) == shard_bytes(clean)
    one = json.loads((clean / "manifest.json").read_text())
    two = json.loads((cache_dir / "manifest.json").read_text())
    assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in two["shards"]]
    two_vocab, one_vocab = (load_file(str(d / "draft_vocab.safetensors")) for d in (cache_dir, clean))
    assert two_vocab.keys() == one_vocab.keys() == {"d2t", "t2d", "counts"}
    for key in one_vocab:
        assert torch.equal(two_vocab[key], one_vocab[key]), key


def test_plan_is_length_sorted_within_budget():
    lengths = [5, 100, 30, 30, 7, 64, 1, 90]
    plan = plan_shards(lengths, bytes_per_token=10, shard_bytes=1500, batch_tokens=200, max_batch_size=3)
    seen = sorted(i for shard in plan.shards for batch in shard for i in batch)
    assert seen == list(range(len(lengths)))
    flat = [i for shard in plan.shards for batch in shard for i in batch]
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)
    for shard in plan.shards:
        for batch in shard:
            assert len(batch) <= 3 and len(batch) * max(lengths[i] for i in batch) <= 200 or len(batch) == 1


def test_bench_cache_times_the_stage_and_its_parts(built, tiny_verifier_dir, tmp_path, capsys):
    """`fledge bench cache` times the stage's own work: the shards its cache run writes and those its parts (the
    capture alone, then the writes alone) write are the `fledge cache` stage's, byte for byte, every round; and each
    figure is what its definition says."""
    source, cache_dir = built
    bench_dir = tmp_path / "bench"
    args = [a for a in cache_overrides(tiny_verifier_dir, source, cache_dir) if not a.startswith("cache.dir=")]
    out = run_stage("bench_cache", args + ["rounds=2", f"keep_dir={bench_dir}"])
    text = capsys.readouterr().out
    for label in ("bare forward", "ratio", "capture alone", "writes alone", "parts ratio"):
        assert label in text
    stage = shard_bytes(cache_dir)
    assert len(stage) > 1
    for folder in ("round-0", "round-1", "parts-0", "parts-1"):
        assert shard_bytes(bench_dir / folder) == stage, folder
    rounds = out["rounds"]
    assert all(len(rounds[k]) == 2 for k in ("bare_s", "cache_s", "capture_s", "write_s"))
    bare = min(rounds["bare_s"])
    assert out["ratio"] == pytest.approx(bare / min(rounds["cache_s"]), rel=1e-12)
    assert out["capture_over_bare"] == pytest.approx(min(rounds["capture_s"]) / bare - 1, rel=1e-12)
    assert out["writes_over_bare"] == pytest.approx(min(rounds["write_s"]) / bare, rel=1e-12)
    assert out["parts_ratio"] == pytest.approx(bare / (min(rounds["capture_s"]) + min(rounds["write_s"])), rel=1e-12)
    reader = CacheReader(cache_dir)
    assert out["tokens"] == sum(len(reader[i]["input_ids"]) for i in range(len(reader)))

    without = run_stage("bench_cache", args + ["rounds=1", "parts=false"])
    assert "parts_ratio" not in without and "capture_s" not in without["rounds"]
    with pytest.raises(ConfigError, match="rounds must be >= 1"):
        run_stage("bench_cache", args + ["rounds=0"])
