"""``fledge tune``: measure a draft once at a long chain, predict every chain length and tree shape, recommend the
fastest (plain decoding included), then measure the recommendation on the same prompts.

    fledge tune draft=runs/train
    fledge tune draft=/tmp/qs/train max_prompts=2 max_new_tokens=32
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fledge.core.errors import ConfigError
from fledge.data.prompt_sets import load_prompts
from fledge.decode.drafters import PromptLookupDrafter
from fledge.decode.proposals import TreeShape
from fledge.eval.datastore import load_datastore
from fledge.eval.report import EvalReport, TuneReport
from fledge.eval.roster import DrafterSettings
from fledge.eval.runner import EvalConfig, encode_prompt, evaluate, load_eagle_drafter
from fledge.eval.tune import (
    PLAIN,
    Candidate,
    CostModel,
    Position,
    candidates,
    format_table,
    hybrid_chain_candidate,
    hybrid_tree_candidate,
    measure_tree_draft_seconds,
    measure_verify_cost,
    measured_positions,
    overhead_from_run,
    recommend,
    tree_width,
)
from fledge.models.verifier import VerifierConfig, load_verifier

log = logging.getLogger(__name__)


@dataclass
class TuneJobConfig(DrafterSettings):
    """``fledge tune``: the drafter keys (``prompt_lookup_max_ngram``, ``hybrid*``, ``draft_min_prob``) are
    ``DrafterSettings``' (``eval/roster.py``), the same as ``fledge eval``'s, and the check (step 4) runs the drafter
    eval would run with them. The measurement run drafts full chains (no ``draft_min_prob``) so that α is measured at
    every depth, and the predictions model the hybrid's root lookup branch with full draft chains:
    ``draft_min_prob``, ``hybrid_draft_tokens``, ``hybrid_extend`` and ``hybrid_lookup_nodes`` show in the check."""

    draft: str = "runs/train"
    """A ``fledge train`` output dir, one of its step folders, or an exported serving checkpoint."""
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    prompts: list[str] = field(default_factory=lambda: ["mtbench"])
    """Prompt sources (as in ``fledge eval``); their prompts are pooled, the first ``max_prompts`` used."""
    max_prompts: int = 8
    max_new_tokens: int = 64
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """As ``eval.chat_template_kwargs``: the training data's chat-template settings, with each prompt."""
    n_max: int = 8
    """The chain length of the measurement run: α is measured at depths 1..n_max, chains up to it predicted."""
    tree_shapes: list[TreeShape] = field(default_factory=lambda: [
        TreeShape(1, 2, 2), TreeShape(1, 4, 4), TreeShape(2, 4, 6), TreeShape(2, 4, 8), TreeShape(3, 2, 4),
        TreeShape(3, 4, 8), TreeShape(3, 4, 12), TreeShape(4, 4, 16), TreeShape(6, 8, 48),
    ])
    """EAGLE-2 tree shapes to predict; the last is EAGLE-2's default. Depth-1 trees (the draft's top-k first tokens
    in one verifier pass, no draft forward beyond the root) are what a short run's draft affords on a CPU, where
    checking a few tokens costs about one step and the draft is seldom right past its first token; d=2 k=4 T=6 and
    d=3 k=4 T=8 add the likeliest second and third tokens to the four first ones, for drafts trained with a 2- or
    3-step unroll; d=3 k=4 T=12 is the quickstart's own (docs/experiments/2026-12-06-deeper-tree.md)."""
    verify_repeats: int = 5
    """Timed repeats per k when measuring v(k) (the median is kept)."""
    warmup_tokens: int = 8
    fit_round_overhead: bool = False
    """Add o = (the N_max run's verification cost per round) - v(N_max + 1) to every round. Off by default: that
    run's cost is a mean over whatever else the machine was doing, which v(k)'s minimum filters out, so on a shared
    CPU o soaks up other processes' load (measured here once: o = 5.8 steps predicted 0.13x for a chain that then
    ran at 0.59x). On a quiet machine it adds the loop's bookkeeping beyond the bare forward."""
    num_draft_tokens: int = 5
    """The longest lookup branch of a hybrid tree, as ``eval.num_draft_tokens`` in ``fledge eval`` (tree rounds);
    the chains tune predicts run up to ``n_max``."""
    measure_plain: bool = True
    """When plain decoding is recommended, still measure the best speculative shape so its prediction is checked."""
    out_dir: str | None = "runs/tune"
    """Where tune.json and the two eval reports go; None writes nothing."""

    def __post_init__(self) -> None:
        if self.n_max < 1 or self.num_draft_tokens < 1:
            raise ConfigError(f"n_max and num_draft_tokens must be >= 1, got {self.n_max}, {self.num_draft_tokens}")
        if self.max_prompts < 1 or self.max_new_tokens < 1:
            raise ConfigError(f"max_prompts and max_new_tokens must be >= 1, got {self.max_prompts}, "
                             f"{self.max_new_tokens}")


def _eval_config(cfg: TuneJobConfig, out: str | None, **shape: Any) -> EvalConfig:
    return EvalConfig(max_new_tokens=cfg.max_new_tokens, max_prompts=cfg.max_prompts,
                      warmup_tokens=cfg.warmup_tokens, chat_template_kwargs=dict(cfg.chat_template_kwargs), out_dir=out,
                      **shape)


def _shape_kwargs(choice: Candidate) -> dict[str, Any]:
    if choice.method == "tree":
        assert choice.tree is not None
        branch = dict(num_draft_tokens=choice.branch) if choice.hybrid else {}
        return dict(method="tree", tree_depth=choice.tree.depth, tree_top_k=choice.tree.top_k,
                    tree_total_tokens=choice.tree.total_tokens, **branch)
    return dict(method="chain", num_draft_tokens=choice.num_draft_tokens)


def hybrid_positions(records: list[dict[str, Any]], prompt_ids: list[torch.Tensor], lookup: PromptLookupDrafter,
                     branch: int) -> list[list[Position]]:
    """Per prompt of the chain measurement, what a hybrid round would see at each position of its output: the
    lookup reads the prompt and then the output token by token, proposing at every position."""
    out = []
    for record, ids in zip(records, prompt_ids):
        tokens = record["tokens"]
        lookup.start(ids, None)
        found = []
        for t in range(len(tokens)):
            found.append(lookup.continuation([], branch).tolist())
            lookup.advance(torch.tensor(tokens[t: t + 1], dtype=torch.long), None)
        out.append(measured_positions(record["ranks"], record["accepted"], record["proposed"], found, tokens))
    return out


def _candidate_json(c: Candidate) -> dict[str, Any]:
    return {**dataclasses.asdict(c), "predicted_speedup": c.predicted_speedup}


def run(cfg: TuneJobConfig) -> dict[str, Any]:
    if cfg.hybrid:
        cfg.check_node_cost()  # before any work, not at the check that uses it
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    verifier = load_verifier(cfg.verifier, device, decoding=True)  # dtype auto: bf16 where fast, else fp32
    dtype = str(verifier.dtype).removeprefix("torch.")
    drafter = load_eagle_drafter(cfg.draft, verifier)
    prompts = [p for source in cfg.prompts for p in load_prompts(source)][: cfg.max_prompts]
    if not prompts:
        raise ConfigError(f"no prompts in {cfg.prompts}", fix="check prompts")
    out = Path(cfg.out_dir) if cfg.out_dir is not None else None

    # 1. One chain run at n_max: α per depth, c, and the verification cost per round of the real loop.
    #    It also records where the verifier's token ranks among the draft's top-k at each depth: the trees' β.
    measure_cfg = _eval_config(cfg, str(out / "measure") if out else None, method="chain",
                               num_draft_tokens=cfg.n_max)
    drafter.rank_top_k = max(s.top_k for s in cfg.tree_shapes)
    measured = EvalReport.from_json(evaluate(verifier, {"tune": prompts}, {"eagle3": drafter}, measure_cfg))
    drafter.rank_top_k = 0
    entry = measured.sets["tune"].drafters["eagle3"]
    assert entry.n_alpha is not None
    topk = entry.figures.get("topk_acceptance")
    step_seconds = measured.sets["tune"].baseline["step_seconds"]

    # 2. v(k) on a real prompt's KV cache, for every k a candidate verifies.
    encoded = [encode_prompt(verifier.tokenizer, p, cfg.chat_template_kwargs) for p in prompts]
    prompt_ids = encoded[0]
    ks = list(range(1, cfg.n_max + 2)) + [s.total_tokens + 1 for s in cfg.tree_shapes]
    verify_steps = measure_verify_cost(verifier.model, prompt_ids, ks, drafter.aux_layer_ids, cfg.verify_repeats)
    bare = CostModel(verify_steps=verify_steps, draft_step=entry.figures["cost_ratio"])
    residual = overhead_from_run(entry.figures["verify_cost_in_steps"], cfg.n_max, bare)
    overhead = residual if cfg.fit_round_overhead else 0.0
    cost = dataclasses.replace(bare, round_overhead=overhead)

    # 3. c_tree per shape: a whole tree proposal timed, per expansion step, in baseline steps.
    trees = []
    for shape in cfg.tree_shapes:
        seconds = measure_tree_draft_seconds(verifier.model, drafter, prompt_ids, shape, drafter.aux_layer_ids)
        trees.append((shape, seconds / shape.depth / step_seconds if step_seconds else 0.0))

    options = candidates(entry.n_alpha, cost, cfg.n_max, trees, topk)
    lookup = None
    if cfg.hybrid and entry.figures.get("topk_rounds"):
        store = (load_datastore(cfg.hybrid_datastore, verifier.tokenizer, fingerprint=verifier.fingerprint)
                 if cfg.hybrid_datastore is not None else None)
        lookup = cfg.lookup(store)
        branch = max([cfg.num_draft_tokens, cfg.n_max] + [s.depth for s in cfg.tree_shapes])
        positions = hybrid_positions(entry.figures["topk_rounds"], encoded, lookup, branch)
        options += [hybrid_chain_candidate(positions, n, cost) for n in range(1, cfg.n_max + 1)]
        options += [hybrid_tree_candidate(positions, shape, max(shape.depth, cfg.num_draft_tokens), cost, c_tree)
                    for shape, c_tree in trees]
    choice = recommend(options)
    alphas = " ".join("-" if a is None else f"{a:.2f}" for a in entry.n_alpha)
    widths = sorted({tree_width(s) for s in cfg.tree_shapes}) if topk else []  # β_d(w) at the trees' widths
    lines = [
        "",
        f"[tune] measured at chain N={cfg.n_max} on {len(prompts)} prompts ({dtype}): n-α {alphas}",
        *(f"[tune] top-{w} acceptance per depth (trees of width {w}): "
          + " ".join("-" if row is None else f"{row[min(w, len(row)) - 1]:.2f}" for row in topk) for w in widths),
        f"[tune] c = {cost.draft_step:.3f} steps per draft token, round overhead o = {overhead:.3f} steps "
        f"(the N={cfg.n_max} run's verification exceeded v({cfg.n_max + 1}) by {residual:.3f}), "
        f"v(k) = " + " ".join(f"{k}:{v:.2f}" for k, v in sorted(verify_steps.items())),
        "[tune] c_tree = " + ", ".join(f"{s.depth}x{s.top_k}x{s.total_tokens}: {c:.3f}" for s, c in trees),
        *format_table(options, choice),
        f"[tune] recommended: {choice.name} (predicted {choice.predicted_speedup:.2f}x)",
    ]
    print("\n".join(lines), flush=True)

    # 4. Measure the recommendation (or, when plain wins, the best speculative shape) on the same prompts.
    check = choice
    if choice is PLAIN and cfg.measure_plain:
        check = recommend([o for o in options if o is not PLAIN])
    verification: dict[str, Any] | None = None
    if check is not PLAIN:
        check_cfg = _eval_config(cfg, str(out / "check") if out else None, **_shape_kwargs(check))
        name = "eagle3+lookup" if check.hybrid else "eagle3"
        if check.hybrid:  # recycled branches (hybrid_recycle) are not predicted, only checked
            recycle = cfg.recycle_table(verifier.tokenizer, int(verifier.model.config.vocab_size),
                                        verifier.fingerprint)
            checker = cfg.hybrid_of(drafter.draft, lookup.datastore, recycle, cfg.node_cost(cost.verify_steps))
        else:
            checker = cfg.eagle(drafter.draft)
        checked = EvalReport.from_json(evaluate(verifier, {"tune": prompts}, {name: checker}, check_cfg))
        d = checked.sets["tune"].drafters[name]
        assert d.speedup is not None and d.tau is not None
        verification = {"shape": check.name, "predicted_speedup": check.predicted_speedup,
                        "measured_speedup": d.speedup, "tau": d.tau,
                        "predicted_tokens_per_round": check.expected_tokens,
                        "measured_round_cost": d.figures["verify_cost_in_steps"] + d.figures["draft_cost_in_steps"],
                        "predicted_round_cost": check.round_cost,
                        "greedy_match_rate": d.figures.get("greedy_match_rate")}
        print(f"[tune] {check.name}: predicted {check.predicted_speedup:.2f}x, measured {d.speedup:.2f}x; "
              f"tokens/round predicted {check.expected_tokens:.2f}, measured τ {d.tau:.2f}; round cost predicted "
              f"{check.round_cost:.2f}, measured {verification['measured_round_cost']:.2f} steps", flush=True)
    report = TuneReport(
        config=dataclasses.asdict(cfg),
        dtype=dtype,
        draft=str(cfg.draft),
        measurement={"n_max": cfg.n_max, "n_alpha": entry.n_alpha, "tau": entry.tau,
                     "speedup": entry.speedup, "cost_ratio": entry.figures["cost_ratio"], "topk_acceptance": topk,
                     "verify_cost_in_steps": entry.figures["verify_cost_in_steps"], "step_seconds": step_seconds},
        cost_model={"verify_steps": {str(k): v for k, v in sorted(verify_steps.items())},
                    "draft_step": cost.draft_step, "round_overhead": overhead,
                    "measured_round_residual": residual,
                    "tree_draft_step": {f"{s.depth}x{s.top_k}x{s.total_tokens}": c for s, c in trees}},
        candidates=[_candidate_json(o) for o in options],
        recommended=_candidate_json(choice),
        verification=verification,
    )
    result = report.to_json()
    if out is not None:
        result["file"] = str(report.save(out))
    return result
