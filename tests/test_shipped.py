"""The shipped training data (``data.source=sharegpt-smollm2``): it loads, a damaged or missing file is named with its
rebuild command, slices of a regenerate plan, and a slice of the shipped file regenerated with its own command."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from fledge.core.errors import ConfigError
from fledge.data import shipped, sources
from fledge.data.sources import DataConfig, DataError, load_conversations
from fledge.launch.cli import run_stage

from conftest import write_sharegpt_jsonl


def test_the_shipped_file_matches_its_manifest_and_loads_as_a_source():
    manifest = json.loads((sources.SHIPPED_DIR / shipped.MANIFEST_FILE).read_text())
    records = shipped.read_records(shipped.shipped_path())
    assert len(records) == manifest["conversations"] >= 500
    assert manifest["regenerate_overrides"] == shipped.REGENERATE_OVERRIDES
    assert manifest["command"] == shipped.BUILD_COMMAND
    assert all(r["finish"][0] in ("stop", "length") for r in records)
    convs, report = load_conversations(DataConfig(source=shipped.SOURCE, max_conversations=20))
    assert len(convs) == 20 and report.kept == 20
    assert all([m["role"] for m in c] == ["user", "assistant"] for c in convs)
    # the answers are the verifier's own, not ShareGPT's: the same prompts, other answers
    originals, _ = load_conversations(DataConfig(source="sharegpt", max_conversations=1000, require_assistant=False))
    first = records[0]
    assert first["messages"][0]["content"] == originals[first["id"]][0]["content"]
    ours = {r["id"]: r["messages"][1]["content"] for r in records[:50]}
    theirs = {i: originals[i][1]["content"] for i in ours if len(originals[i]) > 1}
    assert sum(ours[i] == theirs[i] for i in theirs) <= 1


def test_the_cache_warns_when_the_shipped_answers_are_another_verifiers(caplog):
    own = json.loads((sources.SHIPPED_DIR / shipped.MANIFEST_FILE).read_text())["verifier_fingerprint"]
    assert not shipped.warn_if_other_verifier(own)
    with caplog.at_level("WARNING"):
        assert shipped.warn_if_other_verifier("0" * 64)
    assert "another model's text" in caplog.text


def test_missing_or_damaged_shipped_data_is_named_with_the_command_that_rebuilds_it(tmp_path, monkeypatch):
    copy = tmp_path / "shipped"
    original = sources.SHIPPED_DIR
    shutil.copytree(original, copy)
    monkeypatch.setattr(sources, "SHIPPED_DIR", copy)
    assert shipped.shipped_path() == copy / shipped.DATA_FILE

    data = bytearray((copy / shipped.DATA_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / shipped.DATA_FILE).write_bytes(bytes(data))
    with pytest.raises(DataError, match="damaged") as err:
        load_conversations(DataConfig(source=shipped.SOURCE, max_conversations=5))
    assert shipped.BUILD_COMMAND in err.value.fix and "fledge regenerate" in err.value.fix

    (copy / shipped.DATA_FILE).unlink()
    with pytest.raises(DataError, match="missing") as err:
        load_conversations(DataConfig(source=shipped.SOURCE))
    assert shipped.BUILD_COMMAND in err.value.fix

    shutil.copy(original / shipped.DATA_FILE, copy / shipped.DATA_FILE)
    (copy / shipped.MANIFEST_FILE).write_text("{")
    with pytest.raises(DataError, match="manifest is damaged"):
        shipped.shipped_path()


def test_a_cut_gzip_source_is_a_named_error(tmp_path):
    path = tmp_path / "convs.jsonl.gz"
    full = gzip.compress(write_sharegpt_jsonl(tmp_path / "c.jsonl", 30, seed=1).read_bytes())
    path.write_bytes(full)
    convs, _ = load_conversations(DataConfig(source=str(path)))
    assert len(convs) == 30
    path.write_bytes(full[: len(full) // 2])
    with pytest.raises(DataError, match="not a complete gzip file"):
        load_conversations(DataConfig(source=str(path)))


@pytest.mark.usefixtures("one_thread")
def test_a_slice_of_parts_cut_short_is_the_beginning_of_the_full_answers(tmp_path, tiny_verifier_dir):
    """What ``shipped check`` relies on, with a tiny verifier: part p of a plan regenerated with fewer tokens gives
    the first tokens of the full run's answers in part p, and only that part's conversations."""
    source = write_sharegpt_jsonl(tmp_path / "convs.jsonl", 12, seed=5, max_words=20)
    common = [f"verifier.name_or_path={tiny_verifier_dir}", "verifier.dtype=float32", f"data.source={source}",
              "data.max_length=200", "regenerate.turns=first", "regenerate.batch_size=4", "regenerate.device=cpu"]
    full = run_stage("regenerate", [*common, "regenerate.max_new_tokens=24", f"regenerate.out_dir={tmp_path / 'full'}"])
    packed = shipped.pack(tmp_path / "full", tmp_path / "ship")
    by_id = {r["id"]: r for r in shipped.read_records(packed)}
    assert len(by_id) == len(full.read_text().splitlines()) == 12
    assert packed.read_bytes() == shipped.pack(tmp_path / "full", tmp_path / "ship2").read_bytes()  # reproducible

    part = run_stage("regenerate", [*common, "regenerate.max_new_tokens=6", "regenerate.parts=[1]",
                                    f"regenerate.out_dir={tmp_path / 'slice'}"])
    rows = [json.loads(line) for line in part.read_text().splitlines()]
    assert len(rows) == 4
    assert json.loads((tmp_path / "slice" / "manifest.json").read_text())["options"]["parts"] == [1]
    assert shipped.compare_slice(rows, by_id) == []
    assert any(len(r["messages"][1]["content"]) < len(by_id[r["id"]]["messages"][1]["content"]) for r in rows)
    # the comparison can fail: another answer, or a conversation the shipped file lacks
    changed = json.loads(json.dumps(rows))
    changed[0]["messages"][1]["content"] = "something else " + changed[0]["messages"][1]["content"]
    assert len(shipped.compare_slice(changed, by_id)) == 1
    assert "absent" in shipped.compare_slice(rows, {})[0]

    with pytest.raises(ConfigError, match=r"parts 0\.\.2"):
        run_stage("regenerate", [*common, "regenerate.parts=[3]", f"regenerate.out_dir={tmp_path / 'bad'}"])
    assert not (tmp_path / "bad").exists()  # refused before the folder is claimed
    with pytest.raises(ConfigError, match="regenerate.parts"):
        run_stage("regenerate", [*common, "regenerate.parts=[]", f"regenerate.out_dir={tmp_path / 'bad'}"])


@pytest.mark.slow
def test_a_slice_of_the_shipped_file_regenerates_identically_with_its_command():
    """The default verifier answers part 0 of the shipped command's plan (its 32 shortest prompts) again, 16 tokens
    each: the same text as the shipped answers."""
    n, problems = shipped.check(parts=[0])
    assert n >= 20
    assert problems == []


def test_the_shipped_command_is_documented_where_users_look():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert shipped.BUILD_COMMAND in readme and shipped.regenerate_command() in readme
