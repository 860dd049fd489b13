"""Data mixtures (``data.sources``) and the standard library's code source (``python-code``): shares, splits that do
not overlap, duplicate prompts across sources, short sources, bad input refused before any work."""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import pytest

from fledge.core.errors import ConfigError
from fledge.data.code_source import python_code_records
from fledge.data.mixture import apportion, interleave, prompt_key
from fledge.data.sources import DataConfig, DataError, load_conversations
from fledge.launch.cli import compose_config


def _write(path: Path, prompts: list[str]) -> str:
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"messages": [{"role": "user", "content": p},
                                             {"role": "assistant", "content": f"answer to {p}"}]}) + "\n")
    return str(path)


@pytest.fixture
def two_sources(tmp_path):
    chat = _write(tmp_path / "chat.jsonl", [f"chat {i}" for i in range(40)])
    code = _write(tmp_path / "code.jsonl", [f"code {i}" for i in range(40)])
    return chat, code


def _prompts(conversations) -> list[str]:
    return [c[0]["content"] for c in conversations]


def test_apportion_sums_to_the_total_by_largest_remainders():
    assert apportion(10, {"a": 3, "b": 1}) == {"a": 8, "b": 2}  # 7.5 / 2.5: the tie goes to the earlier source
    assert apportion(7, {"a": 1, "b": 1, "c": 1}) == {"a": 3, "b": 2, "c": 2}
    for total in range(0, 50):
        parts = apportion(total, {"a": 0.7, "b": 0.2, "c": 0.1})
        assert sum(parts.values()) == total
        assert all(abs(parts[n] - total * w) < 1 for n, w in {"a": 0.7, "b": 0.2, "c": 0.1}.items())
    order = interleave({"a": 3, "b": 1})
    assert order == [("a", 0), ("a", 1), ("b", 0), ("a", 2)]


def test_a_mixture_takes_each_source_by_its_weight_interleaved(two_sources):
    chat, code = two_sources
    conversations, report = load_conversations(DataConfig(sources={chat: 3, code: 1}, max_conversations=8))
    prompts = _prompts(conversations)
    assert prompts == ["chat 0", "chat 1", "code 0", "chat 2", "chat 3", "chat 4", "code 1", "chat 5"]
    assert report.kept == 8 and report.read == 6 + 2  # reading stops at each source's share
    assert report.per_source[chat]["kept"] == 6 and report.per_source[code]["kept"] == 2
    assert report.per_source[code]["share"] == pytest.approx(0.25)
    assert report.source == f"{chat}:3+{code}:1" and "by source" in report.summary()
    # A weight of 0 leaves a source out, unread.
    only, report = load_conversations(DataConfig(sources={chat: 1, code: 0}, max_conversations=3))
    assert _prompts(only) == ["chat 0", "chat 1", "chat 2"] and list(report.per_source) == [chat]


def test_offset_continues_every_source_where_the_training_slice_ended(two_sources):
    chat, code = two_sources
    weights = {chat: 0.7, code: 0.3}
    for size in (1, 7, 10, 13):
        train, _ = load_conversations(DataConfig(sources=weights, max_conversations=size))
        held, _ = load_conversations(DataConfig(sources=weights, max_conversations=9, offset=size))
        assert len(train) == size and len(held) == 9
        assert not set(_prompts(train)) & set(_prompts(held))
    # 10 = 7 + 3: the next slice starts at chat 7 and code 3.
    second, _ = load_conversations(DataConfig(sources=weights, max_conversations=10, offset=10))
    assert _prompts(second)[:2] == ["chat 7", "code 3"]


def test_a_prompt_taken_from_an_earlier_source_is_skipped_and_counted(tmp_path):
    human = _write(tmp_path / "human.jsonl", ["What is 2+2?", "hello there", "Name a colour"])
    # The verifier's answers to partly the same prompts (case and spacing differ), then new ones.
    own = _write(tmp_path / "own.jsonl", ["what is  2+2?", "HELLO there", "a new one", "another", "third"])
    conversations, report = load_conversations(DataConfig(sources={human: 1, own: 1}, max_conversations=6))
    prompts = _prompts(conversations)
    assert sorted(prompts) == sorted(["What is 2+2?", "hello there", "Name a colour", "a new one", "another", "third"])
    assert report.per_source[own]["duplicates"] == 2 and report.per_source[human]["duplicates"] == 0
    assert len({prompt_key(c) for c in conversations}) == 6
    assert "2 duplicate prompts skipped" in report.summary()


def test_the_slice_after_a_training_slice_shares_no_prompt_even_when_sources_overlap(tmp_path):
    # A human source and the verifier's answers to much the same prompts (as sharegpt and sharegpt-smollm2): the
    # second source's training slice passed over the duplicates, so its offset must too.
    human = _write(tmp_path / "human.jsonl", [f"prompt {i}" for i in range(40)])
    own = _write(tmp_path / "own.jsonl", [f"prompt {i}" if i % 2 else f"own {i}" for i in range(60)])
    weights = {human: 1, own: 1}
    for size in (2, 6, 10, 15):
        train, _ = load_conversations(DataConfig(sources=weights, max_conversations=size))
        held, _ = load_conversations(DataConfig(sources=weights, max_conversations=10, offset=size))
        assert len(train) == size and len(held) == 10
        assert not {prompt_key(c) for c in train} & {prompt_key(c) for c in held}, size
        # Nothing between the two slices is lost either: the held-out slice starts, in each source, at its first
        # prompt after the training slice that the training slice did not hold.
        trained = set(_prompts(train))
        for name in (human, own):
            lines = [json.loads(line)["messages"][0]["content"] for line in Path(name).read_text().splitlines()]
            last = max(i for i, p in enumerate(lines) if p in trained)
            first = next(p for p in lines[last + 1:] if p not in trained)
            assert first in _prompts(held), (size, name)


def test_a_short_source_shrinks_the_mixture_so_that_the_weights_hold(tmp_path, caplog):
    big = _write(tmp_path / "big.jsonl", [f"big {i}" for i in range(30)])
    small = _write(tmp_path / "small.jsonl", [f"small {i}" for i in range(3)])
    with caplog.at_level(logging.WARNING):
        conversations, report = load_conversations(DataConfig(sources={big: 1, small: 1}, max_conversations=20))
    # The largest mixture the small source can fill at 1:1 is 7 (3.5 each, the tie to the earlier source).
    assert report.per_source[big]["kept"] == 4 and report.per_source[small]["kept"] == 3 and len(conversations) == 7
    assert "small.jsonl (3 conversations) cannot fill its share of 20 conversations; the mixture takes 7" in caplog.text
    # No size given: the largest mixture the sources can fill at these weights.
    everything, report = load_conversations(DataConfig(sources={big: 2, small: 1}))
    assert (report.per_source[big]["kept"], report.per_source[small]["kept"]) == (7, 3)  # 10 at 2:1; 11 needs 4


@pytest.mark.parametrize("sources, message", [
    ({"sharegpt": -0.5, "python-code": 1}, r"the weight of 'sharegpt' is -0\.5; weights must be finite and >= 0"),
    ({"sharegpt": 0, "python-code": 0.0}, r"data\.sources weights sum to zero"),
    ({"sharegpt": "lots"}, r"the weight of 'sharegpt' is 'lots', not a number"),
    ({"sharegpt": float("nan")}, r"the weight of 'sharegpt' is nan"),
    ({}, r"data\.sources is empty"),
    (["sharegpt"], r"data\.sources must map each source to its weight"),
])
def test_bad_weights_are_refused_naming_the_source(sources, message):
    with pytest.raises(ConfigError, match=message):
        DataConfig(sources=sources)


def test_a_source_that_yields_nothing_is_refused_by_name(tmp_path, two_sources):
    chat, _ = two_sources
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=r"empty\.jsonl: no records \(the file is empty\)"):
        load_conversations(DataConfig(sources={chat: 1, str(empty): 1}, max_conversations=4))
    # Even when its share of a tiny mixture is 0.
    with pytest.raises(DataError, match="empty.jsonl"):
        load_conversations(DataConfig(sources={chat: 5, str(empty): 1}, max_conversations=1))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"messages": [{"role": "assistant", "content": "no user"}]}) + "\n")
    with pytest.raises(DataError, match="broken.jsonl.*none of the 1 records is a usable conversation"):
        load_conversations(DataConfig(sources={chat: 1, str(broken): 1}, max_conversations=4))
    # Everything taken by an earlier source counts as nothing.
    with pytest.raises(DataError, match=r"'.*copy\.jsonl' yields no conversation.*prompts taken from an earlier"):
        copy = _write(tmp_path / "copy.jsonl", ["chat 0"])
        load_conversations(DataConfig(sources={chat: 1, copy: 1}, max_conversations=4))


def test_the_cache_refuses_an_empty_source_before_the_verifier_loads(tmp_path, two_sources):
    from fledge.data.cache_job import CacheJobConfig, prepare
    from fledge.models.verifier import VerifierConfig
    from fledge.core.dist import DistInfo

    chat, _ = two_sources
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = CacheJobConfig(verifier=VerifierConfig(name_or_path=str(tmp_path / "no-such-verifier")),
                         data=DataConfig(sources={chat: 1, str(empty): 1}, max_conversations=4))
    with pytest.raises(DataError, match="empty.jsonl"):  # not the missing verifier
        prepare(cfg, DistInfo(rank=0, world_size=1, local_rank=0), "cpu")


def test_mixtures_compose_from_the_command_line():
    cfg = compose_config("cache", ["data.sources={sharegpt: 0.8, python-code: 0.2}"])
    assert cfg.data.sources == {"sharegpt": 0.8, "python-code": 0.2}
    assert cfg.data.source_names() == ["sharegpt", "python-code"]
    train = compose_config("train", ["data.sources={sharegpt: 1, python-code: 1}"])
    assert train.data.source_config().sources == {"sharegpt": 1.0, "python-code": 1.0}
    with pytest.raises(Exception, match="weight of 'sharegpt'"):
        compose_config("cache", ["data.sources={sharegpt: -1}"])
    assert compose_config("cache").data.sources is None


def test_python_code_is_the_standard_librarys_documented_functions():
    records = list(python_code_records())
    assert len(records) > 1000
    ids = [r["id"] for r in records]
    assert len(set(ids)) == len(ids)
    for record in records[:200]:
        user, answer = (m["content"] for m in record["messages"])
        module, qualname = record["id"].split(":")
        assert f"`{module}`" in user and qualname.rsplit(".", 1)[-1] in user
        assert answer.startswith("```python\n") and answer.endswith("\n```")
        tree = ast.parse(answer[len("```python\n"):-len("\n```")])
        assert isinstance(tree.body[0], ast.FunctionDef | ast.AsyncFunctionDef)
        assert not module.split(".")[0].startswith("test")
    assert ids[:50] == [r["id"] for r in list(python_code_records())[:50]]  # a fixed order
    assert len({i.split(":")[0].split(".")[0] for i in ids[:100]}) > 20  # ... that mixes modules
    conversations, report = load_conversations(DataConfig(source="python-code", max_conversations=5))
    assert len(conversations) == 5 and report.kept == 5
    assert [c[0]["role"] for c in conversations] == ["user"] * 5


def test_a_mixture_cache_records_each_source_and_counts_the_vocabulary_over_all(tiny_verifier_dir, tmp_path,
                                                                                 two_sources):
    from fledge.data.vocab import load_token_counts
    from fledge.launch.cli import run_stage
    from fledge.models.verifier import VerifierConfig, load_tokenizer

    chat, code = two_sources
    cache = tmp_path / "cache"
    run_stage("cache", [f"verifier.name_or_path={tiny_verifier_dir}", "verifier.dtype=float32",
                        f"data.sources={{{chat}: 3, {code}: 1}}", "data.max_conversations=8",
                        f"cache.dir={cache}", "cache.draft_vocab_size=64", "cache.device=cpu"])
    manifest = json.loads((cache / "manifest.json").read_text())
    per_source = manifest["source"]["report"]["per_source"]
    assert (per_source[chat]["kept"], per_source[code]["kept"]) == (6, 2) and manifest["num_conversations"] == 8
    # The draft vocabulary is counted over every source's answers: the code answers' own word is counted.
    tokenizer = load_tokenizer(VerifierConfig(name_or_path=str(tiny_verifier_dir)))
    counts = load_token_counts(cache / "draft_vocab.safetensors")
    assert all(counts[t] > 0 for t in tokenizer(" code", add_special_tokens=False)["input_ids"])
