"""``python -m fledge.eval.datastore_bench``: what the datastore of the verifier's own answers adds to prompt lookup,
measured in seconds and without a model: greedy lookup rounds over held-out shipped answers (their prompts and the
verifier's own answers, so the rounds are the ones decoding would make), the datastore built from the others.

    python -m fledge.eval.datastore_bench                 # datastore_holdout lines: τ and tokens proposed per round
    python -m fledge.eval.datastore_bench --min-ngram 3   # another table
    python -m fledge.eval.datastore_bench --alternatives 4 16   # rows with other occurrences' continuations
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from fledge.core.errors import ConfigError
from fledge.decode.drafters import PromptLookupDrafter
from fledge.eval.datastore import NgramDatastore, answer_token_ids
from fledge.eval.tune import matched


def simulate_lookup(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], lookup: PromptLookupDrafter,
                    num_tokens: int = 5, max_new_tokens: int = 128, alternatives: int = 0) -> dict[str, float]:
    """Greedy speculative rounds of a lookup drafter alone over known answers, without a model: each round proposes
    a continuation of (prompt + the answer so far), accepts its prefix that matches the answer, and commits that
    prefix and the next answer token. ``pairs``: (prompt ids, answer ids) where the answer is the verifier's greedy
    one, so the rounds are the ones decoding would make. With ``alternatives`` the round is a tree: the latest
    continuation plus that many tokens of other occurrences' (``PromptLookupDrafter.alternatives``, as the hybrid's
    ``lookup_nodes``), accepting its longest path that matches. Returns τ and the tokens proposed per round."""
    tokens = rounds = proposed = 0
    for prompt, answer in pairs:
        answer = list(answer[:max_new_tokens])
        lookup.start(torch.tensor(list(prompt), dtype=torch.long), None)
        t = 0
        while t < len(answer):
            guesses = [lookup.continuation([], num_tokens).tolist()]
            guesses += [g.tolist() for g in lookup.alternatives(num_tokens, alternatives)]
            k = max(matched(guess, answer, t) for guess in guesses)
            lookup.advance(torch.tensor(answer[t: t + k + 1], dtype=torch.long), None)
            t += k + 1
            rounds += 1
            proposed += len({tuple(g[:j]) for g in guesses for j in range(1, len(g) + 1)})
        tokens += len(answer)
    return {"tau": tokens / rounds if rounds else 0.0, "proposed_per_round": proposed / rounds if rounds else 0.0,
            "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    """``python -m fledge.eval.datastore_bench``: what the shipped datastore adds to prompt lookup, measured on held-out
    shipped answers (the datastore built from the others), in seconds and without a model."""
    import argparse

    from fledge.data.sources import SHIPPED_SOURCE, DataConfig, load_conversations
    from fledge.models.verifier import VerifierConfig, load_tokenizer

    parser = argparse.ArgumentParser(prog="python -m fledge.eval.datastore_bench", description=main.__doc__)
    parser.add_argument("--holdout", type=int, default=100, help="answers held out of the datastore and decoded")
    parser.add_argument("--max-ngram", type=int, default=4)
    parser.add_argument("--min-ngram", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=5, help="tokens proposed per round at most (num_draft_tokens)")
    parser.add_argument("--alternatives", type=int, nargs="*", default=[2, 4, 8],
                        help="rows with this many tokens of other occurrences' continuations (hybrid_lookup_nodes)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    tokenizer = load_tokenizer(VerifierConfig())
    conversations, _ = load_conversations(DataConfig(source=SHIPPED_SOURCE))
    if not 0 < args.holdout < len(conversations):
        raise ConfigError(f"--holdout must be between 1 and {len(conversations) - 1}, got {args.holdout}")
    kept, held = conversations[: -args.holdout], conversations[-args.holdout:]
    store = NgramDatastore(answer_token_ids(kept, tokenizer), args.max_ngram, args.min_ngram)

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    pairs = [(ids(next(m["content"] for m in c if m["role"] == "user")),
              ids(next(m["content"] for m in c if m["role"] == "assistant"))) for c in held]
    print(f"datastore: {store.tokens:,} tokens of {len(kept)} answers, {len(store):,} n-grams "
          f"(n = {args.min_ngram}..{args.max_ngram}), built in {store.seconds:.1f} s; {len(held)} answers held out")
    bases = (("prompt_lookup", None), ("lookup+datastore", store))
    rows = [(name, datastore, 0) for name, datastore in bases]
    rows += [(f"{name}+{n}alt", datastore, n) for name, datastore in bases for n in args.alternatives]
    for name, datastore, alternatives in rows:
        lookup = PromptLookupDrafter.matching(args.min_ngram, datastore=datastore)
        figures = simulate_lookup(pairs, lookup, args.tokens, alternatives=alternatives)
        print(f"datastore_holdout {name} tau {figures['tau']:.3f} proposed_per_round "
              f"{figures['proposed_per_round']:.2f} rounds {figures['rounds']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
