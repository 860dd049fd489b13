"""fledge sweep compare: two evaluations of the same prompts, paired prompt by prompt."""

from __future__ import annotations

import json

import pytest

from fledge.core.errors import ConfigError
from fledge.eval.compare import compare_lines, compare_main, compare_reports
from fledge.eval.report import EvalReport


def _report(per_set: dict[str, dict[str, list[tuple[str, int, int, float]]]], committed: bool = True) -> dict:
    """{set: {drafter: [(prompt id, committed tokens, rounds, speed-up)]}} as a fledge eval report."""
    sets = {}
    for set_name, drafters in per_set.items():
        entries = {"greedy": {"method": "plain"}}
        for name, prompts in drafters.items():
            rows = [{"id": i, "tokens": c + 1, "rounds": r, "speedup": s, "seconds": 1.0} for i, c, r, s in prompts]
            if committed:
                for row, (_, c, _, _) in zip(rows, prompts):
                    row["committed"] = c
            entries[name] = {"method": "tree", "per_prompt": rows}
        sets[set_name] = {"num_prompts": 3, "drafters": entries}
    return {"sets": sets}


A = {"mt": {"hybrid": [("p1", 20, 10, 1.2), ("p2", 30, 20, 1.0), ("p3", 40, 20, 1.4)],
            "lookup": [("p1", 12, 10, 1.0)]}}
B = {"mt": {"hybrid": [("p1", 22, 10, 1.3), ("p2", 33, 20, 1.1), ("p3", 44, 20, 1.5), ("p4", 90, 10, 3.0)]},
     "code": {"hybrid": [("p1", 1, 1, 1.0)]}}


def compare(a: dict, b: dict) -> list[dict]:
    """compare_reports on two reports as they are read from disk."""
    return compare_reports(EvalReport.from_json(a), EvalReport.from_json(b))


def test_compare_pairs_the_prompts_both_ran():
    rows = compare(_report(A), _report(B))
    assert len(rows) == 1  # lookup is only in A, code only in B, p4 only in B
    row = rows[0]
    assert (row["set"], row["drafter"], row["prompts"]) == ("mt", "hybrid", 3)
    assert row["tau_a"] == pytest.approx(90 / 50) and row["tau_b"] == pytest.approx(99 / 50)
    assert row["tau_diff"] == pytest.approx(9 / 50)
    # B beats A on every prompt: every resample of the pairs says so, the interval excludes 0.
    lo, hi = row["tau_diff_interval"]
    assert 0 < lo <= row["tau_diff"] <= hi
    assert row["speedup_ratio"] == pytest.approx((3.9 / 3) / (3.6 / 3))
    slo, shi = row["speedup_ratio_interval"]
    assert 1 < slo <= row["speedup_ratio"] <= shi
    lines = compare_lines(rows)
    assert "tau_diff mt/hybrid +0.1800" in "\n".join(lines)
    assert any(line.startswith("speedup_ratio mt/hybrid 1.0833") for line in lines)


def test_compare_reads_older_reports_from_their_tokens():
    """Reports from before ``committed`` was recorded: both sides count the output's tokens less the prefill's one,
    so that the way τ is counted does not show up as a difference."""
    b = _report(B)
    for p in b["sets"]["mt"]["drafters"]["hybrid"]["per_prompt"]:
        p["tokens"] -= 1  # B's last rounds were cut: its outputs hold one token fewer than its rounds committed
    rows = compare(_report(A, committed=False), b)
    assert rows[0]["tau_from"] == "tokens"
    assert rows[0]["tau_a"] == pytest.approx(90 / 50) and rows[0]["tau_b"] == pytest.approx(96 / 50)
    assert "predates" in "\n".join(compare_lines(rows))
    assert compare(_report(A), b)[0]["tau_from"] == "committed"


def test_compare_refuses_reports_with_nothing_in_common(tmp_path):
    with pytest.raises(ConfigError, match="share no prompt set"):
        compare(_report(A), _report({"code": B["code"]}))
    with pytest.raises(ConfigError, match="no evaluation report"):
        EvalReport.load(tmp_path / "missing")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not JSON"):
        EvalReport.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"steps": 3}))
    with pytest.raises(ConfigError, match="not a fledge eval report"):
        EvalReport.load(tmp_path / "other.json")


def test_compare_main_prints_the_table(tmp_path, capsys):
    for name, report in (("a", A), ("b", B)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(_report(report)))
    assert compare_main([str(tmp_path / "a"), str(tmp_path / "b" / "report.json")]) == 0
    out = capsys.readouterr().out
    assert "mt          hybrid" in out and "+0.180" in out and "tau_diff mt/hybrid" in out
    assert compare_main([str(tmp_path / "a")]) == 2
    assert "usage: fledge sweep compare" in capsys.readouterr().out


def test_a_report_reads_and_writes_back_unchanged_and_a_newer_format_is_refused(tmp_path):
    record = _report(A)
    record["sets"]["mt"]["drafters"]["hybrid"].update(tau=1.8, cost_ratio=0.3, tree={"mean_nodes": 4.0})
    record["sets"]["mt"]["legacy_field"] = 1  # a field this fledge does not know: kept, not lost
    record.update(config={"max_new_tokens": 8}, verifier={"name": "tiny"}, stop_ids=[2], draft={"path": "runs/a/train"})
    record["sets"]["mt"]["baseline"] = {"tokens_per_s": 10.0}
    report = EvalReport.from_json(record)
    hybrid = report.sets["mt"].drafters["hybrid"]
    assert (hybrid.method, hybrid.tau) == ("tree", 1.8)
    assert hybrid.figures == {"cost_ratio": 0.3, "tree": {"mean_nodes": 4.0}}  # what readers do not type, kept
    assert [(s, n) for s, n, _ in report.drafter_rows()] == [("mt", "hybrid"), ("mt", "lookup")]  # plain left out
    file = report.save(tmp_path)
    written = json.loads(file.read_text())
    assert written.pop("format") == 1  # a report without a format (format 0) has format 1's keys
    assert written == record
    assert EvalReport.load(tmp_path).to_json() == report.to_json()
    (tmp_path / "report.json").write_text(json.dumps({**record, "format": 2}))
    with pytest.raises(ConfigError, match="report format 2; this fledge reads formats up to 1"):
        EvalReport.load(tmp_path)
    with pytest.raises(ConfigError, match="not a set report"):
        EvalReport.from_json({"sets": {"mt": [1, 2]}})
    with pytest.raises(ConfigError, match="names no method"):
        EvalReport.from_json({"sets": {"mt": {"drafters": {"x": {"tau": 1.0}}}}})
