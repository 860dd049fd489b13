"""How an evaluation report reads: the table of τ, n-α and speed-up per (prompt set, drafter), the one-line
summary the runner logs, the figures benchmarks compare under stable labels, the greedy mismatches, and the plot of
the acceptance curves. Every function reads the report dict ``eval.runner.evaluate`` writes."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fledge.eval.metrics import REFERENCE_DRAFTER


def mismatch_lines(report: dict[str, Any]) -> list[str]:
    """One line per greedy mismatch in the report (empty when every difference was a tie or there was none): first
    differences from plain decoding, and positions whose token is not the verifier's float32 argmax."""
    lines = []
    for set_name, entry in report.get("sets", {}).items():
        # A drafter entry of method plain is the baseline again under its drafter name: checked once, as the baseline.
        decoders = [("plain", entry.get("baseline", {}))] + [
            (name, d) for name, d in entry.get("drafters", {}).items() if d.get("method") != "plain"]
        for name, d in decoders:
            lines += [f"{set_name}/{name} prompt {m['id']}: token {m['position']} is {m['loop_token']}, plain greedy "
                      f"decoding gave {m['plain_token']} (float32 gap {m['gap']}, threshold {m['threshold']})"
                      for m in d.get("greedy_mismatches", [])]
            lines += [f"{set_name}/{name} prompt {m['id']}: token {m['position']} is {m['token']}, the verifier's "
                      f"float32 argmax there is {m['argmax']} (gap {m['gap']:.4g}, band {m['threshold']:.4g})"
                      for m in (d.get("recheck") or {}).get("off_argmax", []) if m["kind"] == "mismatch"]
    return lines


def report_table(report: dict[str, Any]) -> list[str]:
    """One row per (prompt set, drafter): τ and the median per-prompt speed-up over plain decoding, each with its
    bootstrap 95 % interval over prompts, n-α, and (greedy) the outputs equal to plain decoding."""
    rows = ["prompt set  drafter             τ [95% interval]     n-α (depth 1..)                 "
            "speed-up [95% interval]  greedy exact"]
    for set_name, entry in report.get("sets", {}).items():
        for name, d in entry.get("drafters", {}).items():
            alphas = " ".join("  - " if a is None else f"{a:.2f}" for a in (d.get("n_alpha") or [])[:6])
            match = d.get("greedy_match_rate")
            ties, wrong = d.get("greedy_tie_count", 0), d.get("greedy_mismatch_count", 0)
            wrong += (d.get("recheck") or {}).get("mismatches", 0)
            outcome = "" if match is None else f"{match:.0%}" + (f" +{ties} ties" if ties else "") + (
                f" {wrong} MISMATCHED" if wrong else "")
            lo, hi = d.get("speedup_interval") or (math.nan, math.nan)
            speedup = f"{d.get('speedup', math.nan):5.2f}x [{lo:.2f}, {hi:.2f}]" if d.get("method") != "plain" else ""
            tau_lo, tau_hi = d.get("tau_interval") or (math.nan, math.nan)
            tau = f"{d.get('tau', math.nan):5.2f}" + (f" [{tau_lo:.2f}, {tau_hi:.2f}]" if "tau_interval" in d else "")
            rows.append(f"{set_name:<11} {name:<18} {tau:<20} {alphas:<31} {speedup:<24} {outcome}")
    rows += [f"({set_name}: {entry['num_prompts']} of {entry['num_prompts'] + entry['prompts_skipped']} prompts, "
             "the rest left out by eval.time_limit_minutes)"
             for set_name, entry in report.get("sets", {}).items() if entry.get("prompts_skipped")]
    return rows


def one_line(entry: dict) -> str:
    lo, hi = entry["speedup_interval"]
    text = (f"{entry['method']} tau {entry['tau']:.2f}, alpha {entry['alpha']:.2f}, "
            f"{entry['tokens_per_s']:.1f} tok/s, speed-up {entry['speedup']:.2f}x [{lo:.2f}, {hi:.2f}] "
            f"(predicted {entry['predicted_speedup']:.2f}x, c={entry['cost_ratio']:.3f}), "
            f"round = {entry['verify_cost_in_steps']:.2f} + {entry['draft_cost_in_steps']:.2f} steps")
    if "round_overhead" in entry:
        floor = entry["round_floor"]
        text += (f" (floor: v(k) {floor['verify_steps']:.2f} at mean k {floor['mean_k']:.1f}, + drafting: overhead "
                 f"{entry['round_overhead']:+.0%})")
    if "greedy_match_rate" in entry:
        text += (f", greedy exact {entry['greedy_match_rate']:.0%} ({entry['greedy_tie_count']} ties, "
                 f"{entry['greedy_mismatch_count']} mismatches)")
    if "recheck" in entry:
        r = entry["recheck"]
        band = r["tie_band_logits"]["median"]
        text += (f", rechecked {r['positions']} positions in float32: {r['ties']} ties, {r['mismatches']} mismatches"
                 + ("" if band is None else f" (tie band median {band:.3g} logits)"))
    return text


def stable_figures(report: dict[str, Any]) -> list[str]:
    """The figures benchmarks compare, one per line under a stable label: ``baseline_vs_hf <set> <value>``,
    ``draft_vocab_coverage <set> <share>`` (of plain decoding's tokens the draft vocabulary holds),
    ``round_overhead <set>/<drafter> <value>`` and ``vs_prompt_lookup <set>/<drafter> <ratio> [<lo>, <hi>]`` (the
    drafter's throughput over prompt lookup's on the same prompts, paired bootstrap interval)."""
    lines = []
    for set_name, entry in report.get("sets", {}).items():
        base = entry.get("baseline", {})
        if "baseline_vs_hf" in base:
            lo, hi = base["baseline_vs_hf_interval"]
            lines.append(f"baseline_vs_hf {set_name} {base['baseline_vs_hf']:.3f} [{lo:.3f}, {hi:.3f}]")
        if "draft_vocab_coverage" in entry:
            lines.append(f"draft_vocab_coverage {set_name} {entry['draft_vocab_coverage']:.3f}")
        drafters = entry.get("drafters", {})
        lines += [f"round_overhead {set_name}/{name} {d['round_overhead']:.3f}" for name, d in drafters.items()
                  if "round_overhead" in d]
        lines += [f"vs_{REFERENCE_DRAFTER} {set_name}/{name} {vs['throughput_ratio']:.3f} "
                  f"[{vs['interval'][0]:.3f}, {vs['interval'][1]:.3f}]"
                  for name, d in drafters.items() if (vs := d.get(f"vs_{REFERENCE_DRAFTER}"))]
    return lines


def new_figure(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """``plt.subplots(*args, **kwargs)`` on matplotlib's Agg backend, which needs no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save_figure(fig: Any, path: Path, dpi: int = 100) -> Path:
    """Lay ``fig`` out, write it to ``path`` and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_acceptance(report: dict, path: Path) -> None:
    """n-α per depth, cumulative acceptance per depth, and τ against the chain length, one line per drafter."""
    from matplotlib.ticker import MaxNLocator

    fig, axes = new_figure(1, 3, figsize=(15, 4.2))
    for set_name, set_report in report["sets"].items():
        for name, entry in set_report["drafters"].items():
            if entry.get("method") == "plain":
                continue
            label = f"{set_name}/{name} ({entry['method']})"
            depths = list(range(1, len(entry["n_alpha"]) + 1))
            n_alpha = [float("nan") if a is None else a for a in entry["n_alpha"]]
            axes[0].plot(depths, n_alpha, marker="o", label=label)
            axes[1].plot(depths, entry["cumulative_acceptance"], marker="o", label=label)
            axes[2].plot(range(len(entry["tau_by_length"])), entry["tau_by_length"], marker="o", label=label)
    for ax, title, ylabel in zip(
        axes,
        ("n-α: P(depth n accepted | all before)", "cumulative: P(≥ n accepted)", "τ if every round drafted at most N"),
        ("n-α", "fraction of verifier calls", "τ (tokens per verifier call)"),
    ):
        ax.set(title=title, xlabel="depth n" if ax is not axes[2] else "N", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_ylim(0, 1.05)
    axes[1].set_ylim(0, 1.05)
    axes[2].legend(fontsize=8)
    save_figure(fig, path)
