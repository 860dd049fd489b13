"""How every evaluation decodes its prompts, B at a time (``decode_groups``; B = 1 included), and the batch sweep's
table and plot: ``fledge eval eval.batch_size='[1,4,16,64]'``, each drafter's speed-up over plain decoding at the same
batch size (its entries: ``eval/runner.py``).

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

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from fledge.decode.loop import generate
from fledge.decode.proposals import Drafter
from fledge.decode.result import DecodeResult
from fledge.eval.hf_baseline import generate_hf_batch
from fledge.eval.metrics import throughput
from fledge.eval.summary import new_figure, save_figure
from fledge.models.verifier import Verifier

log = logging.getLogger(__name__)


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
                    generator=torch.Generator(device=verifier.device).manual_seed(cfg.seed))


@dataclass
class Decoded:
    """One decoder's runs over a prompt set: each prompt's result, and (tokens, seconds) per group decoded together
    (a group of one at batch 1: its prompt's own)."""

    results: list[DecodeResult] = field(default_factory=list)
    units: list[tuple[int, float]] = field(default_factory=list)

    def add(self, results: list[DecodeResult], seconds: float) -> None:
        self.results += results
        self.units.append((sum(len(r.tokens) for r in results), seconds))


def decode_groups(
    verifier: Verifier, groups: list[list[torch.Tensor]], drafters: list[tuple[str, Drafter]], methods: dict[str, str],
    cfg: Any, stop_ids: frozenset[int], desc: str, fresh: bool, deadline: float | None = None, sets_left: int = 1,
) -> tuple[Decoded, Decoded, dict[str, Decoded]]:
    """Plain decoding, Hugging Face ``generate`` (with ``eval.hf_baseline``) and each drafter, group after group of
    prompts, so that a change of the machine's load hits them alike, after an untimed warm-up of each on the first
    group. With ``fresh``, each row of a group decodes with a ``fresh`` drafter of its own. With ``deadline``
    (``time.perf_counter``'s), a group starts only while the time so far plus a group's mean fits this set's share of
    the time left (``sets_left`` sets share it); every set decodes at least one group. Returns plain's, generate's
    and each drafter's runs."""
    by_name = dict(drafters)

    def run(prompts: list[torch.Tensor], name: str | None, max_new_tokens: int) -> tuple[list[DecodeResult], float]:
        drafter = by_name.get(name) if name else None
        rows = None if drafter is None else [drafter.fresh() for _ in prompts] if fresh else [drafter] * len(prompts)
        return decode_rows(verifier, prompts, rows, methods.get(name), cfg, stop_ids, max_new_tokens)

    def run_hf(prompts: list[torch.Tensor], max_new_tokens: int) -> tuple[list[DecodeResult], float]:
        return generate_hf_batch(verifier.model, prompts, max_new_tokens=max_new_tokens, sampling=cfg.sampling(),
                                 stop_ids=stop_ids, seed=cfg.seed)

    if cfg.warmup_tokens:
        for name in [None, *by_name]:
            run(groups[0], name, cfg.warmup_tokens)
        if cfg.hf_baseline:
            run_hf(groups[0], cfg.warmup_tokens)
    plain, hf, runs = Decoded(), Decoded(), {name: Decoded() for name in by_name}
    start = time.perf_counter()
    share = None if deadline is None else (deadline - start) / sets_left
    bar = tqdm(total=sum(len(g) for g in groups), desc=desc, unit="prompt")
    for prompts in groups:
        spent = time.perf_counter() - start
        if share is not None and plain.units and spent + spent / len(plain.units) > share:
            log.info("%s: %d of %d prompts in %.0f s, the set's share of eval.time_limit_minutes", desc,
                     len(plain.results), bar.total, spent)
            break
        plain.add(*run(prompts, None, cfg.max_new_tokens))
        if cfg.hf_baseline:
            hf.add(*run_hf(prompts, cfg.max_new_tokens))
        for name in by_name:
            runs[name].add(*run(prompts, name, cfg.max_new_tokens))
        bar.update(len(prompts))
    bar.close()
    return plain, hf, runs


def hf_figures(plain: list[DecodeResult], hf: Decoded, greedy: bool) -> dict[str, Any]:
    """Hugging Face ``generate``'s throughput and (greedy) the share of its outputs equal to plain decoding's."""
    figures = throughput(hf.units)
    if greedy:
        figures["same_tokens_rate"] = sum(p.tokens == h.tokens for p, h in zip(plain, hf.results)) / len(hf.results)
    return figures


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
    fig, (left, right) = new_figure(1, 2, figsize=(12, 4.2))
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
        ax.set(xlabel="batch size", ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    save_figure(fig, path)
