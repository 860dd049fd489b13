"""The one decoding loop: plain, chain and tree (EAGLE-2) decoding of B prompts at once, B = 1 included.

Per round every active row gets a proposal from the batch's drafter (``decode/batch_draft.py``: the EAGLE-3 draft,
alone or in the hybrid, runs one batched forward per draft step; other drafters propose row by row), the verifier
checks every row's [root, proposal] in one forward (``VerifierSession``), each row accepts by the rules of
``decode/accept.py`` (greedy: the longest prefix or path that matches the argmax; sampling: Leviathan's rule, or
recursive rejection sampling down a tree), the session keeps each row's accepted entries, and the drafter is told
what each row committed, with the verifier's features of those positions. Rows advance by their own accepted
lengths; a row that reaches its stop token or its limit leaves the batch. Lossless per row: every output is
distributed as plain decoding's (greedy: equal to it, up to the verifier's own rounding).

A round's wall time is charged to its parts (``ROUND_PARTS``) for the whole batch; at batch 1 they are the row's.
The simple batch-1 loops this one replaced are the reference it is tested against (``tests/reference_decode.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fledge.decode.accept import (
    greedy_accept,
    greedy_from_top,
    greedy_tokens,
    leviathan_accept,
    pick_token,
    walk_greedy,
    walk_sampled,
)
from fledge.decode.batch_draft import batch_drafter
from fledge.decode.proposals import ChainDraft, Drafter, DraftTree, TreeShape
from fledge.decode.result import DecodeResult, RoundTimer, clock, stop_index
from fledge.decode.session import VerifierSession
from fledge.models.sampling import SamplingParams, target_probs

METHODS = ("plain", "chain", "tree")


@dataclass
class _Outcome:
    """What one row's round accepted."""

    new: list[int]
    """The committed tokens: the accepted drafts, then the verifier's own token."""
    kept: list[int]
    """Offsets into the row's block to keep (0 is the root)."""
    proposed: int
    """The longest draft path checked (a chain's length, a tree's depth)."""
    nodes: int
    """Draft tokens verified."""


@torch.inference_mode()
def generate(
    model: nn.Module,
    prompts: list[torch.Tensor],
    drafters: list[Drafter] | None = None,
    *,
    method: str = "plain",
    num_draft_tokens: int = 5,
    shape: TreeShape | None = None,
    max_new_tokens: int | list[int],
    sampling: SamplingParams = SamplingParams(),
    stop_ids: frozenset[int] = frozenset(),
    aux_layer_ids: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[list[DecodeResult], float]:
    """Decode every prompt [T_i] at once: ``plain`` (``drafters`` None), ``chain`` (``num_draft_tokens`` drafts a
    round) or ``tree`` (of ``shape``), one drafter per prompt. ``max_new_tokens``: one limit, or one per prompt.
    Returns each row's result (tokens cut after the first stop token, accepted per round, the batch's time by
    part) and the batch's wall time."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not prompts:
        raise ValueError("nothing to decode: no prompts")
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(limits) != len(prompts):
        raise ValueError(f"{len(limits)} limits for {len(prompts)} prompts")
    speculative = method != "plain"
    if speculative and (drafters is None or len(drafters) != len(prompts)):
        raise ValueError("speculative decoding needs one drafter per prompt")
    if method == "tree" and shape is None:
        raise ValueError("method=tree needs a TreeShape")
    if method == "tree" and not all(d.supports_tree for d in drafters):
        raise ValueError(f"{type(drafters[0]).__name__} cannot propose trees; use method=chain")
    batch = batch_drafter(drafters) if speculative else None
    needs_aux = batch is not None and batch.needs_aux
    if needs_aux and not aux_layer_ids:
        raise ValueError("these drafters read the verifier's aux hidden states: pass aux_layer_ids")
    device = model.get_input_embeddings().weight.device
    results = [DecodeResult(tokens=[]) for _ in prompts]
    timing = DecodeResult(tokens=[])
    start = clock(device)
    with VerifierSession(model, aux_layer_ids if needs_aux else None) as session:
        auxes = session.prefill(prompts)
        if batch is not None:
            batch.start([p.cpu() for p in prompts], auxes)
        prefill = clock(device) - start
        roots = [int(p[-1]) for p in prompts]
        active = [r for r in range(len(prompts)) if limits[r] > 0]
        if len(active) < len(prompts) and active:
            session.keep_rows(active)
            if batch is not None:
                batch.keep_rows(active)
        timer = RoundTimer(device, timing)
        while active:
            budgets = [limits[r] - len(results[r].tokens) - 1 for r in active]
            top = predicted = None
            if method == "plain":
                logits, aux = session.forward([torch.tensor([roots[r]]) for r in active])
                timer.lap("verify")
                outcomes = _plain_outcomes(logits, sampling, generator)
            else:
                if method == "chain":
                    drafts = batch.propose_chains([min(num_draft_tokens, b) for b in budgets], sampling, generator)
                else:
                    drafts = batch.propose_trees([shape.capped(b) if b > 0 else None for b in budgets], sampling,
                                                 generator)
                timer.lap("draft")
                inputs = [torch.cat([torch.tensor([roots[r]]), d.tokens.cpu()]) for r, d in zip(active, drafts)]
                timer.lap("other")
                logits, aux = session.forward(inputs, [d.parents for d in drafts] if method == "tree" else None)
                timer.lap("verify")
                if method == "tree" and batch.observe_top_k:
                    # The verifier's most likely next tokens at every checked row, root and nodes alike (token
                    # recycling: ``decode/recycle.py``); one top-k over the block for all rows, which gives the
                    # greedy walk its argmax too.
                    values, top = torch.topk(logits, min(batch.observe_top_k, logits.shape[-1]), dim=-1)
                    if sampling.greedy and top.shape[-1] > 1:
                        predicted = greedy_from_top(values, top, logits)
                    top = top.cpu()
                outcomes = [_chain_outcome(logits[i], d, sampling, generator, results[r]) if method == "chain"
                            else _tree_outcome(logits[i], d, sampling, generator,
                                               None if predicted is None else predicted[i])
                            for i, (r, d) in enumerate(zip(active, drafts))]
            timer.lap("accept")
            if top is not None:
                batch.observe([(x, top[i, : x.numel()]) for i, x in enumerate(inputs)])
                timer.lap("draft_update")
            session.commit([o.kept for o in outcomes])
            timer.lap("kv_update")
            going, updates = [], []
            for i, (r, o) in enumerate(zip(active, outcomes)):
                result = results[r]
                result.tokens.extend(o.new)
                roots[r] = o.new[-1]
                if speculative:
                    result.accepted.append(len(o.new) - 1)
                    result.proposed.append(o.proposed)
                    result.tree_nodes.append(o.nodes)
                if len(result.tokens) < limits[r] and stop_ids.isdisjoint(o.new):
                    going.append(i)
                    if batch is not None:
                        rows = torch.tensor(o.kept, device=session.device)
                        updates.append((torch.tensor(o.new), None if aux is None else aux[i, rows]))
            timer.lap("other")
            if len(going) < len(active):
                active = [active[i] for i in going]
                if not active:
                    break
                session.keep_rows(going)
                if batch is not None:
                    batch.keep_rows(going)
                timer.lap("kv_update")
            if batch is not None:
                batch.advance(updates)
                timer.lap("draft_update")
        timer.close()
    seconds = clock(device) - start
    for r, result in zip(range(len(prompts)), results):
        result.tokens = result.tokens[: stop_index(result.tokens, stop_ids, limits[r])]
        result.seconds, result.prefill_seconds, result.parts = seconds, prefill, dict(timing.parts)
        result.draft_seconds, result.verify_seconds = timing.draft_seconds, timing.verify_seconds
    return results, seconds


def decode_one(model: nn.Module, prompt: torch.Tensor, drafter: Drafter | None = None, **kwargs) -> DecodeResult:
    """``generate`` at batch 1: one prompt [T], its drafter (None: plain decoding unless ``method`` says otherwise)."""
    kwargs.setdefault("method", "plain" if drafter is None else "chain")
    results, _ = generate(model, [prompt], None if drafter is None else [drafter], **kwargs)
    return results[0]


def _plain_outcomes(logits: torch.Tensor, sampling: SamplingParams,
                    generator: torch.Generator | None) -> list[_Outcome]:
    if sampling.greedy:
        picked = greedy_tokens(logits[:, 0]).tolist()  # one transfer for all rows
    else:
        picked = [pick_token(row[0], sampling, generator) for row in logits]
    return [_Outcome(new=[token], kept=[0], proposed=0, nodes=0) for token in picked]


def _chain_outcome(logits: torch.Tensor, draft: ChainDraft, sampling: SamplingParams,
                   generator: torch.Generator | None, result: DecodeResult) -> _Outcome:
    """One row's chain: ``logits`` [q, V] of its block [root, d_1..d_k, padding]."""
    k = draft.tokens.numel()
    tokens = draft.tokens.to(logits.device)
    if sampling.greedy:
        accepted, token, predicted = greedy_accept(logits[: k + 1], tokens)
        if draft.top_ids is not None:
            result.topk_ranks += topk_ranks(predicted, draft.top_ids.to(logits.device), accepted)
            result.topk_width = int(draft.top_ids.shape[1])
    else:
        q = None if draft.q is None else draft.q.to(logits.device)
        accepted, token = leviathan_accept(target_probs(logits[: k + 1], sampling), tokens, q, generator)
    return _Outcome(new=draft.tokens[:accepted].tolist() + [token], kept=list(range(accepted + 1)), proposed=k,
                    nodes=k)


def _tree_outcome(logits: torch.Tensor, tree: DraftTree, sampling: SamplingParams,
                  generator: torch.Generator | None, predicted: torch.Tensor | None = None) -> _Outcome:
    """One row's tree: ``logits`` [q, V] of its block [root, nodes, padding]; greedy, ``predicted`` [q] its rows'
    argmax if known."""
    rows = logits[: tree.size + 1]
    if sampling.greedy:
        path, token = walk_greedy(rows, tree, None if predicted is None else predicted[: tree.size + 1])
    else:
        path, token = walk_sampled(rows, tree, sampling, generator)
    return _Outcome(new=tree.tokens[path].tolist() + [token], kept=[0] + [node + 1 for node in path],
                    proposed=int(tree.depths.max()) if tree.size else 0, nodes=tree.size)


def topk_ranks(predicted: torch.Tensor, top_ids: torch.Tensor, accepted: int) -> list[tuple[int, int]]:
    """(depth, rank of the verifier's token among the draft's top-k) for each depth the round reached: depths
    1..accepted+1, as far as there were drafts. A rank of k means "not among the top k"."""
    reached = min(accepted + 1, top_ids.shape[0])
    return list(enumerate(rank_among(top_ids[:reached], predicted[:reached]).tolist(), start=1))


def rank_among(top_ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[n] the 0-based rank of each of ``tokens`` [n] in its row of ``top_ids`` [n, k] (best first); k where absent."""
    hits = top_ids == tokens[:, None]
    return torch.where(hits.any(dim=1), hits.int().argmax(dim=1), torch.full_like(tokens, top_ids.shape[1]))

