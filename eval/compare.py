"""Two evaluations of the same prompts, compared prompt by prompt: what a lever bought.

    fledge eval draft=runs/a/train eval.out_dir=runs/a_e24 eval.max_prompts=24 ...
    fledge eval draft=runs/b/train eval.out_dir=runs/b_e24 eval.max_prompts=24 ...
    fledge sweep compare runs/a_e24 runs/b_e24          # B against A, per prompt set and drafter

Two drafts' τ intervals over prompts overlap even when one wins on every prompt, because they mostly measure how
the prompts differ. Pairing cancels that: for each prompt set and drafter both reports hold, the prompts both ran
(by id) are resampled *in pairs*, and the difference of the pooled τ (B − A) and the ratio of the mean per-prompt
speed-ups (B / A, each against the plain decoding timed beside it in its own run) get bootstrap 95 % intervals.
Speed-ups come from separate runs, so a change of the machine's load between them lands in the ratio; τ does not
depend on the machine.
"""

from __future__ import annotations

import math
from typing import Any

from fledge.core.errors import ConfigError
from fledge.eval.metrics import bootstrap_interval, pooled_tau
from fledge.eval.report import DrafterEntry, EvalReport


def _per_prompt(entry: DrafterEntry, committed: bool) -> dict[Any, tuple[float, int, float]]:
    """{prompt id: (tokens its rounds committed, rounds, speed-up)}; with ``committed`` false, the output's tokens
    less the prefill's one instead (reports from before ``committed`` was recorded), which falls short of the
    rounds' count where the last round was cut at the length limit or a stop token."""
    return {p["id"]: (p["committed"] if committed else max(p["tokens"] - 1, 0), p["rounds"], p["speedup"])
            for p in entry.per_prompt or []}


def _pooled_tau(rows: list[tuple[float, int, float]]) -> float:
    return pooled_tau([(tokens, rounds) for tokens, rounds, _ in rows])


def _mean_speedup(rows: list[tuple[float, int, float]]) -> float:
    values = [r[2] for r in rows if not math.isnan(r[2])]
    return sum(values) / len(values) if values else math.nan


def compare_reports(a: EvalReport, b: EvalReport) -> list[dict[str, Any]]:
    """One row per (prompt set, drafter) in both reports: τ of each, the paired τ difference B − A and the paired
    speed-up ratio B / A with bootstrap intervals, over the prompts both ran. Refused when they share none."""
    rows = []
    for set_name, name, d_a in a.drafter_rows():
        d_b = b.sets[set_name].drafters.get(name) if set_name in b.sets else None
        if d_b is None or not d_a.per_prompt or not d_b.per_prompt:
            continue
        # Both sides count τ the same way: the rounds' committed tokens where both reports have them, else the
        # output's tokens (so an older report does not put a counting difference into the comparison).
        committed = all("committed" in p for p in d_a.per_prompt + d_b.per_prompt)
        pa, pb = _per_prompt(d_a, committed), _per_prompt(d_b, committed)
        pairs = [(pa[i], pb[i]) for i in pa if i in pb]
        if not pairs:
            continue

        def tau_diff(sample: list) -> float:
            return _pooled_tau([y for _, y in sample]) - _pooled_tau([x for x, _ in sample])

        def speedup_ratio(sample: list) -> float:
            base = _mean_speedup([x for x, _ in sample])
            return _mean_speedup([y for _, y in sample]) / base if base else math.nan

        rows.append({
            "set": set_name, "drafter": name, "prompts": len(pairs),
            "tau_from": "committed" if committed else "tokens",
            "tau_a": _pooled_tau([x for x, _ in pairs]), "tau_b": _pooled_tau([y for _, y in pairs]),
            "tau_diff": tau_diff(pairs), "tau_diff_interval": list(bootstrap_interval(pairs, tau_diff)),
            "speedup_ratio": speedup_ratio(pairs),
            "speedup_ratio_interval": list(bootstrap_interval(pairs, speedup_ratio)),
        })
    if not rows:
        raise ConfigError("the two reports share no prompt set, drafter and prompt",
                          fix="compare evaluations of the same prompt sets (same prompts and eval.max_prompts)")
    return rows


def compare_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The table, then one stable line per row: ``tau_diff <set>/<drafter> <diff> [<lo>, <hi>]`` and
    ``speedup_ratio <set>/<drafter> <ratio> [<lo>, <hi>]``."""
    lines = ["prompt set  drafter             prompts  τ A    τ B    τ B − A [95%]             speed-up B / A [95%]"]
    for r in rows:
        lo, hi = r["tau_diff_interval"]
        slo, shi = r["speedup_ratio_interval"]
        lines.append(f"{r['set']:<11} {r['drafter']:<19} {r['prompts']:>7}  {r['tau_a']:.3f}  {r['tau_b']:.3f}  "
                     f"{r['tau_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]      {r['speedup_ratio']:.3f}x "
                     f"[{slo:.3f}, {shi:.3f}]")
    if any(r["tau_from"] == "tokens" for r in rows):
        lines.append("(τ from each prompt's output tokens less the prefill's one: a report predates per-prompt "
                     "committed tokens, so the τ columns can differ slightly from the reports' own)")
    lines.append("")
    for label, sign in (("tau_diff", "+"), ("speedup_ratio", "")):
        for r in rows:
            lo, hi = r[f"{label}_interval"]
            lines.append(f"{label} {r['set']}/{r['drafter']} {r[label]:{sign}.4f} [{lo:{sign}.4f}, {hi:{sign}.4f}]")
    return lines


def compare_main(argv: list[str]) -> int:
    """``fledge sweep compare A B``: B against A, prompt by prompt (A and B: fledge eval out_dirs or report.json)."""
    if len(argv) != 2 or any(a.startswith("-") for a in argv):
        print("usage: fledge sweep compare A B   (two fledge eval out_dirs or report.json files; B against A, "
              "prompt by prompt)")
        return 2
    rows = compare_reports(EvalReport.load(argv[0]), EvalReport.load(argv[1]))
    print("\n".join([f"B = {argv[1]} against A = {argv[0]}", *compare_lines(rows)]))
    return 0
