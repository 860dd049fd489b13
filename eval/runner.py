"""Evaluate drafters on prompt sets: plain decoding as the baseline, then each drafter through the real loop.

Per prompt set and drafter the report holds τ, n-α per depth, the acceptance histogram, tokens/s, the measured
speed-up over the baseline, the speed-up Leviathan's formula predicts from α and the measured draft/verifier cost
ratio, the cost of one round in baseline steps, and (greedy) the rate of outputs equal to plain greedy decoding
token for token. It is written as JSON with a PNG of the acceptance curves.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from fledge.core.errors import ConfigError
from fledge.data.template import stop_token_ids
from fledge.decode.drafters import EagleDrafter, HybridDrafter
from fledge.decode.proposals import Drafter, TreeShape
from fledge.decode.result import ROUND_PARTS, DecodeResult
from fledge.eval.batch_eval import Decoded, decode_groups, hf_figures, plot_batch
from fledge.eval.breakdown import breakdown, first_tokens, in_draft_vocab, plot_breakdown
from fledge.eval.metrics import (
    REFERENCE_DRAFTER,
    acceptance_entry,
    bootstrap_interval,
    compare_with_reference,
    median,
    paired_throughput_ratio,
    predicted_speedup,
    throughput,
    topk_acceptance,
)
from fledge.eval.report import REPORT_FILE, REPORT_FORMAT, EvalReport
from fledge.eval.summary import one_line, plot_acceptance
from fledge.eval.ties import DEFAULT_TIE_TOLERANCE, TieJudge, greedy_outcome, recheck_summary
from fledge.eval.tune import CostModel, measure_verify_cost
from fledge.models.draft import Eagle3Config
from fledge.models.draft_folder import load_draft
from fledge.models.kernels import pack_linears
from fledge.models.sampling import SamplingParams
from fledge.models.serving import is_serving_checkpoint, load_exported
from fledge.models.verifier import Verifier, check_fingerprint

log = logging.getLogger(__name__)

METHODS = ("chain", "tree", "both")


@dataclass
class EvalConfig:
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed to the verifier's chat template with each prompt: the training data's (``data.chat_template_kwargs``;
    the qwen3-8b preset turns thinking off), so that the draft is measured on the kind of text it learned."""
    method: str = "chain"
    """How drafts are verified: ``chain`` (N drafts in a row), ``tree`` (EAGLE-2 dynamic tree) or ``both`` (each
    drafter that grows trees runs twice, as a chain under its name and as a tree under ``<name>-tree``, interleaved
    against one plain run). Drafters that cannot grow trees (prompt lookup) always run as chains."""
    num_draft_tokens: int = 5
    """N, drafts per chain round; also how deep the hybrid's prompt-lookup branch may reach in a tree round."""
    tree_depth: int = 6
    """Longest path of the draft's own tree in a tree round (the hybrid's lookup branch may reach
    max(tree_depth, num_draft_tokens): a depth-1 tree is the draft's top-k first tokens, plus a lookup branch)."""
    tree_top_k: int = 8
    """Children per expanded node and nodes expanded per level (EAGLE-2)."""
    tree_total_tokens: int = 48
    """Draft tokens kept per tree after reranking (the verifier checks this many + 1 per round)."""
    tree_sampled_children: bool = False
    """Sampling only: draw tree children without replacement from the draft (verified with q renormalisation)
    instead of EAGLE-2's deterministic top-k."""
    temperature: float = 0.0
    """0 is greedy decoding (and the greedy match rate is reported); > 0 samples."""
    top_p: float = 1.0
    """Nucleus sampling on the verifier's distribution."""
    top_k: int = 0
    """Top-k sampling on the verifier's distribution; 0 is off."""
    max_new_tokens: int = 128
    """Generation stops here or at the end-of-turn token, for the baseline and every drafter alike."""
    batch_size: Any = 1
    """Prompts decoded together, as a server batches requests: an int, or a list (``'[1,4,16,64]'``) to measure
    each drafter's speed-up over plain decoding at each batch size (``eval/batch_eval.py``: a table and
    ``speedup_vs_batch.png``). 1 alone runs the prompt-by-prompt evaluation with its round breakdown and the
    Hugging Face baseline."""
    max_prompts: int | None = None
    """Use only the first prompts of each set (None: all)."""
    time_limit_minutes: float | None = None
    """Stop starting prompts once the evaluation would run past this (None: no limit). Each prompt set gets an equal
    share of the time left when it starts, and a prompt starts only while the set's time so far plus its mean prompt
    time fits that share; every set runs at least one prompt. The prompts left out are counted in the report
    (``prompts_skipped``). Batch 1 only. The quickstart sets it from its budget, so that a box slower than its probe
    shortens the evaluation instead of overrunning the budget."""
    seed: int = 0
    """Sampling seed; each prompt restarts from it, so the baseline and each drafter see the same randomness."""
    warmup_tokens: int = 8
    """A short untimed generation per method first, so that one-time setup does not count as speed."""
    hf_baseline: bool = True
    """Also time Hugging Face ``generate`` on every prompt beside fledge's plain loop; speed-ups then divide by the
    faster of the two, prompt by prompt."""
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE
    """Greedy only: where a drafter's output parts from plain greedy decoding, the two competing tokens' float32
    logit gap counts as a numerical tie when it is within 2δ (δ: the rounding the evaluation's dtype measured at that
    position) plus this many eps·max(|l_a|, |l_b|), about an ulp of the two logits (``eval/ties.py``); beyond it, a
    mismatch, and ``fledge eval`` fails. The same band judges every position ``recheck`` checks."""
    recheck: bool = True
    """Greedy only: check every position of every output (plain decoding's too) against one float32 forward over it
    (``TieJudge.recheck``): a token that is not the verifier's argmax after its own prefix, beyond the tie band, is a
    mismatch, and ``fledge eval`` fails. A bf16 verifier is then copied to float32 once (twice its memory)."""
    first_token: bool = True
    """Report where the draft's first token fails on each prompt set (``eval/breakdown.py``): outside the draft
    vocabulary, among its 2nd..``tree_top_k``-th choices, where the verifier's own top-1 probability is below ½,
    or mispredicted; with agreement by the verifier's certainty and by position in the answer. One verifier and one
    draft forward per prompt over plain decoding's answer; needs an EAGLE-3 drafter (alone or in the hybrid)."""
    round_floor: bool = True
    """Measure v(k), the verifier's bare forward over the k tokens a round checks, and report how much a round
    costs beyond v(k) and its drafting (``round_overhead``)."""
    out_dir: str | None = "runs/eval"
    """Where report.json and acceptance.png go; None writes nothing."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"eval.method must be one of {METHODS}, got {self.method!r}")
        if self.num_draft_tokens < 1:
            raise ConfigError(f"eval.num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"eval.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.time_limit_minutes is not None and self.time_limit_minutes <= 0:
            raise ConfigError(f"eval.time_limit_minutes must be > 0 (or null), got {self.time_limit_minutes}")
        self.tree_shape()
        self.sampling()
        if self.batch_sizes() != [1] and self.time_limit_minutes is not None:
            raise ConfigError("eval.time_limit_minutes applies to the prompt-by-prompt evaluation (batch_size=1)",
                              fix="with a batch sweep leave it null and size the run by eval.max_prompts")

    def batch_sizes(self) -> list[int]:
        """``batch_size`` as an ascending list of distinct sizes."""
        raw = [self.batch_size] if isinstance(self.batch_size, (int, float, str)) else self.batch_size
        try:
            sizes = sorted({int(b) for b in raw if float(b) == int(b)})
        except (TypeError, ValueError):
            sizes = []
        if not sizes or sizes[0] < 1 or len(sizes) != len(set(raw)):
            raise ConfigError(f"eval.batch_size must be a size >= 1 or a list of them, got {self.batch_size!r}",
                              fix="e.g. eval.batch_size=16 or eval.batch_size='[1,4,16,64]'")
        return sizes

    def tree_shape(self) -> TreeShape:
        return TreeShape(
            depth=self.tree_depth,
            top_k=self.tree_top_k,
            total_tokens=self.tree_total_tokens,
            sampled_children=self.tree_sampled_children,
            lookup_depth=max(self.tree_depth, self.num_draft_tokens),
        )

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


def encode_prompt(tokenizer, prompt: dict, template_kwargs: dict[str, Any] | None = None) -> torch.Tensor:
    """The first turn as a user message in the verifier's chat template, ready for the assistant's answer
    (``template_kwargs``: the training data's, e.g. Qwen3's ``enable_thinking=False``)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt["turns"][0]}], add_generation_prompt=True, tokenize=False,
        **(template_kwargs or {}),
    )
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def load_eagle_drafter(path: str | Path, verifier: Verifier) -> EagleDrafter:
    """An ``EagleDrafter`` from a fledge training run / checkpoint or from an exported serving checkpoint (a folder
    whose config.json is a ``LlamaForCausalLMEagle3`` or speculators config), in the verifier's dtype and device."""
    path = Path(path)
    if is_serving_checkpoint(path):
        recorded = (json.loads((path / "config.json").read_text()).get("fledge") or {}).get("verifier_fingerprint")
        if recorded:
            check_fingerprint(verifier.path, recorded, f"the draft in {path}")
        draft = load_exported(path, verifier.path)
    else:
        draft = load_draft(path, verifier.path)  # refuses a verifier other than the one recorded at training
    problems = draft_verifier_mismatches(draft.config, verifier)
    if problems:
        raise ConfigError(f"the draft in {path} does not fit the verifier {verifier.name}: " + "; ".join(problems),
                          fix="evaluate the draft with the verifier it was trained for (verifier.name_or_path=...)")
    draft = draft.to(device=verifier.device, dtype=verifier.dtype)
    if verifier.linear_kernel == "onednn":
        pack_linears(draft)  # the draft's steps run the kernel the verifier's do
    return EagleDrafter(draft)


def draft_verifier_mismatches(config: Eagle3Config, verifier: Verifier) -> list[str]:
    """What keeps a draft from reading this verifier, each naming both sides; empty when it fits. The draft's own
    aux layer ids are the ones the loops capture, so they must exist in this verifier."""
    text = verifier.model.config
    text = text.get_text_config() if hasattr(text, "get_text_config") else text
    problems = []
    if config.target_hidden_size != int(text.hidden_size):
        problems.append(f"the draft reads hidden states {config.target_hidden_size} wide, the verifier's are "
                        f"{int(text.hidden_size)}")
    if config.vocab_size != int(text.vocab_size):
        problems.append(f"the draft's vocabulary has {config.vocab_size} tokens, the verifier's {int(text.vocab_size)}")
    layers = int(text.num_hidden_layers)
    outside = [i for i in config.aux_layer_ids if not 0 <= i <= layers]
    if outside:
        problems.append(f"the draft reads aux layers {list(config.aux_layer_ids)}, the verifier has hidden states "
                        f"0..{layers} only")
    return problems


def _with_methods(drafters: dict[str, Drafter | None], cfg: EvalConfig) -> tuple[list[tuple[str, Drafter]],
                                                                                 dict[str, str]]:
    """The (name, drafter) pairs to run and each one's method: ``eval.method=both`` adds ``<name>-tree`` for every
    drafter that grows trees (the same drafter: runs are sequential and ``start`` resets it)."""
    named: list[tuple[str, Drafter]] = []
    methods: dict[str, str] = {}
    for name, d in drafters.items():
        if d is None:
            continue
        if cfg.method == "both" and d.supports_tree:
            named += [(name, d), (f"{name}-tree", d)]
            methods.update({name: "chain", f"{name}-tree": "tree"})
        else:
            named.append((name, d))
            methods[name] = "tree" if cfg.method == "tree" and d.supports_tree else "chain"
    return named, methods


def evaluate(
    verifier: Verifier,
    prompts: list[dict] | dict[str, list[dict]],
    drafters: dict[str, Drafter | None],
    cfg: EvalConfig,
    meta: Callable[[], dict[str, Any]] | None = None,
) -> dict:
    """Run plain decoding and every drafter on every prompt set; returns the report (``eval/report.py``'s layout) and,
    with ``cfg.out_dir``, writes it there once, with its plots. ``meta``: the top-level fields the caller adds (the
    draft evaluated, the datastore's counters), asked for once decoding has ended.

    ``prompts``: one set [{"id", "turns"}] or {set name: set}. ``drafters``: {name: drafter}; a None drafter is
    plain decoding under that name. Everything runs in the verifier's own dtype: losslessness is judged against
    plain greedy decoding in that dtype (bf16 greedy itself differs from fp32 greedy).

    The methods are interleaved prompt by prompt (plain, Hugging Face ``generate``, then each drafter), so that a
    change of the machine's load hits them alike; speed-ups are per-prompt ratios, reported as their median with a
    bootstrap interval over prompts.
    """
    sets = prompts if isinstance(prompts, dict) else {"prompts": prompts}
    stop_ids = frozenset(stop_token_ids(verifier.tokenizer, getattr(verifier.model, "generation_config", None)))
    greedy = cfg.sampling().greedy
    report: dict = {
        "format": REPORT_FORMAT,
        "config": dataclasses.asdict(cfg),
        "verifier": {"name": verifier.name, "dtype": str(verifier.dtype).replace("torch.", ""),
                     "aux_layer_ids": verifier.aux_layer_ids, "device": str(verifier.device),
                     "linear_kernel": verifier.linear_kernel,
                     "attention": getattr(verifier.model.config, "_attn_implementation", None)},
        "stop_ids": sorted(stop_ids),
        "sets": {},
    }
    judge = TieJudge(verifier.model, cfg.tie_tolerance) if greedy else None
    named, methods = _with_methods(drafters, cfg)
    # The capture hooks a round pays for: those of the first drafter that reads the verifier's states.
    aux_ids = next((d.aux_layer_ids for _, d in named if d.needs_aux), None)
    batched = cfg.batch_sizes() != [1]
    deadline = None if cfg.time_limit_minutes is None else time.perf_counter() + 60 * cfg.time_limit_minutes
    for set_index, (set_name, set_prompts) in enumerate(sets.items()):
        encoded = [(p["id"], encode_prompt(verifier.tokenizer, p, cfg.chat_template_kwargs))
                   for p in set_prompts[: cfg.max_prompts]]
        if not encoded:
            raise ConfigError(f"prompt set {set_name!r} is empty", fix="check prompts and eval.max_prompts")
        if batched:
            set_report = _batched_set(verifier, set_name, encoded, named, methods, cfg, stop_ids, judge,
                                      report.setdefault("batch_sweep", {}))
        else:
            plain, hf, runs = decode_groups(verifier, [[ids] for _, ids in encoded], named, methods, cfg, stop_ids,
                                            f"eval {set_name}", fresh=False, deadline=deadline,
                                            sets_left=len(sets) - set_index)
            skipped = len(encoded) - len(plain.results)
            encoded = encoded[: len(plain.results)]
            base = _baseline_summary(plain, hf, greedy)
            if judge is not None and cfg.recheck:
                base["recheck"] = recheck_summary(judge, encoded, [r.tokens for r in plain.results])
            floors = (_round_floors(verifier, encoded[0][1], set(methods.values()), cfg, aux_ids)
                      if cfg.round_floor and named else None)
            set_report = _set_report(verifier, named, encoded, plain.results, cfg, base, skipped)
            for name, _ in named:
                entry = _drafter_summary(runs[name], plain.results, hf.results, [pid for pid, _ in encoded],
                                         methods[name], cfg, base, floors)
                if judge is not None:
                    entry.update(greedy_outcome(judge, encoded, runs[name].results, plain.results, cfg.recheck))
                set_report["drafters"][name] = entry
                log.info("%s / %s: %s", set_name, name, one_line(entry))
                print(f"[eval] {set_name} / {name}: {one_line(entry)}", flush=True)
            compare_with_reference(set_report["drafters"], {n: r.units for n, r in runs.items()})
        for name, drafter in drafters.items():
            if drafter is None:  # plain decoding under a drafter's name
                set_report["drafters"][name] = {"method": "plain", **set_report["baseline"]}
        report["sets"][set_name] = set_report
    if judge is not None:
        judge.close()
    report.update(meta() if meta is not None else {})
    if cfg.out_dir is not None:
        # the plots first, then the report (with where they are) in one write, made even if a plot fails
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        files = {"json": str(out / REPORT_FILE)}
        try:
            plot_acceptance(report, out / "acceptance.png")
            files["png"] = str(out / "acceptance.png")
            if plot_breakdown(report, out / "first_token.png"):
                files["first_token_png"] = str(out / "first_token.png")
            if batched:
                plot_batch(report, out / "speedup_vs_batch.png")
                files["batch_png"] = str(out / "speedup_vs_batch.png")
        finally:
            report["files"] = files
            EvalReport.from_json(report).save(out)
    return report


def _first_eagle(named: list[tuple[str, Drafter]]) -> EagleDrafter | None:
    """The first EAGLE-3 drafter among ``named``, alone or inside a hybrid; None without one."""
    return next((d if isinstance(d, EagleDrafter) else d.eagle for _, d in named
                 if isinstance(d, EagleDrafter | HybridDrafter)), None)


def draft_vocab_coverage(named: list[tuple[str, Drafter]], plain: list[DecodeResult]) -> float | None:
    """The share of plain decoding's tokens that the first EAGLE-3 drafter among ``named`` can propose at all (its
    draft vocabulary holds them), or None without one. A verifier token outside the draft vocabulary is rejected
    whatever the draft learnt, so this caps every depth's acceptance of the draft's own proposals."""
    eagle = _first_eagle(named)
    tokens = [t for r in plain for t in r.tokens]
    if eagle is None or not tokens:
        return None
    return float(in_draft_vocab(eagle, torch.tensor(tokens)).float().mean())


def _set_report(
    verifier: Verifier, named: list[tuple[str, Drafter]], encoded: list[tuple[Any, torch.Tensor]],
    plain: list[DecodeResult], cfg: EvalConfig, base: dict[str, Any], skipped: int = 0,
) -> dict[str, Any]:
    """A prompt set's entry before its drafters' (at batch 1 and batched alike): plain decoding's figures, the prompts
    the time limit left out, the draft vocabulary's coverage of plain's answers, where the draft's first token fails."""
    set_report: dict[str, Any] = {"num_prompts": len(encoded), "baseline": base, "drafters": {}}
    if skipped:
        set_report["prompts_skipped"] = skipped
    coverage = draft_vocab_coverage(named, plain)
    if coverage is not None:
        set_report["draft_vocab_coverage"] = coverage
    eagle = _first_eagle(named)
    if cfg.first_token and eagle is not None:
        # The first EAGLE-3 drafter's first token over plain's answers, its 2nd..k-th choices read at k = tree_top_k.
        records = []
        for (_, ids), result in tqdm(list(zip(encoded, plain)), desc="first-token breakdown", unit="prompt",
                                     leave=False):
            records += first_tokens(verifier.model, eagle, ids, result.tokens, cfg.tree_top_k)
        set_report["first_token"] = breakdown(records, cfg.tree_top_k)
    return set_report


def _batched_set(
    verifier: Verifier, set_name: str, encoded: list[tuple[Any, torch.Tensor]], named: list[tuple[str, Drafter]],
    methods: dict[str, str], cfg: EvalConfig, stop_ids: frozenset[int], judge: TieJudge | None, sweep: dict[str, Any],
) -> dict[str, Any]:
    """The batch sweep of one prompt set into ``sweep``: {str(B): {"plain": {...}, "drafters": {name: entry}}}, with
    each drafter's rows checked against plain's with ``judge`` (greedy); and the set's usual entry from its smallest
    batch size."""
    by_size: dict[str, dict[str, Any]] = sweep.setdefault(set_name, {})
    plain: list[DecodeResult] = []
    for size in cfg.batch_sizes():
        groups = [[ids for _, ids in encoded[i : i + size]] for i in range(0, len(encoded), size)]
        decoded, hf, runs = decode_groups(verifier, groups, named, methods, cfg, stop_ids, f"eval batch {size}",
                                          fresh=True)
        plain = plain or decoded.results  # the smallest batch size's answers
        entry: dict[str, Any] = {"batch_size": size, "groups": len(groups), "plain": throughput(decoded.units),
                                 "drafters": {}}
        plain_units = decoded.units
        if hf.results:
            entry["plain"]["hf_generate"] = hf_figures(decoded.results, hf, cfg.sampling().greedy)
            hf_rate = entry["plain"]["hf_generate"]["tokens_per_s"]
            # fledge's batched plain tokens/s over generate's at the same B: below 1, generate is the faster baseline.
            entry["plain"]["baseline_vs_hf"] = entry["plain"]["tokens_per_s"] / hf_rate if hf_rate else math.nan
            # Speed-ups divide by the faster of the two baselines, group by group, as at batch 1.
            plain_units = [p if not h[1] or (p[1] and p[0] / p[1] >= h[0] / h[1]) else h
                           for p, h in zip(decoded.units, hf.units)]
        for name, _ in named:
            results = runs[name].results
            d, _, per_prompt_tau = acceptance_entry(results, methods[name], cfg.num_draft_tokens, cfg.tree_depth)
            # Pooled over the groups, with an interval over groups resampled in pairs with plain's.
            speedup, (lo, hi) = paired_throughput_ratio(runs[name].units, plain_units)
            group_speedups = [paired_throughput_ratio([u], [p])[0] for u, p in zip(runs[name].units, plain_units)]
            d.update(**throughput(runs[name].units), speedup=speedup, speedup_interval=[lo, hi],
                     median_group_speedup=median([x for x in group_speedups if not math.isnan(x)]),
                     # Per prompt as at batch 1 (``fledge sweep compare`` pairs them): its rounds, and the speed-up
                     # of the group it was decoded in (a row of a batch has no time of its own).
                     per_prompt=[{"id": pid, "tokens": len(r.tokens), "rounds": rounds, "committed": committed,
                                  "speedup": group_speedups[i // size], "group": i // size}
                                 for i, ((pid, _), r, (committed, rounds)) in
                                 enumerate(zip(encoded, results, per_prompt_tau))])
            if judge is not None:
                d.update(greedy_outcome(judge, encoded, results, decoded.results, cfg.recheck))
            entry["drafters"][name] = d
        compare_with_reference(entry["drafters"], {name: r.units for name, r in runs.items()})
        by_size[str(size)] = entry
        for name, d in entry["drafters"].items():
            lo, hi = d["speedup_interval"]
            vs = d.get(f"vs_{REFERENCE_DRAFTER}")
            paired = "" if vs is None else (f", {vs['throughput_ratio']:.2f}x prompt lookup's "
                                            f"[{vs['interval'][0]:.2f}, {vs['interval'][1]:.2f}]")
            print(f"[eval] {set_name} / batch {size} / {name}: {d['method']} tau {d['tau']:.2f}, "
                  f"{d['tokens_per_s']:.1f} tok/s against plain {entry['plain']['tokens_per_s']:.1f}, "
                  f"speed-up {d['speedup']:.2f}x [{lo:.2f}, {hi:.2f}]{paired}", flush=True)
    smallest = by_size[str(cfg.batch_sizes()[0])]
    base = {**smallest["plain"], "batch_size": smallest["batch_size"], "divides_by": "fledge plain decoding, batched"}
    set_report = _set_report(verifier, named, encoded, plain, cfg, base)
    for name, d in smallest["drafters"].items():
        set_report["drafters"][name] = {**d, "batch_size": smallest["batch_size"]}
    return set_report


def _round_floors(
    verifier: Verifier, prompt_ids: torch.Tensor, methods: set[str], cfg: EvalConfig, aux_ids: list[int] | None
) -> CostModel:
    """v(k), the bare forward's cost over k tokens in plain decoding steps, measured on the first prompt's KV cache
    with the loop's capture hooks: for every k a chain can check, and spread up to the largest tree."""
    ks = set()
    if "chain" in methods:
        ks |= set(range(1, cfg.num_draft_tokens + 2))
    if "tree" in methods:
        top = cfg.tree_total_tokens + 1 + cfg.tree_shape().branch_depth  # a hybrid's lookup branch adds nodes
        ks |= {1, 2, max(2, top // 4), max(2, top // 2), top}
    return CostModel(verify_steps=measure_verify_cost(verifier.model, prompt_ids, sorted(ks), aux_ids), draft_step=0.0)


def _tokens_per_s(result: DecodeResult) -> float:
    return len(result.tokens) / result.seconds if result.seconds else 0.0


def _median_with_interval(values: list[float]) -> tuple[float, list[float]]:
    lo, hi = bootstrap_interval(values, median)
    return median(values), [lo, hi]


def _baseline_summary(plain: Decoded, hf: Decoded, greedy: bool) -> dict:
    summary = throughput(plain.units)
    steps = summary["tokens"]  # the prefill leaves the prompt's last token to the first step
    # One decoding step of the verifier (prefill excluded): the unit every cost below is measured in.
    summary["step_seconds"] = sum(r.verify_seconds for r in plain.results) / steps if steps else 0.0
    summary["divides_by"] = "fledge plain decoding"
    if hf.results:
        ratios = [_tokens_per_s(p) / _tokens_per_s(h) for p, h in zip(plain.results, hf.results) if _tokens_per_s(h)]
        summary["hf_generate"] = hf_figures(plain.results, hf, greedy)
        # fledge's plain tokens/s over generate's, prompt by prompt: below 1 means generate is the faster baseline.
        summary["baseline_vs_hf"], summary["baseline_vs_hf_interval"] = _median_with_interval(ratios)
        summary["divides_by"] = "the faster of fledge plain decoding and Hugging Face generate, per prompt"
    return summary


def _drafter_summary(
    run: Decoded, plain: list[DecodeResult], hf: list[DecodeResult], prompt_ids: list, method: str, cfg: EvalConfig,
    base: dict, floors: CostModel | None,
) -> dict:
    results = run.results
    entry, trace, per_prompt_tau = acceptance_entry(results, method, cfg.num_draft_tokens, cfg.tree_depth)
    num_draft = trace.num_draft
    pooled = throughput(run.units)
    rounds = max(len(trace.accepted), 1)
    drafted = sum(trace.offered())
    step = base["step_seconds"]
    draft_seconds = sum(r.draft_seconds for r in results)
    verify_seconds = sum(r.verify_seconds for r in results)
    # c = cost of drafting one token / cost of one verifier step, both measured in this run.
    cost_ratio = (draft_seconds / drafted) / step if drafted and step else 0.0
    # Per prompt: this drafter's tokens/s over the baseline's on the same prompt, run right before it.
    baselines = [max(_tokens_per_s(p), _tokens_per_s(h)) for p, h in zip(plain, hf)] if hf else [
        _tokens_per_s(p) for p in plain]
    ratios = [_tokens_per_s(r) / b if b else math.nan for r, b in zip(results, baselines)]
    speedup, speedup_interval = _median_with_interval([x for x in ratios if not math.isnan(x)])
    parts = {part: sum(r.parts.get(part, 0.0) for r in results) / rounds / step if step else 0.0
             for part in ROUND_PARTS}
    entry.update(
        **pooled,
        speedup=speedup,
        speedup_interval=speedup_interval,
        # The older pooled figure: all tokens over all seconds, against fledge's plain loop alone.
        speedup_pooled=pooled["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0,
        cost_ratio=cost_ratio,
        predicted_speedup=predicted_speedup(entry["alpha"], num_draft, cost_ratio),
        verifier_calls=len(trace.accepted),
        mean_tree_nodes=sum(n for r in results for n in r.tree_nodes) / rounds,
        # What one round costs in plain decoding steps: verification (forward, acceptance, cache rollback) and
        # drafting; per-round overhead on a small verifier decides whether speculation pays at all.
        verify_cost_in_steps=verify_seconds / rounds / step if step else 0.0,
        draft_cost_in_steps=draft_seconds / rounds / step if step else 0.0,
        round_parts_in_steps=parts,
        round_cost_in_steps=sum(parts.values()),
        per_prompt=[
            {"id": pid, "tokens": len(r.tokens), "seconds": r.seconds, "rounds": len(r.accepted),
             "committed": committed, "baseline_tokens_per_s": b, "speedup": x}
            for pid, r, b, x, (committed, _) in zip(prompt_ids, results, baselines, ratios, per_prompt_tau)
        ],
    )
    if floors is not None:
        # The floor of each round: the bare forward over the k tokens it checked (its drafts and the root; fewer
        # than N + 1 when a drafter offered fewer), plus the drafting it cannot avoid.
        checked = [n + 1 for r in results for n in r.tree_nodes]
        verify_floor = sum(floors.verify(k) for k in checked) / max(len(checked), 1)
        floor_steps = verify_floor + parts["draft"] + parts["draft_update"]
        entry["round_floor"] = {"mean_k": sum(checked) / max(len(checked), 1), "verify_steps": verify_floor,
                                "floor_steps": floor_steps,
                                "v": {str(k): v for k, v in sorted(floors.verify_steps.items())}}
        entry["round_overhead"] = entry["round_cost_in_steps"] / floor_steps - 1.0 if floor_steps else math.nan
    if method == "tree":
        # What a tree round did, by depth, and its predicted speed-up (the chain formulas do not apply to trees). A
        # round's accepted path has one length (``histogram``); ``reached_depth[d-1]`` is the fraction of rounds whose
        # path reached depth d, so E = 1 + Σ_d reached_depth is the tokens per round. The round costs v(k) for the k =
        # nodes + 1 tokens it verified (measured, ``round_floor``; 1 when ``eval.round_floor`` is off) plus its
        # drafting (depth expansion steps, measured): predicted = E / (v(k) + drafting). The measured speed-up falls
        # short of it by the loop's own overhead (acceptance, cache compaction, bookkeeping: ``round_overhead``).
        reached = entry["cumulative_acceptance"]
        expected = 1.0 + sum(reached)
        verify = entry["round_floor"]["verify_steps"] if floors is not None else 1.0
        cost = verify + entry["draft_cost_in_steps"]
        entry.update(expected_tokens_per_call=expected, predicted_speedup=expected / cost if cost else 0.0,
                     tree={"path_length_histogram": entry["histogram"], "reached_depth": reached,
                           "mean_nodes": entry["mean_tree_nodes"], "expansion_cost_in_steps": entry["cost_ratio"],
                           "verify_steps": verify, "verify_measured": floors is not None,
                           "predicted_round_cost_in_steps": cost})
    ranks = [pair for r in results for pair in r.topk_ranks]
    if ranks:
        entry["topk_acceptance"] = topk_acceptance(ranks, num_draft, max(r.topk_width for r in results))
        # Round by round, for models that combine the draft with what else a round could propose (fledge tune's
        # hybrid): the output, each round's accepted and proposed counts, and its ranks (min(accepted + 1, proposed)
        # of them), from which each round's start in the output follows.
        entry["topk_rounds"] = [{"tokens": r.tokens, "accepted": r.accepted, "proposed": r.proposed,
                                 "ranks": [rank for _, rank in r.topk_ranks]} for r in results]
    return entry
