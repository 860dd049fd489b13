"""A time budget for the quickstart: measure this box, then size every stage to fit.

``fledge quickstart budget_minutes=20`` measures three rates on the machine it runs on (the verifier's cached
forward in tokens/s, the draft's training step in token-passes/s at the quickstart's shapes, plain decoding in
tokens/s), then chooses how many conversations to cache, how many epochs to train and how many prompts to evaluate
so that the whole pipeline ends within the budget. A fast box gets more data and steps, not an earlier finish.

The draft's shape follows the plan too: its vocabulary holds the tokens the planned training shows often enough to
learn (``VOCAB_MIN_PASSES``: a token's count in the planned conversations' answers times the epochs), so a larger
budget, which trains on more conversations, gets a larger vocabulary; the training rate is measured again at that
vocabulary and the sizes refitted (``fit_shapes``).

The plan is revised as the run goes: after the cache, training's share is recomputed from the time left and the
cache's actual speed (a box slower than its probe is slower for training too), and training runs for that share of
the time (``train.time_budget_minutes``, its cosine following the time spent, its epochs an upper bound); after
training, the number of eval prompts is recomputed the same way. ``budget.json`` in the run
folder records the plan and each revision, so that a rerun reuses it (and skips the finished stages) instead of
measuring again; ``fledge quickstart`` prints the plan before starting and plan-vs-actual at the end.

Fixed sizes stay available: a size given as a stage override (``cache:data.max_conversations=400``) is kept and
the planner sizes the rest around it; ``budget_minutes=null`` uses the fixed sizes of ``FIXED_SIZES``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable

import torch

from fledge.core.errors import ConfigError
from fledge.core.files import atomic_write_text, renamed_file, retire_old_name
from fledge.eval.sweeps import BUDGET_FILE, OLD_BUDGET_FILE

log = logging.getLogger(__name__)

SIZE_KEYS = {"cache": "data.max_conversations", "train": "train.epochs", "eval": "eval.max_prompts"}
"""The size each stage gets from the plan (a stage override of the same key fixes it)."""
FIXED_SIZES = {"cache": 160, "train": 2.0, "eval": 8}
"""The sizes without a budget (``budget_minutes=null``): ~20 minutes on a 2-core AVX2 box."""
SHAPE_KEYS = {"draft_vocab_size": ("cache", "cache.draft_vocab_size")}
"""The draft's shapes the plan chooses: {shape: (stage, key)}; the user's own value of the key (or of
``train.draft_vocab_size``) fixes it."""
FIXED_SHAPES = {"draft_vocab_size": 4096}
"""The shapes without a budget, and where the plan starts: the draft's output layer is most of a training step, and
at the 20-minute quickstart's training 4,096 tokens covered what the draft could learn (8,192 did not raise tau:
docs/experiments/2026-12-04-draft-levers.md)."""
VOCAB_MIN_PASSES = 80
"""A token earns a place in the draft vocabulary when the planned training shows it at least this often (count in the
planned conversations' loss positions x epochs). At twice the 20-minute quickstart's training, the tokens 8,192
added to 4,096 were each seen 31-73 times, and 8,192 did not beat 4,096
(docs/experiments/2026-12-05-vocab-by-budget.md): so a token must be seen more often than that, every budget
measured here keeps 4,096, and the vocabulary grows only where training shows its tokens more often than any run
here did (an assumption, not yet a measurement)."""
VOCAB_GRAIN, VOCAB_FLOOR, VOCAB_CEIL = 1024, 4096, 32768
"""The vocabulary is a multiple of ``VOCAB_GRAIN`` between these bounds (and at most the verifier's). The floor is the
vocabulary measured at the smallest budgets: the rule grows it, never shrinks it below what was measured."""

MIN_BUDGET_MINUTES = 3.0
"""Below this, loading the verifier, probing and one evaluation prompt alone take the budget: refused at once."""
PLAN_FRACTION = 0.95
"""The plan fills this share of the budget; the rest absorbs what the rates do not predict (the cache's speed)."""
REVISED_FRACTION = 0.99
"""After the cache, the share of the budget the revision fills: training and the evaluation are sized by time from
then on (each ends on its clock), so the plan's margin goes to training rather than to an evaluation that grew into
it (25 % of the 20-minute budget instead of its 15 %: docs/experiments/2026-12-06-time-sized-training.md)."""
DECODE_PROBE_RUNS = 3
"""Short greedy decodes the probe times; the fastest counts."""
PROBE_CONVERSATIONS = 5000
"""Conversations tokenized up front (their exact lengths size the cache); no budget on a CPU caches more."""
MIN_CONVERSATIONS = 16
"""The held-out slice (8) and at least two micro-batches of training conversations."""
EPOCHS = 2.0
"""Passes over the cached conversations while the source has more to cache. At the 20-minute quickstart on a 2-core
AMX Xeon, 1.5, 2.4 and 4.2 epochs (over 1,684, 1,260 and 1,082 conversations) gave the same MT-bench tau within
what 24 prompts resolve (docs/experiments/2026-12-07-epochs-or-data.md)."""
MAX_EPOCHS = 8.0
TIME_CAP = 2.0
"""Stages sized by time may run up to this many times their predicted size: training its epochs
(``train_overrides``), the evaluation its prompts (``revise_prompts``)."""
MIN_PROMPTS, MAX_PROMPTS = 4, 80
EVAL_SHARE = 0.15
"""Of the budget, what the evaluation takes: as many prompts as fit in it, at least ``MIN_PROMPTS``. The quickstart's
own table checks the pipeline and shows the draft's rough figures (a measurement to compare drafts by is ``fledge
eval`` on 24 prompts or more); the rest of the budget goes to the draft. Before 2026-12-06 the evaluation took at
least 8 prompts, which on the 20-minute quickstart was 37 % of the budget (425 of 1,200 s)."""
# Per-stage costs that do not scale with the sizes (process start, loading, the dtype probe, writing the report,
# measuring v(k)), in seconds; calibrated on the 2-core AVX2 box from plan-vs-actual
# (docs/experiments/2026-12-01-budget-and-levers.md). Training's: the stage took 4 s more than its loop in both
# quickstarts sized by time (docs/experiments/2026-12-06-time-sized-training.md); 25 s before.
STAGE_FIXED_S = {"cache": 20.0, "train": 10.0, "eval": 45.0, "export": 5.0}
BUDGET_FORMAT = 2
"""The layout of the run folder's ``budget.json`` (``BudgetPlan``); 2 added ``shapes``."""


@dataclass
class BoxRates:
    """What the probe measured on this box."""

    cache_tokens_per_s: float
    """The verifier's forward with the aux layers captured, over real length-sorted batches."""
    train_tokens_per_s: float
    """The draft's training step (forward, TTT unroll, backward, AdamW) at the quickstart's shapes."""
    decode_tokens_per_s: float
    """Plain greedy decoding with a KV cache (the evaluation's unit of work)."""
    train_dtype: str
    probe_seconds: float


@dataclass
class BudgetPlan:
    budget_s: float
    rates: BoxRates
    conversation_tokens: list[int]
    """Token counts of the source's usable conversations, in the cache's order (the probe tokenized them)."""
    eval_rows: int
    """Decodings per eval prompt: plain, Hugging Face generate, and each drafter."""
    eval_new_tokens: int
    sizes: dict[str, float] = field(default_factory=dict)
    predicted_s: dict[str, float] = field(default_factory=dict)
    actual_s: dict[str, float] = field(default_factory=dict)
    fixed: dict[str, bool] = field(default_factory=dict)
    """Sizes (and shapes) the user gave as overrides (kept as they are)."""
    shapes: dict[str, int] = field(default_factory=dict)
    """The draft's shapes for the run (``SHAPE_KEYS``), e.g. {"draft_vocab_size": 4096}."""
    shape_notes: list[str] = field(default_factory=list)
    """How the shapes were chosen (``fit_shapes``)."""
    revisions: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    key: str = ""
    """The budget and stage overrides the plan was made for (a rerun with the same ones reuses it)."""
    format: int = BUDGET_FORMAT
    """The file's layout (``BUDGET_FORMAT``; a plan without one, written before, has format 1's fields)."""

    # ---- cost model
    def cache_s(self, conversations: int) -> float:
        tokens = sum(self.conversation_tokens[:conversations])
        return STAGE_FIXED_S["cache"] + tokens / self.rates.cache_tokens_per_s

    def train_s(self, conversations: int, epochs: float, rate: float | None = None) -> float:
        tokens = sum(self.conversation_tokens[:conversations])
        return STAGE_FIXED_S["train"] + epochs * tokens / (rate or self.rates.train_tokens_per_s)

    def eval_s(self, prompts: int, rate: float | None = None) -> float:
        per_prompt = self.eval_rows * self.eval_new_tokens / (rate or self.rates.decode_tokens_per_s)
        return STAGE_FIXED_S["eval"] + prompts * per_prompt

    def elapsed(self) -> float:
        return time.time() - self.started

    # ---- persistence
    def save(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(asdict(self), indent=1))

    def save_in(self, run_dir: Path) -> None:
        """Write the run folder's ``budget.json`` (an older ``plan.json`` there is removed)."""
        self.save(Path(run_dir) / BUDGET_FILE)
        retire_old_name(run_dir, OLD_BUDGET_FILE)

    @staticmethod
    def file_in(run_dir: str | Path) -> Path:
        """The run folder's plan: ``budget.json``, or ``plan.json`` in a folder of fledge before 2026-12-05."""
        return renamed_file(run_dir, BUDGET_FILE, OLD_BUDGET_FILE)

    @classmethod
    def load(cls, path: Path) -> BudgetPlan:
        """A plan a quickstart wrote; a later format than this fledge knows, or fields it does not, are refused."""
        record = json.loads(path.read_text())
        version = record.setdefault("format", 0)
        known = {f.name for f in fields(cls)}
        if not isinstance(version, int) or version > BUDGET_FORMAT or set(record) - known:
            raise ConfigError(
                f"{path} is a budget plan of format {version!r} (this fledge reads up to {BUDGET_FORMAT})"
                + (f" with fields it does not know: {', '.join(sorted(set(record) - known))}"
                   if set(record) - known else ""),
                fix="rerun the quickstart with force=true (a new probe and plan), or with the fledge that wrote it",
            )
        record["rates"] = BoxRates(**record["rates"])
        record["format"] = BUDGET_FORMAT
        return cls(**record)


def check_budget(minutes: float | None) -> None:
    """Refuse a budget that cannot hold one training step, before anything runs."""
    if minutes is not None and minutes < MIN_BUDGET_MINUTES:
        raise ConfigError(
            f"budget_minutes={minutes:g} is below the minimum of {MIN_BUDGET_MINUTES:g} minutes (loading and probing "
            "the verifier, one training step and one evaluation prompt)",
            fix=f"give budget_minutes >= {MIN_BUDGET_MINUTES:g}, or budget_minutes=null for the fixed sizes",
        )


def fit_budget(budget_minutes: float, rates: BoxRates, conversation_tokens: list[int], eval_rows: int,
              eval_new_tokens: int, fixed: dict[str, float]) -> BudgetPlan:
    """Sizes for cache, train and eval that fill ``PLAN_FRACTION`` of the budget; ``fixed`` sizes are kept."""
    plan = BudgetPlan(budget_minutes * 60, rates, conversation_tokens, eval_rows, eval_new_tokens,
                fixed={stage: True for stage in fixed})
    usable = plan.budget_s * PLAN_FRACTION - rates.probe_seconds - STAGE_FIXED_S["export"]
    # Eval: the prompts that fit in EVAL_SHARE of the budget (its fixed costs apart), at least MIN_PROMPTS.
    per_prompt = plan.eval_s(1) - STAGE_FIXED_S["eval"]
    prompts = fixed.get("eval") or min(MAX_PROMPTS, max(MIN_PROMPTS, int(EVAL_SHARE * plan.budget_s / per_prompt)))
    # Cache and train: EPOCHS over as many conversations as fit; more epochs once the source runs out.
    epochs = fixed.get("train") or EPOCHS
    left = usable - plan.eval_s(int(prompts))
    if "cache" in fixed:
        conversations = int(fixed["cache"])
    else:
        conversations = _fit_conversations(plan, left, epochs)
        if conversations < MIN_CONVERSATIONS and "eval" not in fixed:
            prompts = MIN_PROMPTS
            left = usable - plan.eval_s(prompts)
            conversations = _fit_conversations(plan, left, epochs)
    if conversations < MIN_CONVERSATIONS:
        need = (rates.probe_seconds + STAGE_FIXED_S["export"] + plan.eval_s(MIN_PROMPTS)
                + plan.cache_s(MIN_CONVERSATIONS) + plan.train_s(MIN_CONVERSATIONS, epochs)) / PLAN_FRACTION / 60
        raise ConfigError(
            f"budget_minutes={budget_minutes:g} holds fewer than {MIN_CONVERSATIONS} conversations on this box "
            f"(cache {rates.cache_tokens_per_s:.0f} tokens/s, training {rates.train_tokens_per_s:.0f} tokens/s, "
            f"decoding {rates.decode_tokens_per_s:.1f} tokens/s); the minimum here is {math.ceil(need)} minutes",
            fix=f"give budget_minutes >= {math.ceil(need)}",
        )
    if "train" not in fixed and conversations >= len(conversation_tokens):
        spare = left - plan.cache_s(conversations) - STAGE_FIXED_S["train"]
        epochs = min(MAX_EPOCHS, max(epochs, spare / (sum(conversation_tokens) / rates.train_tokens_per_s)))
    plan.sizes = {"cache": conversations, "train": round(epochs, 2), "eval": int(prompts)}
    plan.predicted_s = {"probe": rates.probe_seconds, "cache": plan.cache_s(conversations),
                        "train": plan.train_s(conversations, epochs), "eval": plan.eval_s(int(prompts)),
                        "export": STAGE_FIXED_S["export"]}
    return plan


def _fit_conversations(plan: BudgetPlan, seconds: float, epochs: float) -> int:
    """The most conversations (in cache order) whose cache and ``epochs`` of training fit in ``seconds``."""
    r = plan.rates
    cost = STAGE_FIXED_S["cache"] + STAGE_FIXED_S["train"]
    n = 0
    for tokens in plan.conversation_tokens:
        cost += tokens / r.cache_tokens_per_s + epochs * tokens / r.train_tokens_per_s
        if cost > seconds:
            break
        n += 1
    return n


def draft_vocab_for(counts: torch.Tensor, epochs: float, min_passes: float | None = None) -> int:
    """The draft vocabulary that planned training can learn: the tokens whose ``counts`` (loss positions in the
    planned conversations) times ``epochs`` reach ``min_passes``, rounded to ``VOCAB_GRAIN`` and kept within
    ``VOCAB_FLOOR``..``VOCAB_CEIL`` and the verifier's vocabulary (``min_passes``: ``VOCAB_MIN_PASSES``)."""
    min_passes = VOCAB_MIN_PASSES if min_passes is None else min_passes
    if epochs <= 0 or min_passes <= 0:
        raise ValueError(f"epochs ({epochs}) and min_passes ({min_passes}) must be > 0")
    learnable = int((counts.to(torch.float64) * epochs >= min_passes).sum())
    size = VOCAB_GRAIN * round(learnable / VOCAB_GRAIN)
    return min(max(size, VOCAB_FLOOR), VOCAB_CEIL, counts.numel())


def step0_gain(step0_share: float, ttt_steps: int) -> float:
    """How many more token-passes ``ttt.step0_share`` buys than the probe's price of a step (the whole unroll)
    predicts: its first share runs step 0 alone, up to ``ttt_steps`` times cheaper a step, so 1 + share (steps - 1)
    as an upper bound (at 0.35 and TTT 3 the 60-minute quickstart trained 1.6x its plan's token-passes)."""
    return 1.0 + step0_share * (ttt_steps - 1)


def fit_shapes(
    plan: BudgetPlan, refit: Callable[[BoxRates], BudgetPlan], counts_for: Callable[[int], torch.Tensor],
    rate_at: Callable[[int], float], vocab: int, fixed: bool = False, passes_gain: float = 1.0,
) -> BudgetPlan:
    """The draft vocabulary for ``plan`` (made at ``vocab``): ``draft_vocab_for`` the conversations and epochs it
    plans, the epochs times ``passes_gain`` (``step0_gain``: the passes a cheaper start adds); where that differs,
    the training rate measured at it (``rate_at``) and the sizes refitted (``refit``), twice at most (a slower step
    plans fewer token-passes, which may want a smaller vocabulary again). ``fixed``: the user's vocabulary, kept.
    The result's ``shapes`` hold the choice, ``shape_notes`` the steps taken."""
    if passes_gain < 1.0:
        raise ValueError(f"passes_gain must be >= 1, got {passes_gain}")
    notes = []
    if not fixed:
        for _ in range(2):
            epochs = plan.sizes["train"] * passes_gain
            want = draft_vocab_for(counts_for(int(plan.sizes["cache"])), epochs)
            if want == vocab:
                break
            begun = time.perf_counter()
            rate = rate_at(want)  # the measurement's seconds count as the probe's
            rates = replace(plan.rates, train_tokens_per_s=rate,
                            probe_seconds=plan.rates.probe_seconds + time.perf_counter() - begun)
            note = (f"draft vocabulary {vocab} -> {want} (tokens seen >= {VOCAB_MIN_PASSES} times in "
                    f"{epochs:.2f} epochs' passes over {int(plan.sizes['cache'])} conversations; training "
                    f"{plan.rates.train_tokens_per_s:.0f} -> {rates.train_tokens_per_s:.0f} tokens/s)")
            plan, vocab = refit(rates), want
            notes.append(note)
    plan.shapes, plan.shape_notes = {"draft_vocab_size": int(vocab)}, notes
    plan.fixed = {**plan.fixed, **({"draft_vocab_size": True} if fixed else {})}
    return plan


def revise_epochs(plan: BudgetPlan, cached_tokens: int, cache_seconds: float) -> float:
    """After the cache: the epochs that fill the time left (``REVISED_FRACTION`` of the budget less the evaluation's
    share), with the training rate scaled by how the cache's real speed compared with its prediction, and training's
    predicted seconds (``train_overrides`` turns them into the stage's share of the budget). Epochs the user fixed
    stay."""
    slowdown = min(2.0, max(0.5, cache_seconds / plan.predicted_s["cache"]))
    rate = plan.rates.train_tokens_per_s / slowdown
    eval_s = plan.eval_s(int(plan.sizes["eval"]), plan.rates.decode_tokens_per_s / slowdown)
    left = (plan.budget_s * REVISED_FRACTION - plan.elapsed() - eval_s - STAGE_FIXED_S["export"]
            - STAGE_FIXED_S["train"])
    epochs = plan.sizes["train"]
    if not plan.fixed.get("train"):
        epochs = round(min(MAX_EPOCHS, max(0.1, left * rate / max(cached_tokens, 1))), 2)
    seconds = STAGE_FIXED_S["train"] + epochs * cached_tokens / rate
    plan.revisions.append(f"after cache ({cache_seconds:.0f} s, {slowdown:.2f}x its prediction): train.epochs "
                          f"{plan.sizes['train']} -> {epochs} ({seconds:.0f} s predicted)")
    plan.sizes["train"], plan.predicted_s["train"] = epochs, seconds
    return epochs


def train_overrides(plan: BudgetPlan, step0_share: float = 0.0, ttt_steps: int = 1) -> list[str]:
    """How training keeps to its share of the budget. Planned epochs: the run is sized by time
    (``train.time_budget_minutes``: its predicted seconds less its fixed costs), its cosine follows the time spent,
    and the epochs become an upper bound ``TIME_CAP`` times the prediction (within ``MAX_EPOCHS``), so that a box
    faster than predicted trains longer instead of leaving the time unused. The probe prices a step at the whole
    unroll: with ``ttt.step0_share`` (its first share at step 0 alone, up to ``ttt_steps`` times cheaper a step) the
    bound grows by ``step0_gain(step0_share, ttt_steps)``, so that the cheaper steps do not eat the room a faster box
    needs (the 20-minute quickstart trained 1.4x the token-passes with 0.35 at TTT 3). Epochs the user fixed: those,
    with ``train.time_limit_minutes`` 10 % above the prediction as a safety net. The same plan gives the same
    overrides (a rerun skips a finished training)."""
    seconds = plan.predicted_s["train"]
    if plan.fixed.get("train"):
        return [f"train.time_limit_minutes={1.1 * seconds / 60:.2f}"]
    cap = min(MAX_EPOCHS, max(plan.sizes["train"], TIME_CAP * step0_gain(step0_share, ttt_steps) * plan.sizes["train"]))
    return [f"train.time_budget_minutes={max(seconds - STAGE_FIXED_S['train'], 1.0) / 60:.2f}",
            f"train.epochs={cap:.2f}"]


def revise_prompts(plan: BudgetPlan, train_seconds: float) -> int:
    """After training: the evaluation runs for the time the whole budget has left. The prompts that fit in it at
    the probe's decoding rate (scaled by how training's real speed compared with its prediction, and no faster than
    the probe's) times ``TIME_CAP`` are its upper bound, at least ``MIN_PROMPTS``, at most ``MAX_PROMPTS``; the
    evaluation's time limit (``eval_time_limit``) ends it, a prompt starting only while it fits. The count at the
    probe's rate errs high or low by a quarter with the box and the draft (a good draft's rounds decode faster than
    plain decoding), so the time decides, as for training, and the plan's margin (``PLAN_FRACTION``) is not kept
    back here. Returns the upper bound (``eval.max_prompts``)."""
    slowdown = min(2.0, max(0.5, train_seconds / plan.predicted_s["train"]))
    rate = min(plan.rates.decode_tokens_per_s, plan.rates.decode_tokens_per_s / slowdown)
    if plan.fixed.get("eval"):
        return int(plan.sizes["eval"])
    left = plan.budget_s - plan.elapsed() - STAGE_FIXED_S["export"] - STAGE_FIXED_S["eval"]
    per_prompt = plan.eval_s(1, rate) - STAGE_FIXED_S["eval"]
    prompts = int(min(MAX_PROMPTS, max(MIN_PROMPTS, math.ceil(TIME_CAP * left / per_prompt))))
    if prompts != plan.sizes["eval"]:
        plan.revisions.append(f"after train ({train_seconds:.0f} s, {slowdown:.2f}x its prediction): "
                              f"eval.max_prompts {plan.sizes['eval']} -> {prompts} (the time left decides)")
    plan.sizes["eval"] = prompts
    plan.predicted_s["eval"] = min(plan.eval_s(prompts, rate), STAGE_FIXED_S["eval"] + max(left, per_prompt))
    return prompts


def eval_time_limit(plan: BudgetPlan) -> float:
    """Minutes the evaluation may take (``eval.time_limit_minutes``): what the budget has left after its fixed
    costs and the export; at least half a minute (every prompt set still runs one prompt)."""
    left = plan.budget_s - plan.elapsed() - STAGE_FIXED_S["eval"] - STAGE_FIXED_S["export"]
    return max(left, 30.0) / 60


def plan_lines(plan: BudgetPlan) -> list[str]:
    r = plan.rates
    tokens = sum(plan.conversation_tokens[: int(plan.sizes["cache"])])
    lines = [
        f"fledge quickstart — plan for {plan.budget_s / 60:g} minutes on this box "
        f"(probe {r.probe_seconds:.0f} s: cache {r.cache_tokens_per_s:.0f} tokens/s, training "
        f"{r.train_tokens_per_s:.0f} tokens/s in {r.train_dtype}, decoding {r.decode_tokens_per_s:.1f} tokens/s)",
        f"  cache   {int(plan.sizes['cache'])} conversations, {tokens:,} tokens"
        f"{'  (fixed)' if plan.fixed.get('cache') else ''}",
        f"  train   {plan.sizes['train']} epochs, {plan.sizes['train'] * tokens:,.0f} token-passes"
        f"{'  (fixed)' if plan.fixed.get('train') else ''}",
        *([f"  draft   vocabulary {plan.shapes['draft_vocab_size']:,}"
           f"{'  (fixed)' if plan.fixed.get('draft_vocab_size') else ''}"] if plan.shapes else []),
        f"  eval    {int(plan.sizes['eval'])} prompts x {plan.eval_new_tokens} tokens x {plan.eval_rows} decodings"
        f"{'  (fixed)' if plan.fixed.get('eval') else ''}",
        f"  predicted {sum(plan.predicted_s.values()) / 60:.1f} minutes",
        *[f"  chose {note}" for note in plan.shape_notes],
    ]
    return lines


def plan_vs_actual(plan: BudgetPlan) -> list[str]:
    lines = ["stage       planned s  actual s"]
    for stage, predicted in plan.predicted_s.items():
        actual = plan.actual_s.get(stage)
        lines.append(f"{stage:<11} {predicted:9.0f}  {'-' if actual is None else f'{actual:8.0f}'}")
    total = sum(plan.actual_s.values())
    lines.append(f"{'total':<11} {sum(plan.predicted_s.values()):9.0f}  {total:8.0f}   "
                 f"(budget {plan.budget_s:.0f} s: {total / plan.budget_s:.0%} used)")
    lines += [f"revised {r}" for r in plan.revisions]
    return lines


@dataclass
class Probe:
    """What ``probe_box`` measured, and what the planner needs to choose the draft's shapes."""

    rates: BoxRates
    lengths: list[int]
    """Token counts of the source's usable conversations, in the cache's order."""
    samples: list[Any]
    """Those conversations, tokenized with their loss masks (``data/template.py: Tokenized``)."""
    rate_at: Callable[[int], float]
    """The training rate (token-passes/s) at another draft vocabulary, measured like the probe's."""
    vocab_size: int
    """The verifier's vocabulary."""

    def counts_for(self, conversations: int) -> torch.Tensor:
        """int64 [verifier vocabulary]: each token's loss positions in the first ``conversations`` (counted as the
        cache counts them for its draft vocabulary)."""
        from fledge.data.vocab import count_tokens

        return count_tokens(self.samples[:conversations], self.vocab_size)


def probe_box(cache_job: Any, train_job: Any, eval_job: Any, conversations: int | None = None) -> Probe:
    """Measure the three rates on this box with the stages' own code and shapes (~45 s on a 2-core CPU), and the
    token count and loss mask of each usable conversation of the source, in the cache's order: the first
    ``conversations`` (a size the user fixed) or up to ``PROBE_CONVERSATIONS``."""
    import dataclasses

    from fledge.core.dist import DistInfo, pick_device
    from fledge.core.host_memory import keep_freed_memory
    from fledge.data.cache_bench import bare_forward
    from fledge.data.cache_job import prepare
    from fledge.data.prompt_sets import load_prompts
    from fledge.decode.loop import decode_one
    from fledge.eval.runner import encode_prompt
    from fledge.models.verifier import load_verifier
    from fledge.train.bench import TrainBenchConfig, bench_dtype
    from fledge.train.engine import choose_train_dtype

    start = time.perf_counter()
    device = pick_device(cache_job.cache.device)
    keep_freed_memory(device)  # the cache and training stages run under it: measure their rates under it too
    limit = conversations or PROBE_CONVERSATIONS
    job = dataclasses.replace(cache_job, data=dataclasses.replace(cache_job.data, max_conversations=limit))
    prep = prepare(job, DistInfo(), device)
    lengths = [len(s.input_ids) for s in prep.samples]

    # The cache: the verifier's forward over real batches of the cache's own plan, spread over its lengths.
    batches = [b for shard in prep.plan.shards for b in shard]
    bare_forward(prep, batches[:1])
    picked, tokens = [], 0
    for batch in batches[:: max(1, len(batches) // 8)]:
        picked.append(batch)
        tokens += sum(lengths[i] for i in batch)
        if tokens >= 2000:
            break
    cache_rate = tokens / bare_forward(prep, picked)

    # Training: one step (after one untimed, which also compiles where train.compile is on) at the run's shapes, in
    # the dtype train.dtype=auto will pick.
    hf = prep.verifier.model.config
    heads = hf.num_attention_heads
    draft_vocab = min(train_job.train.draft_vocab_size or cache_job.cache.draft_vocab_size, hf.vocab_size)
    dtype = choose_train_dtype(train_job.train.dtype, device, (512, hf.hidden_size, draft_vocab))
    bench = TrainBenchConfig(
        hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size, num_attention_heads=heads,
        num_key_value_heads=getattr(hf, "num_key_value_heads", heads),
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads, target_hidden_size=hf.hidden_size,
        vocab_size=hf.vocab_size, draft_vocab_size=draft_vocab,
        seq_len=max(4, int(sorted(lengths)[len(lengths) // 2])),
        ttt_steps=train_job.ttt.ttt_steps, steps=1, warmup=1, dtypes=[dtype], batch_size=2,
        compile=train_job.train.compile, attention=train_job.ttt.attention, loss_chunk=train_job.ttt.loss_chunk,
    )

    def rate_at(vocab: int) -> float:
        return bench_dtype(dataclasses.replace(bench, draft_vocab_size=vocab), dtype)["tokens_per_s"]

    train_rate = rate_at(draft_vocab)
    vocab_size, prep_samples = int(hf.vocab_size), prep.samples
    del prep

    # Decoding: plain greedy with a KV cache, in the kernel the evaluation decodes with.
    verifier = load_verifier(eval_job.verifier, device, decoding=True)
    prompt = encode_prompt(verifier.tokenizer, load_prompts(eval_job.prompts[0], 1)[0])
    decode_one(verifier.model, prompt, max_new_tokens=4)
    # The fastest of three short runs: a shared box's neighbours stall a 2-thread decode for whole seconds, and one
    # stalled run would size the evaluation (and refuse the budget) as if the box were that slow for good.
    decode_rate = 0.0
    for _ in range(DECODE_PROBE_RUNS):
        result = decode_one(verifier.model, prompt, max_new_tokens=16)
        steps = len(result.tokens)  # one step per token after the prefill (the first feeds the prompt's last token)
        decode_rate = max(decode_rate, steps / max(result.seconds - result.prefill_seconds, 1e-9))
    del verifier
    rates = BoxRates(cache_rate, train_rate, decode_rate, dtype, time.perf_counter() - start)
    log.info("budget probe: %s", rates)
    return Probe(rates, lengths, prep_samples, rate_at, vocab_size)
