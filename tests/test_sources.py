"""Conversation sources: ShareGPT recovery, normalisation, JSON / JSONL / datasets files, MT-bench prompts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from fledge.data.json_stream import DataError, JsonArrayStream
from fledge.data.prompt_sets import load_prompts
from fledge.data.sources import (
    DataConfig,
    LoadReport,
    load_conversations,
    normalise_record,
    sharegpt_path,
)

SHAREGPT_RECORDS = 17_671  # complete records before the cut in the wheel's file (docs/design.md; verified here)


def recover_json_array(path):
    """(every complete element of the JSON array in ``path``, whether the file was cut off before it closed)."""
    stream = JsonArrayStream(path, progress=False)
    return list(stream), stream.truncated


def sharegpt(*turns: tuple[str, str], **extra) -> dict:
    return {"conversations": [{"from": r, "value": v} for r, v in turns], **extra}


def openai(*turns: tuple[str, str]) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def assert_well_formed(conversation: list[dict]) -> None:
    roles = [m["role"] for m in conversation]
    body = roles[1:] if roles[0] == "system" else roles
    assert body[0] == "user", roles
    assert all(a != b for a, b in zip(body, body[1:])), f"roles do not alternate: {roles}"
    assert "system" not in body
    assert all(isinstance(m["content"], str) and m["content"].strip() for m in conversation)


# ---------------------------------------------------------------------------------------------------------------
# The embedded ShareGPT file


def test_sharegpt_loads_every_complete_record_quickly():
    assert sharegpt_path().name == "ShareGPT_V3_unfiltered_cleaned_split.json"
    start = time.perf_counter()
    conversations, report = load_conversations(DataConfig(source="sharegpt"))
    seconds = time.perf_counter() - start
    assert report.read == SHAREGPT_RECORDS
    assert report.recovered_from_truncation
    assert report.kept == len(conversations) == SHAREGPT_RECORDS - sum(report.skipped.values())
    assert report.kept > 17_000
    # the file's own oddities are named, not silent
    assert report.skipped["empty conversation"] > 0 and report.skipped["empty content"] > 0
    assert report.fixed["dropped leading assistant turn"] > 1000
    assert seconds < 30, f"loading ShareGPT took {seconds:.1f} s"
    for conv in conversations[::97]:
        assert_well_formed(conv)
        assert conv[-1]["role"] == "assistant"
    assert "17,671" in report.summary() and "cut off" in report.summary()


def test_sharegpt_slice_stops_reading_early_and_offset_gives_disjoint_splits():
    train, rep_train = load_conversations(DataConfig(max_conversations=40))
    held, rep_held = load_conversations(DataConfig(max_conversations=10, offset=40))
    both, _ = load_conversations(DataConfig(max_conversations=50))
    assert len(train) == 40 and len(held) == 10
    assert both == train + held
    assert rep_held.before_offset == 40
    assert rep_train.read < 100 and not rep_train.recovered_from_truncation
    assert load_conversations(DataConfig(max_conversations=0))[0] == []


# ---------------------------------------------------------------------------------------------------------------
# Streaming a JSON array


def _element_ends(text: str) -> list[int]:
    """Character offset just past each element of a JSON array text."""
    decoder, ends, pos = json.JSONDecoder(), [], text.index("[") + 1
    while True:
        while text[pos] in " \n,":
            pos += 1
        if text[pos] == "]":
            return ends
        _, pos = decoder.raw_decode(text, pos)
        ends.append(pos)


def test_recover_json_array_at_every_cut_point(tmp_path):
    records = [{"id": i, "text": "héllo → wörld " * i, "n": [1.5, -2, True, None]} for i in range(4)]
    records += ["a string", 12345, {"last": "é"}]
    text = json.dumps(records, ensure_ascii=False, indent=1)
    ends = _element_ends(text)
    f = tmp_path / "a.json"
    f.write_text(text)
    # A tiny window makes records and multi-byte characters straddle chunk edges.
    stream = JsonArrayStream(f, chunk_bytes=5, progress=False)
    assert list(stream) == records and not stream.truncated
    for cut in range(1, len(text) - 1):
        f.write_text(text[:cut])
        stream = JsonArrayStream(f, chunk_bytes=7, progress=False)
        got = list(stream)
        # complete = closed before the cut; a bare number needs the delimiter after it too ("123" may be "12345")
        expected = [r for r, end in zip(records, ends) if end < cut or (end == cut and not isinstance(r, int))]
        assert got == expected, cut
        assert stream.truncated, cut
    f.write_text(text[: ends[-1] - 3])
    got, truncated = recover_json_array(f)
    assert got == records[:-1] and truncated


def test_json_array_damage_and_wrong_format_are_named_errors(tmp_path):
    damaged = tmp_path / "damaged.json"
    text = '[{"a": 1}, {"a": 2,, "b": 3}, {"a": 4}]'
    damaged.write_text(text)
    with pytest.raises(DataError, match=rf"damaged.json character {text.index(',,') + 1}: not JSON"):
        recover_json_array(damaged)
    with pytest.raises(DataError, match=rf"character {text.index(',,') + 1}: not JSON"):
        list(JsonArrayStream(damaged, chunk_bytes=4, progress=False))  # found the same way through a small window
    no_comma = tmp_path / "nocomma.json"
    no_comma.write_text('[{"a": 1} {"a": 2}]')
    with pytest.raises(DataError, match="expected ',' or ']'"):
        recover_json_array(no_comma)
    obj = tmp_path / "obj.json"
    obj.write_text('{"conversations": []}\n')
    with pytest.raises(DataError, match=r"obj.json: expected a JSON array.*\.jsonl"):
        load_conversations(DataConfig(source=str(obj)))
    empty = tmp_path / "empty.json"
    empty.write_text("  \n")
    with pytest.raises(DataError, match="empty file"):
        recover_json_array(empty)
    with pytest.raises(DataError, match="no such file"):
        load_conversations(DataConfig(source=str(tmp_path / "missing.jsonl")))
    with pytest.raises(DataError, match="not 'sharegpt'"):
        load_conversations(DataConfig(source="nonsense"))
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes('[{"a": "caf\xe9"}]'.encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        recover_json_array(latin1)


# ---------------------------------------------------------------------------------------------------------------
# Normalising records


@pytest.mark.parametrize(
    "record, reason",
    [
        (["not", "a", "dict"], "not a dict"),
        ({"text": "hello"}, "no conversations/messages field"),
        ({"conversations": "hi"}, "conversation not a list"),
        ({"conversations": []}, "empty conversation"),
        ({"conversations": ["hi"]}, "turn not a dict"),
        ({"conversations": [{"value": "hi"}]}, "turn without a role"),
        (sharegpt(("human", "hi"), ("wizard", "hello")), "unknown role 'wizard'"),
        (sharegpt(("human", "hi"), ("gpt", "  ")), "empty content"),
        ({"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "x"}]}, "content not a string"),
        (openai(("user", "hi"), ("system", "late"), ("assistant", "x")), "system turn after the start"),
        (sharegpt(("human", "a question"),), "no assistant turn"),
        (sharegpt(("gpt", "an orphan answer"),), "no user turn"),
    ],
)
def test_bad_records_are_skipped_with_a_named_reason(record, reason):
    conv, why, _ = normalise_record(record)
    assert conv is None and why == reason


def test_roles_are_normalised_and_repairs_counted():
    conv, _, repairs = normalise_record(
        sharegpt(("system", "Be kind."), ("gpt", "orphan"), ("human", "q1"), ("chatgpt", "a1"), ("bing", "a1b"),
                 ("user", "q2"), ("bard", "a2"), ("HUMAN", "q3"), ("model", "a3"), ("human", "unanswered"))
    )
    assert conv == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1\n\na1b"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "q3"},
        {"role": "assistant", "content": "a3"},
    ]
    assert set(repairs) == {"dropped leading assistant turn", "merged consecutive turns",
                            "dropped unanswered final user turn"}
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": "c"}]}
    assert normalise_record(parts)[0][0] == {"role": "user", "content": "ab"}
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                          {"role": "assistant", "content": "c"}]}
    assert normalise_record(image)[1] == "content not a string"


def test_prompt_only_records_keep_their_user_turns_apart():
    record = openai(("user", "first"), ("user", "second"))
    assert normalise_record(record)[1] == "no assistant turn"
    conv, why, _ = normalise_record(record, require_assistant=False)
    assert why is None and [m["content"] for m in conv] == ["first", "second"]


# ---------------------------------------------------------------------------------------------------------------
# JSONL / JSON files and datasets


def test_jsonl_with_bad_lines_skips_them_and_counts(tmp_path, caplog):
    f = write_jsonl(
        tmp_path / "chats.jsonl",
        [
            sharegpt(("human", "hi"), ("gpt", "hello")),
            "{not json",
            openai(("system", "sys"), ("user", "u"), ("assistant", "a")),
            "[1, 2]",
            "",
            sharegpt(("human", "x"), ("alien", "y")),
            openai(("user", "u2"), ("assistant", "a2")),
        ],
    )
    conversations, report = load_conversations(DataConfig(source=str(f), system_prompt="Default."))
    assert report.kept == 3 and report.read == 5
    assert report.skipped == {"line not JSON": 1, "not a dict": 1, "unknown role 'alien'": 1}
    assert "chats.jsonl line 2: not JSON" in caplog.text
    # the system prompt goes only where there is none
    assert conversations[0][0] == {"role": "system", "content": "Default."}
    assert conversations[1][0] == {"role": "system", "content": "sys"}
    summary = report.summary()
    assert "kept 3" in summary and "line not JSON 1" in summary


def test_files_that_hold_nothing_usable_are_errors(tmp_path):
    garbage = write_jsonl(tmp_path / "garbage.jsonl", ["{oops", "still not json"])
    with pytest.raises(DataError, match=r"garbage.jsonl line 1: not JSON"):
        load_conversations(DataConfig(source=str(garbage)))
    wrong = write_jsonl(tmp_path / "wrong.jsonl", [{"text": "a"}, {"text": "b"}])
    with pytest.raises(DataError, match=r"none of the 2 records .*no conversations/messages field: 2"):
        load_conversations(DataConfig(source=str(wrong)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty"):
        load_conversations(DataConfig(source=str(empty)))


def test_json_array_file_source(tmp_path):
    f = tmp_path / "chats.json"
    records = [sharegpt(("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(5)]
    f.write_text(json.dumps(records)[:-30])  # cut off, like the ShareGPT file
    conversations, report = load_conversations(DataConfig(source=str(f)))
    assert report.recovered_from_truncation and report.kept == len(conversations) == 4
    assert conversations[3][1]["content"] == "a3"


def test_hf_datasets_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [openai(("user", f"q{i}"), ("assistant", f"a{i}")) for i in range(6)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    conversations, report = load_conversations(DataConfig(source=f"hf:{tmp_path / 'one'}", max_conversations=4))
    assert report.kept == 4 and conversations[2] == [{"role": "user", "content": "q2"},
                                                     {"role": "assistant", "content": "a2"}]
    share_rows = [sharegpt(("human", f"t{i}"), ("gpt", f"r{i}")) for i in range(3)]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                               "test": datasets.Dataset.from_list(share_rows)})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert load_conversations(DataConfig(source=f"hf:{tmp_path / 'dict'}"))[1].kept == 6
    test_split, _ = load_conversations(DataConfig(source=f"hf:{tmp_path / 'dict'}:test"))
    assert test_split[0] == [{"role": "user", "content": "t0"}, {"role": "assistant", "content": "r0"}]
    with pytest.raises(DataError, match="no split 'dev'"):
        load_conversations(DataConfig(source=f"hf:{tmp_path / 'dict'}:dev"))
    datasets.Dataset.from_list([{"text": "x"}]).save_to_disk(str(tmp_path / "text"))
    with pytest.raises(DataError, match="needs a 'conversations' or 'messages' column, has \\['text'\\]"):
        load_conversations(DataConfig(source=f"hf:{tmp_path / 'text'}"))
    with pytest.raises(DataError, match="cannot load the dataset"):
        load_conversations(DataConfig(source=f"hf:{tmp_path / 'nothing-here'}"))


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="offset"):
        DataConfig(offset=-1)
    with pytest.raises(ValueError, match="max_conversations"):
        DataConfig(max_conversations=-5)


# ---------------------------------------------------------------------------------------------------------------
# MT-bench and prompts


def test_mtbench_prompts():
    prompts = load_prompts("mtbench")
    assert len(prompts) == 80
    assert len({p["id"] for p in prompts}) == 80
    assert all(len(p["turns"]) == 2 and all(isinstance(t, str) and t for t in p["turns"]) for p in prompts)
    assert {p["category"] for p in prompts} >= {"writing", "math", "coding", "reasoning"}
    assert load_prompts("mtbench", max_prompts=5) == prompts[:5]


def test_humaneval_prompts_ask_to_complete_the_function_in_a_code_block():
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164 and prompts[0]["id"] == "HumanEval/0" and prompts[0]["category"] == "code"
    turn = prompts[0]["turns"][0]
    assert turn.count("```") == 2 and "def has_close_elements(" in turn and '"""' in turn
    assert load_prompts("humaneval", max_prompts=3) == prompts[:3]


def test_mtbench_as_conversations():
    answered, report = load_conversations(DataConfig(source="mtbench"))
    assert report.read == 80 and report.kept == 30 and report.skipped == {"no assistant turn": 50}
    assert all([m["role"] for m in c] == ["user", "assistant", "user", "assistant"] for c in answered)
    prompts_only, _ = load_conversations(DataConfig(source="mtbench", require_assistant=False))
    assert len(prompts_only) == 80
    assert sum(all(m["role"] == "user" for m in c) and len(c) == 2 for c in prompts_only) == 50


def test_prompts_from_a_jsonl_file(tmp_path):
    f = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "one", "id": "a", "category": "misc"},
            {"turns": ["two", "three"]},
            sharegpt(("human", "four"), ("gpt", "answer"), ("human", "five")),
            openai(("system", "s"), ("user", "six")),
            {"nothing": 1},
        ],
    )
    prompts = load_prompts(str(f))
    assert [p["turns"] for p in prompts] == [["one"], ["two", "three"], ["four", "five"], ["six"]]
    assert prompts[0]["id"] == "a" and prompts[0]["category"] == "misc" and prompts[1]["id"] == "p-1"
    assert len(load_prompts(str(f), max_prompts=2)) == 2
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"nothing": 1}])
    with pytest.raises(DataError, match="no prompts"):
        load_prompts(str(bad))
    sg = load_prompts("sharegpt", max_prompts=3)
    assert len(sg) == 3 and all(p["turns"] for p in sg)


def test_report_summary_names_everything():
    report = LoadReport(source="x.jsonl", read=10, kept=7, skipped={"empty content": 2, "not a dict": 1},
                        recovered_from_truncation=True, fixed={"merged consecutive turns": 3}, before_offset=0)
    s = report.summary()
    for part in ("x.jsonl", "read 10", "kept 7", "skipped 3", "empty content 2", "not a dict 1",
                 "merged consecutive turns 3", "cut off"):
        assert part in s
