"""Bugs injected into the speculative loops on purpose: the negative controls of greedy exactness.

Each bug is a context manager that patches the real loop (``decode/loop.py``, at batch 1 and batch B) the way a
plausible mistake would, and undoes it on exit. ``tests/test_exactness_real.py`` checks that every one is reported
as a mismatch on the default verifier, in float32 and in bf16. Run as a script, this module prints the table
(bug, loop, dtype → verdict) that docs/design.md quotes::

    .venv/bin/python tests/injected_bugs.py --prompts 8 --tokens 48
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from fledge.decode import accept as accept_mod
from fledge.decode import loop as loop_mod
from fledge.decode.accept import children_lists
from fledge.decode.session import VerifierSession


@contextlib.contextmanager
def _patched(*patches: tuple[object, str, object]) -> Iterator[None]:
    saved = [(owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name))
             for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


@contextlib.contextmanager
def rope_off_by_one(model: torch.nn.Module) -> Iterator[None]:
    """Every token a verification checks after its root sits one RoPE position too far (the root stays right).

    Patches the model's forward: a call over a non-empty cache with more than one token is a verification (the
    prefill has an empty cache; plain decoding feeds one token)."""
    original = model.forward

    def forward(*args, **kwargs):
        ids = kwargs.get("input_ids")
        cache = kwargs.get("past_key_values")
        if ids is not None and ids.shape[1] > 1 and cache is not None and cache.get_seq_length() > 0:
            positions = kwargs.get("position_ids")
            if positions is None:
                start = cache.get_seq_length()
                positions = torch.arange(start, start + ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
            positions = positions.clone()
            positions[:, 1:] += 1
            kwargs["position_ids"] = positions
        return original(*args, **kwargs)

    model.forward = forward
    try:
        yield
    finally:
        del model.forward


@contextlib.contextmanager
def stale_kv(model: torch.nn.Module) -> Iterator[None]:
    """After each verification one entry of the block that should go (a rejected draft's key/value) stays cached."""
    commit, forward = VerifierSession.commit, VerifierSession.forward

    def recording_forward(self, inputs, parents=None):
        self._sizes = [int(x.numel()) for x in inputs]
        return forward(self, inputs, parents)

    def buggy_commit(self, kept):
        sizes = getattr(self, "_sizes", None) or [0] * len(kept)
        commit(self, [k + [k[-1] + 1] if k[-1] + 1 < size else k for k, size in zip(kept, sizes)])

    with _patched((VerifierSession, "commit", buggy_commit), (VerifierSession, "forward", recording_forward)):
        yield


def _chain_accept(wrong_count: bool, wrong_bonus: bool) -> Callable:
    accept = accept_mod.greedy_accept

    def buggy(logits, draft_tokens):
        accepted, bonus, predicted = accept(logits, draft_tokens)
        if accepted < draft_tokens.numel():
            if wrong_count:
                accepted += 1  # the rejected draft counted as accepted
                bonus = int(predicted[accepted])
            if wrong_bonus:
                bonus = int(logits[accepted].topk(2).indices[1])  # the runner-up after a rejection
        return accepted, bonus, predicted

    return buggy


def _tree_walk(wrong_count: bool, wrong_bonus: bool) -> Callable:
    walk = accept_mod.walk_greedy

    def buggy(logits, tree, predicted=None):
        path, bonus = walk(logits, tree, predicted)
        row = path[-1] + 1 if path else 0
        kids = children_lists(tree.parents.tolist())[row]
        if kids:  # the verifier's token was none of this node's children: a rejection happened here
            if wrong_count:
                path = path + [kids[0]]  # the first child taken although it does not match
                row = kids[0] + 1
                bonus = int(torch.argmax(logits[row]))
            if wrong_bonus:
                bonus = int(logits[row].topk(2).indices[1])
        return path, bonus

    return buggy


@contextlib.contextmanager
def accept_one_more(model: torch.nn.Module) -> Iterator[None]:
    """At a rejection, the rejected draft (in a tree: the node's first child) is counted as accepted."""
    chain, tree = _chain_accept(True, False), _tree_walk(True, False)
    with _patched((loop_mod, "greedy_accept", chain), (loop_mod, "walk_greedy", tree)):
        yield


@contextlib.contextmanager
def wrong_residual(model: torch.nn.Module) -> Iterator[None]:
    """At a rejection, the token emitted instead is the verifier's runner-up there, not its argmax (greedy's residual
    with the wrong token taken out)."""
    chain, tree = _chain_accept(False, True), _tree_walk(False, True)
    with _patched((loop_mod, "greedy_accept", chain), (loop_mod, "walk_greedy", tree)):
        yield


BUGS: dict[str, Callable] = {
    "rope_off_by_one": rope_off_by_one,
    "stale_kv": stale_kv,
    "accept_one_more": accept_one_more,
    "wrong_residual": wrong_residual,
}


def loops(model, prompts: list[torch.Tensor], plain: list[list[int]], max_new: int, aux_ids: list[int],
          which: tuple[str, ...] = ("chain", "tree", "hybrid", "batched chain", "batched tree")
          ) -> dict[str, list[list[int]]]:
    """The loop's greedy outputs: at batch 1 (prompt by prompt), chain and tree with a drafter that knows plain
    decoding's output (so that long runs are accepted and rejected) and the hybrid (a random-init EAGLE-3 draft
    beside prompt lookup) as a tree; batched, chain and tree with all prompts in one batch."""
    from fledge.decode.drafters import EagleDrafter, HybridDrafter, PromptLookupDrafter
    from fledge.decode.loop import decode_one, generate
    from fledge.decode.proposals import TreeShape
    from fledge.models.draft import Eagle3Config, Eagle3Draft

    from test_spec_loop import ReferenceDrafter

    vocab = int(model.config.vocab_size)
    shape = TreeShape(depth=4, top_k=3, total_tokens=10)

    def reference(i):
        return ReferenceDrafter(len(prompts[i]), plain[i], seed=i, vocab_size=vocab)

    out: dict[str, list[list[int]]] = {}
    if "chain" in which:
        out["chain"] = [decode_one(model, p, reference(i), num_draft_tokens=4, max_new_tokens=max_new).tokens
                        for i, p in enumerate(prompts)]
    if "tree" in which:
        out["tree"] = [decode_one(model, p, reference(i), method="tree", shape=shape, max_new_tokens=max_new).tokens
                       for i, p in enumerate(prompts)]
    if "hybrid" in which:
        # The first 4,096 ids as the draft vocabulary: a real d2t mapping, and a head 12x cheaper than the full one.
        draft_vocab = min(vocab, 4096)
        config = Eagle3Config.from_verifier(model.config, draft_vocab_size=draft_vocab, aux_layer_ids=aux_ids)
        draft = Eagle3Draft(config, seed=0)
        draft.load_verifier_embedding(model.get_input_embeddings().weight.detach().float())
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[:draft_vocab] = True
        draft.set_draft_vocab(torch.zeros(draft_vocab, dtype=torch.long), t2d)
        draft = draft.to(next(model.parameters()).dtype).eval()
        out["hybrid"] = [decode_one(model, p, HybridDrafter(EagleDrafter(draft), PromptLookupDrafter()), method="tree",
                                    shape=shape, max_new_tokens=max_new, aux_layer_ids=aux_ids).tokens
                         for p in prompts]
    for method in ("chain", "tree"):
        if f"batched {method}" in which:
            results, _ = generate(model, prompts, [reference(i) for i in range(len(prompts))], method=method,
                                  num_draft_tokens=4, shape=shape, max_new_tokens=max_new)
            out[f"batched {method}"] = [r.tokens for r in results]
    return out


def verdicts(judge, prompts: list[torch.Tensor], plain: list[list[int]], outputs: dict[str, list[list[int]]]
             ) -> dict[str, dict]:
    """Per loop: outputs equal to plain, first differences judged tie/mismatch, and every position rechecked."""
    table = {}
    for name, tokens in outputs.items():
        firsts = [judge.judge(str(i), p, b, t) for i, (p, b, t) in enumerate(zip(prompts, plain, tokens)) if b != t]
        checks = [judge.recheck(str(i), p, t) for i, (p, t) in enumerate(zip(prompts, tokens))]
        table[name] = {
            "identical": sum(b == t for b, t in zip(plain, tokens)),
            "first_ties": sum(d.kind == "tie" for d in firsts),
            "first_mismatches": sum(d.kind == "mismatch" for d in firsts),
            "positions": sum(c.positions for c in checks),
            "recheck_ties": sum(len(c.ties) for c in checks),
            "recheck_mismatches": sum(len(c.mismatches) for c in checks),
            "tie_gaps": sorted(r["gap"] for c in checks for r in c.ties),
            "bands": sorted(b for c in checks for b in c.bands),
        }
    return table


def default_setup(dtype: str, n_prompts: int, max_new: int):
    """The default verifier in ``dtype``, ``n_prompts`` MT-bench first turns, and its plain greedy outputs."""
    from fledge.data.prompt_sets import load_prompts
    from fledge.eval.runner import encode_prompt
    from fledge.models.verifier import VerifierConfig, load_verifier
    from reference_decode import generate_plain

    verifier = load_verifier(VerifierConfig(dtype=dtype, linear_kernel="default"), decoding=True)
    prompts = [encode_prompt(verifier.tokenizer, {"id": p["id"], "turns": p["turns"][:1]})
               for p in load_prompts("mtbench", n_prompts)]
    plain = [generate_plain(verifier.model, p, max_new_tokens=max_new).tokens for p in prompts]
    return verifier, prompts, plain


def main() -> None:
    import argparse
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from fledge.eval.ties import TieJudge

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    print("dtype     bug              loop           identical  first: ties mism.  recheck: positions ties mism.  "
          "verdict   band median/p90/max (logits)")
    for dtype in args.dtypes.split(","):
        verifier, prompts, plain = default_setup(dtype, args.prompts, args.tokens)
        judge = TieJudge(verifier.model)
        for bug in ["none", *BUGS]:
            context = contextlib.nullcontext() if bug == "none" else BUGS[bug](verifier.model)
            with context:
                outputs = loops(verifier.model, prompts, plain, args.tokens, verifier.aux_layer_ids)
            for loop, v in verdicts(judge, prompts, plain, outputs).items():
                wrong = v["first_mismatches"] + v["recheck_mismatches"]
                verdict = "MISMATCH" if wrong else ("tie" if v["first_ties"] + v["recheck_ties"] else "exact")
                bands = v["bands"]
                band = "/".join(f"{bands[min(int(q * len(bands)), len(bands) - 1)]:.3g}" for q in (0.5, 0.9, 1.0))
                print(f"{dtype:<9} {bug:<16} {loop:<14} {v['identical']:>2}/{len(prompts):<6} "
                      f"{v['first_ties']:>10} {v['first_mismatches']:>5} {v['positions']:>19} "
                      f"{v['recheck_ties']:>4} {v['recheck_mismatches']:>5}  {verdict:<9} {band}", flush=True)
                if v["tie_gaps"]:
                    print(f"{'':<41}recheck tie gaps: {[round(g, 4) for g in v['tie_gaps']]}", flush=True)
        judge.close()


if __name__ == "__main__":
    main()
