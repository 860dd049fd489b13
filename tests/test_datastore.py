"""The n-gram datastore of the verifier's own answers: the table, the lookup's fallback to it, the shipped answers
as a datastore, and ``fledge eval hybrid_datastore=...`` end to end (exact, and used)."""

from __future__ import annotations

import json

import pytest
import torch

from fledge.core.errors import ConfigError
from fledge.decode.drafters import PromptLookupDrafter
from fledge.eval.datastore import NgramDatastore, answer_token_ids, load_datastore
from fledge.models.sampling import SamplingParams


def test_the_table_decodes_the_most_frequent_next_token_of_the_longest_ngram():
    store = NgramDatastore([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [9, 2, 3, 7, 7], [9, 2, 3, 7, 8]], max_ngram=3,
                           min_ngram=2)
    # "2 3" was followed by 4 twice and 7 twice: the first seen wins; then "2 3 4" -> 5 (first seen), then nothing
    assert store.continuation([0, 2, 3], 4) == [4, 5]
    # "9 2 3" (3 tokens) beats "2 3": 7; then "2 3 7" -> 7, then "3 7 7" and "7 7" never continued
    assert store.continuation([9, 2, 3], 4) == [7, 7]
    assert store.continuation([9, 2, 3], 1) == [7]  # cut to n
    assert store.continuation([5, 5], 4) == [] and store.continuation([3], 4) == []  # unseen; shorter than min_ngram
    assert store.next_token([1, 2, 3, 4]) == 5 and store.next_token([8, 8]) is None
    frequent = NgramDatastore([[1, 2, 8], [1, 2, 9], [3, 1, 2, 9]], max_ngram=2, min_ngram=2)
    assert frequent.continuation([1, 2], 3) == [9]  # seen twice against once
    assert store.hits == 3 and frequent.hits == 1  # continuations handed out
    assert len(store) == len(store.table[2]) + len(store.table[3]) and store.tokens == 20
    with pytest.raises(ConfigError, match="min_ngram"):
        NgramDatastore([[1, 2]], max_ngram=1, min_ngram=2)


def test_the_lookup_falls_back_to_the_datastore_only_where_the_context_has_nothing():
    store = NgramDatastore([[40, 41, 42, 43, 44]], max_ngram=3, min_ngram=2)
    lookup = PromptLookupDrafter(max_ngram=3, min_ngram=2, datastore=store)
    lookup.start(torch.tensor([5, 6, 7, 5, 6]), None)  # "5 6" occurred before: the context's continuation
    assert lookup.propose_chain(3, SamplingParams(), None).tokens.tolist() == [7, 5, 6]
    lookup.advance(torch.tensor([8, 40, 41]), None)  # "40 41" never occurred in the context: the datastore's
    assert lookup.propose_chain(2, SamplingParams(), None).tokens.tolist() == [42, 43]
    assert lookup.continuation([], 9).tolist() == [42, 43, 44]
    assert lookup.continuation([42], 9).tolist() == [43, 44]  # read as if the draft's 42 were committed
    other = lookup.fresh()
    assert other.datastore is store and other._length == 0
    plain = PromptLookupDrafter(max_ngram=3, min_ngram=2)
    plain.start(torch.tensor([5, 6, 7, 8, 40, 41]), None)
    assert plain.propose_chain(2, SamplingParams(), None).tokens.numel() == 0


def test_the_shipped_answers_make_a_datastore_of_the_verifiers_habits(smollm_tokenizer, caplog):
    store = load_datastore("shipped", smollm_tokenizer, fingerprint="not-the-default-verifier")
    assert "not of this verifier" in caplog.text  # another verifier's answers: said, not refused
    assert store.tokens > 100_000 and len(store) > 50_000
    # A stock opening of the default verifier's answers
    ids = smollm_tokenizer("Here are some", add_special_tokens=False)["input_ids"]
    assert store.continuation(ids, 4)
    convs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
             [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]]
    assert answer_token_ids(convs, smollm_tokenizer) == [smollm_tokenizer("hello there",
                                                                          add_special_tokens=False)["input_ids"]]


def test_eval_with_a_datastore_of_the_verifiers_answers(tiny_verifier_dir, tmp_path):
    """``hybrid_datastore=<file>`` and ``datastore_alone=true``: on prompts the verifier answered before, the
    datastore holds its answers, so the lookup with it accepts more than prompt lookup; every row stays exact."""
    from fledge.launch.cli import run_stage

    from conftest import own_answers_eval

    store_file, common = own_answers_eval(tmp_path, tiny_verifier_dir)
    report = run_stage("eval", [*common, f"hybrid_datastore={store_file}", "datastore_alone=true",
                                f"eval.out_dir={tmp_path / 'eval'}"])
    rows = report["sets"]["prompts"]["drafters"]
    assert {"eagle3", "eagle3+lookup", "prompt_lookup", "lookup+datastore"} <= set(rows)
    assert all(d["greedy_match_rate"] == 1.0 for d in rows.values())
    assert report["datastore"]["continuations"] > 0 and report["datastore"]["tokens"] > 0
    assert rows["lookup+datastore"]["tau"] > rows["prompt_lookup"]["tau"]
    assert rows["eagle3+lookup"]["tau"] >= rows["eagle3"]["tau"]
    assert json.loads((tmp_path / "eval" / "report.json").read_text())["datastore"]["source"] == str(store_file)
    with pytest.raises(ConfigError, match="needs a datastore"):
        run_stage("eval", [*common, "datastore_alone=true"])


def test_lookup_rounds_over_known_answers_measure_what_the_datastore_adds(capsys):
    from fledge.eval.datastore_bench import main, simulate_lookup

    answers = [[10, 11, 12, 13, 14, 15], [20, 10, 11, 12, 13, 14]]
    prompts = [[1, 2], [3, 4]]
    alone = simulate_lookup(list(zip(prompts, answers)), PromptLookupDrafter(max_ngram=3, min_ngram=2), 5)
    assert alone == {"tau": 1.0, "proposed_per_round": 0.0, "rounds": 12}  # nothing repeats within an answer
    store = NgramDatastore([[10, 11, 12, 13, 14, 15]], max_ngram=2, min_ngram=2)
    helped = simulate_lookup([(prompts[1], answers[1])], PromptLookupDrafter(max_ngram=3, min_ngram=2,
                                                                             datastore=store), 5)
    # rounds: 20 | 10 | 11 (nothing ends in a known 2-gram yet) | then "10 11" -> 12 13 14 15: 3 accepted + 14
    assert helped["rounds"] == 4 and helped["tau"] == 6 / 4
    # "5" occurred twice: the latest continuation (6 8) is wrong after 6, the other occurrence's (6 7) is right.
    pair = [([5, 6, 7, 0, 5, 6, 8, 0, 5], [6, 7, 9])]
    latest = simulate_lookup(pair, PromptLookupDrafter(max_ngram=1, min_ngram=1), 2)
    assert latest == {"tau": 3 / 2, "proposed_per_round": 2.0, "rounds": 2}  # 6 accepted, then 7 -> "0 5" misses
    both = simulate_lookup(pair, PromptLookupDrafter(max_ngram=1, min_ngram=1), 2, alternatives=2)
    assert both == {"tau": 3.0, "proposed_per_round": 3.0, "rounds": 1}  # nodes 6, 6-8, 6-7: 6 7 accepted, + 9
    with pytest.raises(ConfigError, match="--holdout"):
        main(["--holdout", "0"])
