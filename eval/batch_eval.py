"""``fledge eval eval.batch_size='[1,4,16,64]'``: each drafter's speed-up over plain decoding at the same batch size.

Speculation pays less as the batch grows (the verifier's forward stops being memory-bound and checking k drafts per
row costs more); users need the curve at the batch sizes they serve. For each batch size B, the prompts are decoded
B at a time (``decode/loop.py``): plain decoding first, then each drafter on the same group, so that a change of load
hits them alike. A drafter's tokens/s over plain's is its speed-up at B (pooled over the groups), with a bootstrap
95 % interval over groups; with ``eval.hf_baseline`` each group is also decoded by Hugging Face ``generate`` as one
left-padded batch, and a group's plain is the faster of the two (``baseline_vs_hf`` per B says which); τ and n-α
come from its rows' rounds, and (greedy) every row is checked against plain decoding's row like the batch-1 report
does (exact, tie or mismatch).

The EAGLE-3 draft (alone or in the hybrid) proposes for every row in one batched forward per draft step
(``decode/batch_draft.py``), as a serving engine does; prompt lookup proposes row by row, at no model cost.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from fledge.decode.accept import seeded_generator
from fledge.decode.loop import generate
from fledge.decode.proposals import Drafter
from fledge.decode.result import DecodeResult
from fledge.eval.hf_baseline import generate_hf_batch
from fledge.eval.metrics import acceptance_entry, bootstrap_interval, compare_with_reference, median, throughput
from fledge.eval.ties import TieJudge, greedy_outcome
from fledge.models.verifier import Verifier


def _group_speedup(groups: list[tuple[int, float, int, float]]) -> tuple[float, list[float]]:
    """(drafter tokens, seconds, plain tokens, seconds) per group -> pooled speed-up and its interval over groups."""

    def pooled(sample: list[tuple[int, float, int, float]]) -> float:
        tokens, seconds = sum(g[0] for g in sample), sum(g[1] for g in sample)
        plain_tokens, plain_seconds = sum(g[2] for g in sample), sum(g[3] for g in sample)
        if not (seconds and plain_seconds and plain_tokens):
            return math.nan
        return (tokens / seconds) / (plain_tokens / plain_seconds)

    lo, hi = bootstrap_interval(groups, pooled)
    return pooled(groups), [lo, hi]


def decode_rows(
    verifier: Verifier, prompts: list[torch.Tensor], rows: list[Drafter] | None, method: str | None, cfg: Any,
    stop_ids: frozenset[int], max_new_tokens: int,
) -> tuple[list[DecodeResult], float]:
    """``generate`` as every evaluation runs it: the prompts with one drafter each (``rows``; None: plain decoding),
    the evaluation's sampling, draft shapes and seed, capturing the verifier states the drafters read."""
    aux = rows[0].aux_layer_ids if rows is not None and rows[0].needs_aux else None  # the draft's own
    return generate(verifier.model, prompts, rows, method="plain" if rows is None else method,
                    num_draft_tokens=cfg.num_draft_tokens, shape=cfg.tree_shape(), max_new_tokens=max_new_tokens,
                    sampling=cfg.sampling(), stop_ids=stop_ids, aux_layer_ids=aux,
                    generator=seeded_generator(verifier.device, cfg.seed))


def evaluate_batched(
    verifier: Verifier,
    encoded: list[tuple[Any, torch.Tensor]],
    drafters: list[tuple[str, Drafter]],
    methods: dict[str, str],
    cfg: Any,
    stop_ids: frozenset[int],
    judge: TieJudge | None,
) -> tuple[dict[str, dict[str, Any]], list[DecodeResult]]:
    """{str(B): {"plain": {...}, "drafters": {name: entry}}} for one prompt set, and the smallest batch size's plain
    answers in prompt order. With ``judge`` (greedy), each drafter's rows are checked against plain's
    (``greedy_outcome``)."""
    out: dict[str, dict[str, Any]] = {}
    first_plain: list[DecodeResult] = []
    for size in cfg.batch_sizes():
        groups = [encoded[i : i + size] for i in range(0, len(encoded), size)]

        def run(prompts: list[torch.Tensor], name: str | None, max_new_tokens: int) -> tuple[list[DecodeResult], float]:
            drafter = dict(drafters).get(name) if name else None
            rows = None if drafter is None else [drafter.fresh() for _ in prompts]
            return decode_rows(verifier, prompts, rows, methods.get(name), cfg, stop_ids, max_new_tokens)

        if cfg.warmup_tokens:
            first = [ids for _, ids in groups[0]]
            for name in [None, *(n for n, _ in drafters)]:
                run(first, name, cfg.warmup_tokens)
        plain: list[DecodeResult] = []
        hf: list[DecodeResult] = []
        rows: dict[str, list[DecodeResult]] = {name: [] for name, _ in drafters}
        # (tokens, seconds) per group: plain's, generate's and each drafter's
        plain_units: list[tuple[int, float]] = []
        hf_units: list[tuple[int, float]] = []
        units: dict[str, list[tuple[int, float]]] = {name: [] for name, _ in drafters}
        bar = tqdm(total=len(encoded) * (1 + len(drafters)), desc=f"eval batch {size}", unit="decode")
        for group in groups:
            prompts = [ids for _, ids in group]
            results, elapsed = run(prompts, None, cfg.max_new_tokens)
            plain += results
            plain_units.append((sum(len(r.tokens) for r in results), elapsed))
            if cfg.hf_baseline:
                # The same group through Hugging Face generate: is the batched plain loop a fair baseline at B?
                results, elapsed = generate_hf_batch(verifier.model, prompts, max_new_tokens=cfg.max_new_tokens,
                                                     sampling=cfg.sampling(), stop_ids=stop_ids, seed=cfg.seed)
                hf += results
                hf_units.append((sum(len(r.tokens) for r in results), elapsed))
            bar.update(len(prompts))
            for name, _ in drafters:
                results, elapsed = run(prompts, name, cfg.max_new_tokens)
                rows[name] += results
                units[name].append((sum(len(r.tokens) for r in results), elapsed))
                bar.update(len(prompts))
        bar.close()
        first_plain = first_plain or plain
        entry: dict[str, Any] = {"batch_size": size, "groups": len(groups), "plain": throughput(plain_units),
                                 "drafters": {}}
        if hf:
            entry["plain"]["hf_generate"] = throughput(hf_units)
            if cfg.sampling().greedy:
                entry["plain"]["hf_generate"]["same_tokens_rate"] = sum(
                    p.tokens == h.tokens for p, h in zip(plain, hf)) / len(hf)
            hf_rate = entry["plain"]["hf_generate"]["tokens_per_s"]
            # fledge's batched plain tokens/s over generate's at the same B: below 1, generate is the faster baseline.
            entry["plain"]["baseline_vs_hf"] = entry["plain"]["tokens_per_s"] / hf_rate if hf_rate else math.nan
            # Speed-ups divide by the faster of the two baselines, group by group, as at batch 1.
            plain_units = [p if not h[1] or (p[1] and p[0] / p[1] >= h[0] / h[1]) else h
                           for p, h in zip(plain_units, hf_units)]
        for name, _ in drafters:
            results = rows[name]
            d, _, per_prompt_tau = acceptance_entry(results, methods[name], cfg.num_draft_tokens, cfg.tree_depth)
            per_group = [(*u, *p) for u, p in zip(units[name], plain_units)]
            speedup, interval = _group_speedup(per_group)
            group_speedups = [_group_speedup([g])[0] for g in per_group]
            d.update(**throughput(units[name]), speedup=speedup, speedup_interval=interval,
                     median_group_speedup=median([x for x in group_speedups if not math.isnan(x)]),
                     # Per prompt as at batch 1 (``fledge sweep compare`` pairs them): its rounds, and the speed-up
                     # of the group it was decoded in (a row of a batch has no time of its own).
                     per_prompt=[{"id": pid, "tokens": len(r.tokens), "rounds": rounds, "committed": committed,
                                  "speedup": group_speedups[i // size], "group": i // size}
                                 for i, ((pid, _), r, (committed, rounds)) in
                                 enumerate(zip(encoded, results, per_prompt_tau))])
            if judge is not None:
                d.update(greedy_outcome(judge, encoded, results, plain, cfg.recheck))
            entry["drafters"][name] = d
        compare_with_reference(entry["drafters"], units)
        out[str(size)] = entry
    return out, first_plain


def batch_table(report: dict[str, Any]) -> list[str]:
    """One row per (prompt set, batch size, drafter): τ, tokens/s against plain's, speed-up with its interval."""
    sweep = report.get("batch_sweep") or {}
    if not sweep:
        return []
    rows = ["prompt set  batch  drafter             τ      plain tok/s  tok/s    speed-up [95% interval]  greedy exact"]
    for set_name, by_size in sweep.items():
        for size, entry in by_size.items():
            for name, d in entry["drafters"].items():
                lo, hi = d["speedup_interval"]
                match = d.get("greedy_match_rate")
                exact = "" if match is None else f"{match:.0%}" + (
                    f" +{d['greedy_tie_count']} ties" if d.get("greedy_tie_count") else "") + (
                    f" {d['greedy_mismatch_count']} MISMATCHED" if d.get("greedy_mismatch_count") else "")
                rows.append(f"{set_name:<11} {size:>5}  {name:<18} {d['tau']:5.2f}  {entry['plain']['tokens_per_s']:>11.1f}"
                            f"  {d['tokens_per_s']:>6.1f}   {d['speedup']:5.2f}x [{lo:.2f}, {hi:.2f}]      {exact}")
    return rows


def batch_figures(report: dict[str, Any]) -> list[str]:
    """Stable labels for benchmarks: ``batch_speedup <set>/<drafter> B=<size> <value>``, and
    ``batch_baseline_vs_hf <set> B=<size> <value>`` (fledge's batched plain tokens/s over Hugging Face generate's at
    the same batch size) where generate was timed."""
    sweep = (report.get("batch_sweep") or {}).items()
    return [f"batch_speedup {set_name}/{name} B={size} {d['speedup']:.3f}"
            for set_name, by_size in sweep
            for size, entry in by_size.items() for name, d in entry["drafters"].items()] + [
        f"batch_baseline_vs_hf {set_name} B={size} {entry['plain']['baseline_vs_hf']:.3f}"
        for set_name, by_size in sweep for size, entry in by_size.items() if "baseline_vs_hf" in entry["plain"]]


def plot_batch(report: dict[str, Any], path: Path) -> None:
    """Speed-up over plain decoding against the batch size (with 95 % intervals), and tokens/s per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for set_name, by_size in report["batch_sweep"].items():
        sizes = [int(s) for s in by_size]
        right.plot(sizes, [by_size[str(s)]["plain"]["tokens_per_s"] for s in sizes], marker="o", color="black",
                   label=f"{set_name}/plain")
        names = next(iter(by_size.values()))["drafters"]
        for name in names:
            ds = [by_size[str(s)]["drafters"][name] for s in sizes]
            values = [d["speedup"] for d in ds]
            errors = [[v - d["speedup_interval"][0] for v, d in zip(values, ds)],
                      [d["speedup_interval"][1] - v for v, d in zip(values, ds)]]
            left.errorbar(sizes, values, yerr=errors, marker="o", capsize=3, label=f"{set_name}/{name}")
            right.plot(sizes, [d["tokens_per_s"] for d in ds], marker="o", label=f"{set_name}/{name}")
    left.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    for ax, title, ylabel in ((left, "speed-up over plain decoding at the same batch size", "speed-up"),
                              (right, "throughput", "tokens/s (all rows)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
