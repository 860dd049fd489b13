"""``fledge regenerate``: batched answers equal one-at-a-time greedy decoding, stop tokens, limits, resume, refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fledge.data.regenerate import RegenerateError, RegenerateOptions, answer_batch
from fledge.data.sources import DataConfig, load_conversations
from fledge.launch.cli import run_stage
from fledge.models.verifier import VerifierConfig, load_verifier

from conftest import write_sharegpt_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def verifier(tiny_verifier_dir):
    return load_verifier(VerifierConfig(name_or_path=str(tiny_verifier_dir), dtype="float32"))


def greedy_reference(model, context: list[int], steps: int) -> list[int]:
    """Greedy decoding of one sequence by full forwards, no cache, no padding."""
    ids = list(context)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(context) :]


def test_batched_left_padded_generation_equals_greedy_one_at_a_time(verifier):
    g = torch.Generator().manual_seed(0)
    contexts = [torch.randint(10, 4000, (n,), generator=g).tolist() for n in (5, 17, 9)]
    limits = [12, 12, 7]
    out = answer_batch(verifier, contexts, limits, RegenerateOptions(), stop_ids=[0])
    for ctx, lim, (toks, stopped) in zip(contexts, limits, out):
        assert toks == greedy_reference(verifier.model, ctx, lim)
        assert not stopped


def test_a_stop_token_ends_the_answer_without_itself(verifier):
    ctx = [11, 250, 3000, 42, 7]
    ref = greedy_reference(verifier.model, ctx, 10)
    stop = ref[4]
    first = ref.index(stop)
    (toks, stopped), (other, other_stopped) = answer_batch(
        verifier, [ctx, [5, 6, 7, 8, 9, 10]], [10, 10], RegenerateOptions(), stop_ids=[stop]
    )
    assert stopped and toks == ref[:first]
    # the other row keeps going after the first one stopped, to its own stop or limit
    ref2 = greedy_reference(verifier.model, [5, 6, 7, 8, 9, 10], 10)
    expected = ref2[: ref2.index(stop)] if stop in ref2 else ref2
    assert (other, other_stopped) == (expected, stop in ref2)


def test_sampling_is_seeded(verifier):
    opts = RegenerateOptions(temperature=1.0, top_p=0.9)
    ctxs = [[11, 250, 3000], [42, 7, 9, 1000]]

    def draw(seed: int):
        return answer_batch(verifier, ctxs, [8, 8], opts, [0], torch.Generator().manual_seed(seed))

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_top_p_keeps_only_the_nucleus(verifier):
    """With a tiny top_p only the most likely token survives: sampling then equals greedy."""
    ctx = [[11, 250, 3000, 42]]
    greedy = answer_batch(verifier, ctx, [6], RegenerateOptions(), [0])
    nucleus = answer_batch(verifier, ctx, [6], RegenerateOptions(temperature=1.0, top_p=1e-6), [0], torch.Generator())
    assert nucleus == greedy


def regen_overrides(verifier_dir: Path, source: Path, out_dir: Path, **extra: object) -> list[str]:
    args = {
        "verifier.name_or_path": verifier_dir,
        "verifier.dtype": "float32",
        "data.source": source,
        "data.max_conversations": 10,
        "data.max_length": 160,
        "regenerate.out_dir": out_dir,
        "regenerate.batch_size": 4,
        "regenerate.max_new_tokens": 12,
        "regenerate.device": "cpu",
    }
    args.update(extra)
    return [f"{k}={v}" for k, v in args.items()]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_sharegpt_jsonl(tmp_path_factory.mktemp("regen") / "convs.jsonl", 12, seed=3, max_words=25)


def test_regenerate_answers_every_turn_with_the_verifier(tmp_path, tiny_verifier_dir, source, verifier):
    out = run_stage("regenerate", regen_overrides(tiny_verifier_dir, source, tmp_path / "regen"))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    originals, _ = load_conversations(DataConfig(source=str(source), max_conversations=10, require_assistant=False))
    assert [r["id"] for r in rows] == sorted(r["id"] for r in rows)
    assert len(rows) == 10
    tok = verifier.tokenizer
    for row in rows:
        original = originals[row["id"]]
        users = [m["content"] for m in row["messages"] if m["role"] == "user"]
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert users == [m["content"] for m in original if m["role"] == "user"][: len(users)]
        assert len(answers) == len(users) == len(row["finish"]) - row["finish"].count("prompt too long")
        # the first answer is the verifier's greedy continuation of the chat-templated question
        prompt = tok.apply_chat_template([row["messages"][0]], tokenize=False, add_generation_prompt=True)
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        ref = greedy_reference(verifier.model, ids, min(12, 160 - len(ids)))
        assert answers[0] == tok.decode(ref, skip_special_tokens=True).strip()
        assert row["messages"][1]["content"] != original[1]["content"]
    manifest = json.loads((tmp_path / "regen" / "manifest.json").read_text())
    assert manifest["conversations_written"] == 10
    assert manifest["answers"] == sum(len(r["finish"]) for r in rows) - manifest["finish"].get("prompt too long", 0)

    # the output is an ordinary source for the cache
    cache_dir = tmp_path / "cache"
    run_stage("cache", [f"verifier.name_or_path={tiny_verifier_dir}", "verifier.dtype=float32", f"data.source={out}",
                        "data.max_length=160", f"cache.dir={cache_dir}", "cache.draft_vocab_size=64", "cache.device=cpu"])
    manifest = json.loads((cache_dir / "manifest.json").read_text())
    assert manifest["num_conversations"] == 10 and manifest["num_loss_tokens"] > 0

    # a rerun does nothing; other inputs in the same folder are refused, or replace it on request. The folder here is
    # one of fledge before regenerate_plan.json had its name: its plan.json is read the same way.
    before = out.stat().st_mtime_ns
    (tmp_path / "regen" / "regenerate_plan.json").rename(tmp_path / "regen" / "plan.json")
    run_stage("regenerate", regen_overrides(tiny_verifier_dir, source, tmp_path / "regen"))
    assert out.stat().st_mtime_ns == before
    with pytest.raises(RegenerateError, match="options"):
        run_stage("regenerate", regen_overrides(tiny_verifier_dir, source, tmp_path / "regen", **{"regenerate.max_new_tokens": 5}))
    run_stage("regenerate", regen_overrides(tiny_verifier_dir, source, tmp_path / "regen",
                                            **{"regenerate.max_new_tokens": 5, "regenerate.overwrite": "true"}))
    assert json.loads((tmp_path / "regen" / "manifest.json").read_text())["options"]["max_new_tokens"] == 5
    assert (tmp_path / "regen" / "regenerate_plan.json").is_file() and not (tmp_path / "regen" / "plan.json").exists()


def test_a_source_that_yields_nothing_is_refused_before_the_verifier_loads(tmp_path, tiny_verifier_dir, source,
                                                                          monkeypatch):
    from fledge.data.sources import DataError

    def loaded(*args, **kwargs):
        raise AssertionError("the verifier was loaded before the data was read")

    monkeypatch.setattr("fledge.data.regenerate.load_verifier", loaded)
    missing = tmp_path / "none.jsonl"
    with pytest.raises(DataError, match="none.jsonl"):
        run_stage("regenerate", regen_overrides(tiny_verifier_dir, source, tmp_path / "out",
                                                **{"data.sources": f"{{{source}: 1, {missing}: 1}}"}))
    assert not (tmp_path / "out").exists()


def test_answers_never_pass_max_length_and_first_turn_only(tmp_path, tiny_verifier_dir, source, verifier):
    out = run_stage("regenerate", regen_overrides(tiny_verifier_dir, source, tmp_path / "r", **{
        "data.max_length": 48, "regenerate.max_new_tokens": 40, "regenerate.turns": "first"}))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    tok = verifier.tokenizer
    for row in rows:
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
        prompt = tok.apply_chat_template(row["messages"][:1], tokenize=False, add_generation_prompt=True)
        budget = 48 - len(tok(prompt, add_special_tokens=False)["input_ids"])
        assert row["finish"] == ["length"]  # a random model never says <|im_end|> within 40 tokens
        assert budget < 40 and len(tok(row["messages"][1]["content"], add_special_tokens=False)["input_ids"]) <= budget + 2
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert manifest["conversations_without_answer"] + manifest["conversations_written"] == 10


def run_cli(overrides: list[str], env: dict[str, str] | None = None, nproc: int = 1):
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port=29541"]
    cmd = [sys.executable, *launcher, "-m", "fledge.launch.cli", "regenerate", *overrides]
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_answers_and_torchrun_matches(tmp_path, tiny_verifier_dir, source):
    sampled = {"regenerate.temperature": 1.0, "regenerate.top_p": 0.95}
    ref = run_stage("regenerate", regen_overrides(tiny_verifier_dir, source, tmp_path / "ref", **sampled))

    args = regen_overrides(tiny_verifier_dir, source, tmp_path / "killed", **sampled)
    proc = run_cli(args, env={"FLEDGE_FAULT": "regenerate_after_part_1"})
    assert proc.returncode == 137, proc.stderr[-2000:]
    parts = sorted(p.name for p in (tmp_path / "killed" / "parts").iterdir())
    assert parts == ["part-00000.jsonl", "part-00001.jsonl"]
    assert not (tmp_path / "killed" / "conversations.jsonl").exists()
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 of 3 parts already generated" in proc.stdout + proc.stderr
    assert (tmp_path / "killed" / "conversations.jsonl").read_bytes() == ref.read_bytes()

    proc = run_cli(regen_overrides(tiny_verifier_dir, source, tmp_path / "two", **sampled), nproc=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "two" / "conversations.jsonl").read_bytes() == ref.read_bytes()
