"""``fledge eval``: a trained (or exported) draft against plain greedy decoding and prompt lookup, per prompt set.

    fledge eval draft=runs/train                          # a training run, a step folder, or an exported checkpoint
    fledge eval draft=runs/export eval.method=tree eval.temperature=0.7
    fledge eval 'prompts=[mtbench, my_prompts.jsonl]' eval.max_prompts=20
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fledge.core.errors import ConfigError
from fledge.core.sweep import is_sweep_dir, sweep_jobs
from fledge.data.prompt_sets import load_prompts
from fledge.decode.drafters import PromptLookupDrafter
from fledge.eval.batch_eval import batch_figures, batch_table
from fledge.eval.breakdown import breakdown_figures, breakdown_lines
from fledge.eval.datastore import load_datastore
from fledge.eval.report import EvalReport
from fledge.eval.roster import DrafterSettings
from fledge.eval.runner import EvalConfig, encode_prompt, evaluate, load_eagle_drafter
from fledge.eval.summary import mismatch_lines, report_table, stable_figures
from fledge.eval.tune import measure_verify_cost
from fledge.models.verifier import Verifier, VerifierConfig, load_verifier

log = logging.getLogger(__name__)


@dataclass
class EvalJobConfig(DrafterSettings):
    """``fledge eval``: the drafter keys (``prompt_lookup_max_ngram``, ``hybrid*``, ``draft_min_prob``) are
    ``DrafterSettings``' (``eval/roster.py``), shared with ``fledge tune``."""

    draft: str | None = "runs/train"
    """The draft: a ``fledge train`` output dir, one of its step folders, or an exported serving checkpoint
    (a folder with config.json + model.safetensors). A training sweep's folder (``fledge train -m ...``) evaluates
    every finished job's draft side by side, as rows ``eagle3#<job>``. None evaluates the training-free baselines
    only."""
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    """The verifier; its ``dtype`` is the one the evaluation runs in (``auto``: the machine's fast one)."""
    prompts: list[str] = field(default_factory=lambda: ["mtbench"])
    """Prompt sets: ``mtbench`` (80 two-turn questions; the first turn is used), ``humaneval`` (164 Python functions
    to complete), ``sharegpt``, ``hf:...``, or a
    .jsonl / .json file of {"prompt": ...}, {"turns": [...]}, ShareGPT or OpenAI records."""
    prompt_lookup: bool = True
    """Also run the prompt-lookup (n-gram) drafter, the baseline that needs no training."""
    datastore_alone: bool = False
    """Also run prompt lookup with the hybrid's datastore and no draft (row ``lookup+datastore``): what the
    datastore buys without training."""
    draft_alone: bool = True
    """Run the draft on its own (row ``eagle3``); false keeps only the hybrid and the baselines."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    wandb_mode: str = "offline"
    """offline (default: no network), online, or disabled; logs the report and the acceptance curves."""
    wandb_project: str = "fledge"


def _draft_paths(draft: str | None) -> dict[str, Path]:
    """Row suffix -> draft folder: ``{"": draft}``, or ``{"#<job>": job folder}`` for a training sweep's folder."""
    if draft is None:
        return {}
    if not is_sweep_dir(draft):
        return {"": Path(draft)}
    jobs = {f"#{r['job']}": job_dir for job_dir, r in sweep_jobs(draft, "train") if r.get("finished")}
    if not jobs:
        raise ConfigError(f"draft={draft} is a sweep folder without a finished training job",
                          fix="wait for `fledge train -m ...` to finish, or give one job's folder")
    return jobs


NODE_COST_REPEATS = 12
"""Timed rounds of ``hybrid_node_cost=auto``'s measurement (the fastest of each length is kept): with 5 on this
project's 2-core boxes v(17) read 1.42 and 1.19 on the same prompt half an hour apart."""


def _node_cost(cfg: EvalJobConfig, verifier: Verifier, prompt_sets: dict[str, list[dict]],
               aux_layer_ids: list[int]) -> float:
    """``hybrid_node_cost``, measured on the first prompt of the first set where it is ``auto``."""
    if not cfg.measures_node_cost:
        return cfg.node_cost()
    first = next((p for ps in prompt_sets.values() for p in ps), None)
    if first is None:
        raise ConfigError("hybrid_node_cost=auto is measured on the first prompt, and there is none",
                          fix="check prompts")
    ids = encode_prompt(verifier.tokenizer, first, cfg.eval.chat_template_kwargs)
    lengths = sorted({1 + round(i * cfg.hybrid_budget / 4) for i in range(5)})
    verify = measure_verify_cost(verifier.model, ids, lengths, aux_layer_ids, repeats=NODE_COST_REPEATS)
    cost = cfg.node_cost(verify)
    log.info("hybrid_node_cost=auto: a checked node costs %.4f plain steps here (v(k): %s)", cost,
             " ".join(f"{k}:{v:.3f}" for k, v in sorted(verify.items())))
    return cost


def run(cfg: EvalJobConfig) -> dict[str, Any]:
    if cfg.datastore_alone and cfg.hybrid_datastore is None:
        raise ConfigError("datastore_alone=true needs a datastore", fix="set hybrid_datastore=shipped")
    if cfg.hybrid and cfg.draft is not None:
        cfg.check_node_cost()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Its dtype is the evaluation's (verifier.dtype), and its linear layers run the kernel chosen for decoding.
    verifier = load_verifier(cfg.verifier, device, decoding=True)
    drafters: dict[str, Any] = {}
    draft_meta: dict[str, Any] = {}
    store = None
    if cfg.hybrid_datastore is not None and ((cfg.hybrid and cfg.draft is not None) or cfg.datastore_alone):
        store = load_datastore(cfg.hybrid_datastore, verifier.tokenizer, fingerprint=verifier.fingerprint)
    recycle = (cfg.recycle_table(verifier.tokenizer, int(verifier.model.config.vocab_size), verifier.fingerprint)
               if cfg.hybrid and cfg.draft is not None else None)
    prompt_sets = {(s if s == "mtbench" else Path(s).stem): load_prompts(s) for s in cfg.prompts}
    node_cost = None
    for suffix, path in _draft_paths(cfg.draft).items():
        drafter = cfg.eagle(load_eagle_drafter(path, verifier).draft)
        if cfg.draft_alone:
            drafters[f"eagle3{suffix}"] = drafter
        draft_meta = {"path": str(cfg.draft), "draft_vocab_size": int(drafter.draft.config.draft_vocab_size)}
        if cfg.hybrid:
            if node_cost is None:
                node_cost = _node_cost(cfg, verifier, prompt_sets, drafter.aux_layer_ids)
                draft_meta["hybrid_node_cost"] = node_cost
            drafters[f"eagle3+lookup{suffix}"] = cfg.hybrid_of(drafter.draft, store,
                                                                None if recycle is None else recycle.fresh(), node_cost)
    if is_sweep_dir(cfg.draft or ""):
        draft_meta["sweep_jobs"] = {str(r["job"]): r["overrides"] for _, r in sweep_jobs(cfg.draft, "train")}
    if cfg.prompt_lookup:
        drafters["prompt_lookup"] = PromptLookupDrafter(max_ngram=cfg.prompt_lookup_max_ngram)
    if cfg.datastore_alone:
        drafters["lookup+datastore"] = cfg.lookup(store)
    if not drafters:
        raise ConfigError("nothing to evaluate", fix="set draft=... or prompt_lookup=true")
    def meta() -> dict[str, Any]:
        if store is None:
            return {"draft": draft_meta}
        return {"draft": draft_meta, "datastore": {
            "source": cfg.hybrid_datastore, "tokens": store.tokens, "ngrams": len(store),
            "n": [store.min_ngram, store.max_ngram], "seconds": store.seconds, "continuations": store.hits}}

    report = evaluate(verifier, prompt_sets, drafters, cfg.eval, meta)
    _log_wandb(cfg, report)
    batch = batch_table(report)
    first = breakdown_lines(report)
    print("\n".join(["", *report_table(report), *(["", *batch] if batch else []), *(["", *first] if first else []),
                     "", *stable_figures(report), *batch_figures(report), *breakdown_figures(report)]))
    mismatches = mismatch_lines(report)
    if mismatches:
        # Not a numerical tie: the loop emitted a token that plain greedy decoding would not have.
        print("\n".join(["", "fledge eval: greedy outputs differ from plain decoding beyond rounding (report.json: "
                               "greedy_mismatches):", *mismatches]), file=sys.stderr, flush=True)
        raise SystemExit(1)
    return report


def _log_wandb(cfg: EvalJobConfig, report: dict[str, Any]) -> None:
    if cfg.wandb_mode == "disabled" or cfg.eval.out_dir is None:
        return
    import wandb

    out = Path(cfg.eval.out_dir)
    run = wandb.init(project=cfg.wandb_project, mode=cfg.wandb_mode, dir=str(out), job_type="eval",
                     config={"eval": report["config"], "draft": report.get("draft", {})})
    try:
        for set_name, name, d in EvalReport.from_json(report).drafter_rows():
            prefix = f"{set_name}/{name}"
            run.summary.update({f"{prefix}/tau": d.tau, f"{prefix}/speedup": d.speedup,
                                f"{prefix}/tau_interval": d.tau_interval,
                                f"{prefix}/speedup_interval": d.speedup_interval})
            if d.vs_prompt_lookup is not None:  # throughput over prompt lookup's on the same prompts, paired
                run.summary.update({f"{prefix}/vs_prompt_lookup": d.vs_prompt_lookup["throughput_ratio"],
                                    f"{prefix}/vs_prompt_lookup_interval": d.vs_prompt_lookup["interval"]})
            if d.predicted_speedup is not None:  # the batch-1 loop's cost model; a batch sweep has none
                run.summary.update({f"{prefix}/predicted_speedup": d.predicted_speedup})
            if d.greedy_exact is not None:
                run.summary.update({f"{prefix}/greedy_exact": d.greedy_exact,
                                    f"{prefix}/greedy_ties": d.greedy_tie_count,
                                    f"{prefix}/greedy_mismatches": d.greedy_mismatch_count})
            table = wandb.Table(columns=["depth", "n_alpha", "cumulative_acceptance"])
            for depth, (a, c) in enumerate(zip(d.n_alpha or [], d.cumulative_acceptance or []), start=1):
                table.add_data(depth, a, c)
            run.log({f"{prefix}/acceptance": table})
        for set_name, by_size in (report.get("batch_sweep") or {}).items():
            # One row per batch size: speed-up over plain decoding at that size, and throughput.
            for size, entry in by_size.items():
                row = {"batch_size": int(size), f"{set_name}/plain/tokens_per_s": entry["plain"]["tokens_per_s"]}
                for name, d in entry["drafters"].items():
                    row.update({f"{set_name}/{name}/batch_speedup": d["speedup"],
                                f"{set_name}/{name}/batch_tokens_per_s": d["tokens_per_s"],
                                f"{set_name}/{name}/batch_tau": d["tau"]})
                run.log(row)
        for key, name in (("acceptance_curves", "acceptance.png"), ("speedup_vs_batch", "speedup_vs_batch.png")):
            if (out / name).is_file():
                run.log({key: wandb.Image(str(out / name))})
    finally:
        run.finish()
