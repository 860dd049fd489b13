"""The decoding loop at batch 1 on tiny random verifiers: greedy output equals the reference plain greedy decoding
(``tests/reference_decode.py``) token for token (even with a draft that is almost never right), the verifier session
after rollback equals a fresh prefill, and one tree forward with the 4D mask equals running every root-to-node path
on its own."""

from __future__ import annotations

import json
import random
import statistics

import pytest
import torch

from fledge.decode.drafters import EagleDrafter, HybridDrafter, PromptLookupDrafter, RandomDrafter
from fledge.decode.loop import decode_one
from fledge.decode.proposals import DraftTree, TreeShape, grow_tree, propose_chain_with
from fledge.decode.result import ROUND_PARTS, DecodeResult
from fledge.decode.session import VerifierSession
from fledge.eval.exactness import tiny_verifier
from fledge.eval.runner import EvalConfig, draft_vocab_coverage, evaluate
from fledge.eval.summary import stable_figures
from fledge.export.write import tau_from_report
from fledge.models.capture import capture_hidden
from fledge.models.draft import Eagle3Config, Eagle3Draft
from fledge.models.sampling import SamplingParams
from fledge.models.verifier import VerifierConfig, load_verifier

from conftest import write_random_draft_run
from reference_decode import ReferenceEagle, generate_chain, generate_plain, generate_tree

VOCAB = 256


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def verifier(request):
    return tiny_verifier(request.param, vocab_size=VOCAB, hidden_size=64, num_layers=4, peak=4.0, seed=1)


class ReferenceDrafter:
    """A draft that knows the verifier's greedy continuation and usually ranks the right token 1st, 2nd or 3rd
    (random logits otherwise), so that accepted tree paths run through any sibling, not just the first."""

    needs_aux = False
    supports_tree = True
    draft_to_target = None

    def __init__(self, prompt_length: int, reference: list[int], seed: int = 0, hit_rate: float = 0.8,
                 vocab_size: int = VOCAB):
        self.target_vocab_size = vocab_size
        self.prompt_length = prompt_length
        self.reference = reference
        self.hit_rate = hit_rate
        self.rng = random.Random(seed)
        self.generator = torch.Generator().manual_seed(seed)

    def start(self, context, aux):
        self.context = context.tolist()
        self.slot_paths: list[list[int]] = []

    def advance(self, new_tokens, aux):
        self.context += new_tokens.tolist()
        self.slot_paths = []

    def _logits(self, path: list[int]) -> torch.Tensor:
        logits = torch.randn(self.target_vocab_size, generator=self.generator)
        generated = self.context[self.prompt_length :] + path
        at = len(generated)
        if at < len(self.reference) and generated == self.reference[:at] and self.rng.random() < self.hit_rate:
            rank = self.rng.randrange(3)
            logits[self.reference[at]] = logits.topk(rank + 1).values[rank] + 1e-3
        return logits

    def root_logits(self):
        return self._logits([])

    def expand(self, parent_slots, tokens):
        rows, slots = [], []
        for parent, token in zip(parent_slots, tokens.tolist()):
            path = (self.slot_paths[parent] if parent >= 0 else []) + [token]
            slots.append(len(self.slot_paths))
            self.slot_paths.append(path)
            rows.append(self._logits(path))
        return torch.stack(rows), slots

    def propose_chain(self, n, sampling, generator):
        return propose_chain_with(self, n, sampling, generator)

    def propose_tree(self, shape, sampling, generator):
        return grow_tree(self, shape, sampling, generator)


PROMPT = torch.tensor([3, 17, 42, 99, 5, 250, 8, 64, 31, 7])
MAX_NEW = 28
SHAPE = TreeShape(depth=4, top_k=3, total_tokens=10)


@pytest.fixture(scope="module")
def reference(verifier):
    return generate_plain(verifier, PROMPT, max_new_tokens=MAX_NEW).tokens


def test_chain_greedy_equals_plain_greedy(verifier, reference):
    random_draft = decode_one(verifier, PROMPT, RandomDrafter(VOCAB, seed=3), method="chain", num_draft_tokens=4,
                              max_new_tokens=MAX_NEW)
    assert random_draft.tokens == reference
    good_draft = decode_one(verifier, PROMPT, ReferenceDrafter(len(PROMPT), reference, seed=4), method="chain",
                            num_draft_tokens=4, max_new_tokens=MAX_NEW)
    assert good_draft.tokens == reference
    assert sum(good_draft.accepted) > 0, "the reference draft should get drafts accepted"
    assert good_draft.verifier_calls < random_draft.verifier_calls


def test_tree_greedy_equals_plain_greedy(verifier, reference):
    random_draft = decode_one(verifier, PROMPT, RandomDrafter(VOCAB, seed=3), method="tree", shape=SHAPE,
                              max_new_tokens=MAX_NEW)
    assert random_draft.tokens == reference
    good_draft = decode_one(verifier, PROMPT, ReferenceDrafter(len(PROMPT), reference, seed=5), method="tree",
                            shape=SHAPE, max_new_tokens=MAX_NEW)
    assert good_draft.tokens == reference
    assert max(good_draft.accepted) >= 2
    assert all(n <= SHAPE.total_tokens for n in good_draft.tree_nodes)


def test_prompt_lookup_greedy_equals_plain_greedy(verifier, reference):
    result = decode_one(verifier, PROMPT, PromptLookupDrafter(), method="chain", num_draft_tokens=5,
                        max_new_tokens=MAX_NEW)
    assert result.tokens == reference


def test_stop_token_cuts_output(verifier, reference):
    stop = reference[len(reference) // 2]
    expected = reference[: reference.index(stop) + 1]
    assert generate_plain(verifier, PROMPT, max_new_tokens=MAX_NEW, stop_ids=frozenset({stop})).tokens == expected
    chain = decode_one(verifier, PROMPT, ReferenceDrafter(len(PROMPT), reference), method="chain", num_draft_tokens=4,
                       max_new_tokens=MAX_NEW, stop_ids=frozenset({stop}))
    tree = decode_one(verifier, PROMPT, ReferenceDrafter(len(PROMPT), reference), method="tree", shape=SHAPE,
                      max_new_tokens=MAX_NEW, stop_ids=frozenset({stop}))
    assert chain.tokens == expected and tree.tokens == expected


def test_sampling_loops_run_to_length(verifier):
    sampling = SamplingParams(temperature=0.8, top_p=0.9, top_k=50)
    generator = torch.Generator().manual_seed(0)
    chain = decode_one(verifier, PROMPT, RandomDrafter(VOCAB), method="chain", num_draft_tokens=3, max_new_tokens=12,
                       sampling=sampling, generator=generator)
    tree = decode_one(verifier, PROMPT, RandomDrafter(VOCAB), method="tree",
                      shape=TreeShape(3, 3, 9, sampled_children=True), max_new_tokens=12, sampling=sampling,
                      generator=generator)
    assert len(chain.tokens) == 12 and len(tree.tokens) == 12


def fresh_last_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1]


def test_chain_rollback_equals_fresh_prefill(verifier):
    """Verify 5 drafts, accept 2, then decode on: the cache must hold exactly prompt + root + 2 drafts."""
    prefix = PROMPT.tolist()
    drafts = [11, 12, 13, 14, 15]
    with torch.inference_mode(), VerifierSession(verifier) as session:
        session.prefill([torch.tensor(prefix + [77])])
        session.forward([torch.tensor([77] + drafts)])
        session.commit([[0, 1, 2]])
        assert session.width == len(prefix) + 3
        logits, _ = session.forward([torch.tensor([99])])
    torch.testing.assert_close(logits[0, -1], fresh_last_logits(verifier, prefix + [77, 11, 12, 99]), atol=1e-4,
                               rtol=1e-4)


def test_tree_compaction_equals_fresh_prefill(verifier):
    """Keep a root-to-leaf path scattered through the tree block; the cache must equal a fresh prefill."""
    prefix = PROMPT.tolist()
    tokens = torch.tensor([20, 21, 22, 23, 24, 25, 26])
    parents = torch.tensor([-1, -1, 0, 1, 1, 3, 4])
    path = [1, 4, 6]  # 21 -> 24 -> 26
    with torch.inference_mode(), VerifierSession(verifier) as session:
        session.prefill([torch.tensor(prefix + [77])])
        length = session.width
        session.forward([torch.cat([torch.tensor([77]), tokens])], [parents])
        session.commit([[0] + [node + 1 for node in path]])
        assert session.width == length + 1 + len(path)
        logits, _ = session.forward([torch.tensor([99])])
    expected = fresh_last_logits(verifier, prefix + [77, 21, 24, 26, 99])
    torch.testing.assert_close(logits[0, -1], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_tree_mask_forward_equals_per_path_forwards(kind):
    # Mistral with a window shorter than prefix + tree, so that the mask's sliding-window rule is exercised.
    model = tiny_verifier(kind, vocab_size=VOCAB, hidden_size=64, num_layers=3, seed=2,
                          sliding_window=8 if kind == "mistral" else None)
    prefix = PROMPT.tolist()
    tokens = [30, 31, 32, 33, 34, 35, 36, 37]
    parents = [-1, -1, -1, 0, 0, 2, 3, 3]
    with torch.inference_mode(), VerifierSession(model) as session:
        session.prefill([torch.tensor(prefix + [77])])
        logits, _ = session.forward([torch.tensor([77] + tokens)], [torch.tensor(parents)])
    for node in range(-1, len(tokens)):
        path = []
        walker = node
        while walker >= 0:
            path.insert(0, tokens[walker])
            walker = parents[walker]
        expected = fresh_last_logits(model, prefix + [77] + path)
        torch.testing.assert_close(logits[0, node + 1], expected, atol=1e-4, rtol=1e-4, msg=f"{kind} node {node}")


def test_prompt_lookup_proposals():
    drafter = PromptLookupDrafter(max_ngram=3, min_ngram=1)
    drafter.start(torch.tensor([1, 2, 3, 4, 5, 9, 1, 2, 3]), None)
    # "1 2 3" occurred before, followed by 4 5 9.
    assert drafter.propose_chain(2, SamplingParams(), None).tokens.tolist() == [4, 5]
    drafter.advance(torch.tensor([8]), None)
    # "8" never occurred before: nothing to propose.
    assert drafter.propose_chain(3, SamplingParams(), None).tokens.numel() == 0
    drafter.advance(torch.tensor([2]), None)
    # Longest n-gram first: "8 2" and "3 8 2" are new, "2" last occurred before 3 (position 7).
    assert drafter.propose_chain(3, SamplingParams(), None).tokens.tolist() == [3, 8, 2]
    # The context read as if a guessed token followed it: "2 4" never occurred, "4" did (before 5 9).
    assert drafter.continuation([4], 2).tolist() == [5, 9]
    assert drafter.continuation([3, 8], 3).tolist() == [2]  # "2 3 8" occurred, then the last token, 2
    assert drafter.continuation([77], 3).numel() == 0


# --- the EAGLE-3 drafter ------------------------------------------------------------------------------------

AUX_IDS = [1, 2, 3]


def random_eagle(verifier, draft_vocab_size: int = 96, seed: int = 0) -> Eagle3Draft:
    """A random-init draft with a real (non-identity) draft vocabulary: every other verifier id from 10 on."""
    config = Eagle3Config.from_verifier(verifier.config, draft_vocab_size=draft_vocab_size, aux_layer_ids=AUX_IDS)
    draft = Eagle3Draft(config, seed=seed)
    draft.load_verifier_embedding(verifier.get_input_embeddings().weight.detach())
    target_ids = torch.arange(10, 10 + 2 * draft_vocab_size, 2)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[target_ids] = True
    draft.set_draft_vocab(target_ids - torch.arange(draft_vocab_size), t2d)
    with torch.no_grad():
        draft.lm_head.weight.mul_(20.0)  # peaked draft distributions, so top-k choices are not ties
    return draft.eval()


def verifier_aux(verifier, tokens: list[int]) -> torch.Tensor:
    """[T, 3H] aux states of a full forward over ``tokens``."""
    with torch.inference_mode(), capture_hidden(verifier, AUX_IDS, final=False) as captured:
        verifier(input_ids=torch.tensor([tokens]))
        return torch.cat([a[0] for a in captured.aux], dim=-1)


def test_eagle_greedy_equals_plain_greedy(verifier, reference):
    chain = decode_one(verifier, PROMPT, EagleDrafter(random_eagle(verifier)), method="chain", num_draft_tokens=4,
                       max_new_tokens=MAX_NEW, aux_layer_ids=AUX_IDS)
    tree = decode_one(verifier, PROMPT, EagleDrafter(random_eagle(verifier)), method="tree", shape=SHAPE,
                      max_new_tokens=MAX_NEW, aux_layer_ids=AUX_IDS)
    assert chain.tokens == reference and tree.tokens == reference
    with pytest.raises(ValueError, match="aux"):
        decode_one(verifier, PROMPT, EagleDrafter(random_eagle(verifier)), method="chain", num_draft_tokens=4,
                   max_new_tokens=4)


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_the_loop_at_batch_1_equals_the_reference_loops(verifier, reference, method):
    """The one loop at batch 1 decodes what the simple batch-1 loops of ``tests/reference_decode.py`` decode, round
    by round: the same tokens, accepted counts and proposals, greedy and sampled, with the EAGLE-3 draft (batched in
    the loop, stepped row by row in the reference) and with a drafter that knows the answer."""
    loop_kwargs = dict(max_new_tokens=MAX_NEW, aux_layer_ids=AUX_IDS)
    loop_kwargs.update(num_draft_tokens=4) if method == "chain" else loop_kwargs.update(shape=SHAPE)
    ref = generate_chain if method == "chain" else generate_tree
    draft = random_eagle(verifier)
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8)):
        knows = lambda: ReferenceDrafter(len(PROMPT), reference, seed=7)  # noqa: E731
        for make, make_reference in ((lambda: EagleDrafter(draft), lambda: ReferenceEagle(draft)), (knows, knows)):
            ours = decode_one(verifier, PROMPT, make(), method=method, sampling=sampling,
                              generator=torch.Generator().manual_seed(3), **loop_kwargs)
            theirs = ref(verifier, PROMPT, make_reference(), sampling=sampling,
                         generator=torch.Generator().manual_seed(3), **loop_kwargs)
            assert (ours.tokens, ours.accepted, ours.proposed) == (theirs.tokens, theirs.accepted, theirs.proposed)
            assert set(ours.parts) == set(ROUND_PARTS)


def test_eagle_rollback_equals_fresh_start(verifier, reference):
    """After proposing a tree (speculative cache entries) and advancing, the draft predicts as if started afresh."""
    full = PROMPT.tolist() + reference[:6]
    aux = verifier_aux(verifier, full)
    rolled = ReferenceEagle(random_eagle(verifier))
    rolled.start(PROMPT, aux[: len(PROMPT) - 1])
    grow_tree(rolled, SHAPE, SamplingParams(), None)
    rolled.advance(torch.tensor(reference[:6]), aux[len(PROMPT) - 1 : len(full) - 1])
    fresh = ReferenceEagle(random_eagle(verifier))
    fresh.start(torch.tensor(full), aux[: len(full) - 1])
    torch.testing.assert_close(rolled.root_logits(), fresh.root_logits(), atol=1e-4, rtol=1e-4)
    assert rolled.committed == fresh.committed == len(full) - 1


def test_eagle_tree_expansion_equals_chain_along_each_path(verifier):
    """One batched, tree-masked draft step per depth gives every node the logits of a plain chain down its path."""
    aux = verifier_aux(verifier, PROMPT.tolist())
    drafter = ReferenceEagle(random_eagle(verifier))
    drafter.start(PROMPT, aux[:-1])
    slot_paths: list[list[int]] = []
    slot_logits: list[torch.Tensor] = []
    expand = drafter.expand

    def recording_expand(parent_slots, tokens):
        logits, slots = expand(parent_slots, tokens)
        assert slots == list(range(len(slot_paths), len(slot_paths) + len(parent_slots)))
        for parent, token, row in zip(parent_slots, tokens.tolist(), logits):
            slot_paths.append((slot_paths[parent] if parent >= 0 else []) + [token])
            slot_logits.append(row)
        return logits, slots

    drafter.expand = recording_expand
    grow_tree(drafter, TreeShape(depth=4, top_k=3, total_tokens=12), SamplingParams(), None)
    assert len(slot_paths) == 9 and max(len(p) for p in slot_paths) == 3  # 3 nodes expanded at depths 1..3
    for path, tree_row in zip(slot_paths, slot_logits):
        chain = ReferenceEagle(random_eagle(verifier))
        chain.start(PROMPT, aux[:-1])
        parent = -1
        for token in path:
            logits, (parent,) = chain.expand([parent], torch.tensor([token]))
        torch.testing.assert_close(tree_row, logits[0], atol=1e-4, rtol=1e-4)


class SpyDrafter(ReferenceDrafter):
    """Records the (token, verifier feature) pairs the loop hands a drafter that reads aux states."""

    needs_aux = True

    def start(self, context, aux):
        super().start(context, aux)
        self.pairs = [] if aux is None else list(zip(context[1:].tolist(), aux))  # a 1-token prompt has no features

    def advance(self, new_tokens, aux):
        super().advance(new_tokens, aux)
        assert aux.shape[0] == new_tokens.numel()
        self.pairs += list(zip(new_tokens.tolist(), aux))


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_loop_hands_drafter_the_features_of_the_right_positions(verifier, reference, method):
    """Feature t must pair with token t+1, whichever tree path was accepted: compare with one full forward."""
    spy = SpyDrafter(len(PROMPT), reference, seed=6)
    if method == "chain":
        decode_one(verifier, PROMPT, spy, method="chain", num_draft_tokens=4, max_new_tokens=MAX_NEW,
                   aux_layer_ids=AUX_IDS)
    else:
        decode_one(verifier, PROMPT, spy, method="tree", shape=SHAPE, max_new_tokens=MAX_NEW, aux_layer_ids=AUX_IDS)
    sequence = PROMPT.tolist() + reference
    full_aux = verifier_aux(verifier, sequence)
    assert [token for token, _ in spy.pairs] == sequence[1 : len(spy.pairs) + 1]
    assert len(spy.pairs) >= len(PROMPT) + MAX_NEW // 2
    torch.testing.assert_close(torch.stack([a for _, a in spy.pairs]), full_aux[: len(spy.pairs)], atol=1e-4, rtol=1e-4)


# --- the evaluation runner ----------------------------------------------------------------------------------


def test_evaluate_reports_lossless_drafters(tiny_verifier_dir, tmp_path):
    """End to end on a tiny Llama with SmolLM2's tokenizer and chat template: report, JSON and PNG."""
    verifier = load_verifier(VerifierConfig(name_or_path=str(tiny_verifier_dir), dtype="float32"))
    config = Eagle3Config.from_verifier(verifier.model.config, draft_vocab_size=2048,
                                        aux_layer_ids=verifier.aux_layer_ids)
    draft = Eagle3Draft(config, seed=0)
    draft.load_verifier_embedding(verifier.model.get_input_embeddings().weight.detach())
    prompts = [{"id": "a", "turns": ["Say hello to the world, then say hello again."]},
               {"id": "b", "turns": ["Count: one two three one two three one two"]}]
    cfg = EvalConfig(method="tree", num_draft_tokens=3, tree_depth=3, tree_top_k=3, tree_total_tokens=9,
                     max_new_tokens=12, warmup_tokens=2, out_dir=str(tmp_path / "eval"))
    drafters = {"greedy": None, "prompt_lookup": PromptLookupDrafter(), "eagle": EagleDrafter(draft),
                "random": RandomDrafter(len(verifier.tokenizer)),
                "hybrid": HybridDrafter(EagleDrafter(draft), PromptLookupDrafter(min_ngram=1))}
    report = evaluate(verifier, {"toy": prompts}, drafters, cfg)
    assert report["verifier"]["attention"] == "sdpa"  # loaded for the cache's path: the stock attention
    entries = report["sets"]["toy"]["drafters"]
    assert entries["prompt_lookup"]["method"] == "chain" and entries["eagle"]["method"] == "tree"
    for name in ("prompt_lookup", "eagle", "random", "hybrid"):
        assert entries[name]["greedy_match_rate"] == 1.0, entries[name]["greedy_mismatches"]
        assert entries[name]["tau"] >= 1.0 and len(entries[name]["histogram"]) == entries[name]["num_draft"] + 1
        assert entries[name]["tokens_per_s"] > 0 and entries[name]["verify_cost_in_steps"] > 0
    assert entries["greedy"]["method"] == "plain"
    assert (tmp_path / "eval" / "report.json").is_file() and (tmp_path / "eval" / "acceptance.png").stat().st_size
    taus = tau_from_report(json.loads((tmp_path / "eval" / "report.json").read_text()))
    assert set(taus) == {"sets/toy/drafters/prompt_lookup", "sets/toy/drafters/eagle", "sets/toy/drafters/random",
                         "sets/toy/drafters/hybrid"}
    assert report["verifier"]["dtype"] == "float32"  # the verifier's dtype is the evaluation's, reported
    # The honest baseline: Hugging Face generate on the same prompts, the same tokens in fp32 greedy decoding, and
    # each prompt's speed-up divides by the faster of the two plain decoders, timed right before the drafter.
    base = report["sets"]["toy"]["baseline"]
    assert base["hf_generate"]["same_tokens_rate"] == 1.0 and base["hf_generate"]["tokens"] == base["tokens"]
    lo, hi = base["baseline_vs_hf_interval"]
    assert lo <= base["baseline_vs_hf"] <= hi
    for name in ("prompt_lookup", "eagle", "random"):
        entry = entries[name]
        per_prompt = entry["per_prompt"]
        assert [p["id"] for p in per_prompt] == ["a", "b"]
        for p in per_prompt:
            assert p["speedup"] == pytest.approx(p["tokens"] / p["seconds"] / p["baseline_tokens_per_s"])
        assert entry["speedup"] == pytest.approx(statistics.median(p["speedup"] for p in per_prompt))
        lo, hi = entry["speedup_interval"]
        assert lo <= entry["speedup"] <= hi
        # A round's parts add up to its cost, and the floor is what the round checked plus its drafting.
        parts = entry["round_parts_in_steps"]
        assert set(parts) == set(ROUND_PARTS)
        assert sum(parts.values()) == pytest.approx(entry["round_cost_in_steps"])
        assert entry["round_cost_in_steps"] == pytest.approx(entry["verify_cost_in_steps"] + entry["draft_cost_in_steps"])
        floor = entry["round_floor"]
        assert floor["floor_steps"] == pytest.approx(floor["verify_steps"] + parts["draft"] + parts["draft_update"])
        assert entry["round_overhead"] == pytest.approx(entry["round_cost_in_steps"] / floor["floor_steps"] - 1)
    # The draft vocabulary holds 2048 of the tiny verifier's ids: a share of plain decoding's tokens, printed too.
    assert 0.0 <= report["sets"]["toy"]["draft_vocab_coverage"] <= 1.0
    labels = ["baseline_vs_hf", "draft_vocab_coverage"] + ["round_overhead"] * 4 + ["vs_prompt_lookup"] * 3
    assert [line.split()[0] for line in stable_figures(report)] == labels
    # Each drafter against prompt lookup on the same prompts: pooled throughput over pooled throughput, paired.
    lookup = entries["prompt_lookup"]["per_prompt"]
    for name in ("eagle", "random", "hybrid"):
        mine = entries[name]["per_prompt"]
        rate = sum(p["tokens"] for p in mine) / sum(p["seconds"] for p in mine)
        vs = entries[name]["vs_prompt_lookup"]
        assert vs["throughput_ratio"] == pytest.approx(rate / (sum(p["tokens"] for p in lookup) /
                                                               sum(p["seconds"] for p in lookup)))
        assert vs["interval"][0] <= vs["throughput_ratio"] <= vs["interval"][1]
    assert "vs_prompt_lookup" not in entries["prompt_lookup"]
    assert drafters["hybrid"].used_lookup > 0  # the prompts repeat themselves: its lookup branch was taken
    with pytest.raises(ValueError, match="method"):
        EvalConfig(method="beam")


def test_load_eagle_drafter_from_training_and_serving_checkpoints(tiny_verifier_dir, tmp_path):
    """Both checkpoint kinds load into an EagleDrafter that proposes exactly what the original draft proposes."""
    from fledge.eval.runner import load_eagle_drafter
    from fledge.export.write import export_draft

    verifier, draft = write_random_draft_run(tmp_path / "run", tiny_verifier_dir, seed=3)
    export_draft(draft, tiny_verifier_dir, tmp_path / "serving", dtype="float32")
    prompt = torch.tensor([1, 2, 3, 4, 5, 6])
    aux = torch.randn(5, 3 * verifier.hidden_size)
    expected = ReferenceEagle(draft)
    expected.start(prompt, aux)
    for folder in (tmp_path / "run", tmp_path / "serving"):
        loaded = ReferenceEagle(load_eagle_drafter(folder, verifier).draft)
        loaded.start(prompt, aux)
        torch.testing.assert_close(loaded.root_logits(), expected.root_logits())


def test_the_draft_decides_which_verifier_states_it_reads(tiny_verifier_dir):
    """A draft trained on other layers than the verifier's defaults is fed the layers its own config names."""
    verifier = load_verifier(VerifierConfig(name_or_path=str(tiny_verifier_dir), dtype="float32"))
    ids = [1, 3, 5]
    assert ids != verifier.aux_layer_ids
    config = Eagle3Config.from_verifier(verifier.model.config, draft_vocab_size=512, aux_layer_ids=ids)
    draft = Eagle3Draft(config, seed=0)
    draft.load_verifier_embedding(verifier.model.get_input_embeddings().weight.detach())
    seen = []

    class Spy(ReferenceEagle):
        def start(self, context, aux):
            seen.append(aux)
            super().start(context, aux)

    prompt = {"id": "a", "turns": ["Say hello to the world."]}
    cfg = EvalConfig(max_new_tokens=4, warmup_tokens=0, hf_baseline=False, round_floor=False, out_dir=None)
    evaluate(verifier, [prompt], {"eagle": Spy(draft)}, cfg)
    from fledge.eval.runner import encode_prompt

    ids_in = encode_prompt(verifier.tokenizer, prompt)[:-1].view(1, -1)
    states = verifier.model(input_ids=ids_in, output_hidden_states=True).hidden_states
    expected = torch.cat([states[i][0] for i in ids], dim=-1)
    torch.testing.assert_close(seen[0], expected, atol=1e-5, rtol=1e-5)


def test_a_draft_for_another_verifier_is_refused_naming_both_sides(tiny_verifier_dir, tmp_path, smollm_tokenizer):
    from fledge.core.errors import ConfigError, MismatchError
    from fledge.eval.runner import draft_verifier_mismatches, load_eagle_drafter
    from fledge.export.write import export_draft

    from conftest import make_tiny_verifier

    verifier, draft = write_random_draft_run(tmp_path / "run", tiny_verifier_dir, seed=3)
    export_draft(draft, tiny_verifier_dir, tmp_path / "serving", dtype="float32")
    # Same shapes, other weights: the fingerprint recorded at training (run) or export (serving) tells them apart.
    other = load_verifier(VerifierConfig(name_or_path=str(make_tiny_verifier(tmp_path, "llama", smollm_tokenizer,
                                                                             seed=9)), dtype="float32"))
    for folder in (tmp_path / "run", tmp_path / "serving"):
        with pytest.raises(MismatchError, match="weight fingerprint"):
            load_eagle_drafter(folder, other)
    # Other shapes: each problem names the draft's side and the verifier's.
    wide = Eagle3Config.from_verifier(verifier.model.config, draft_vocab_size=64, aux_layer_ids=[1, 2, 40])
    wide.target_hidden_size, wide.vocab_size = 64, 1000
    problems = draft_verifier_mismatches(wide, verifier)
    assert len(problems) == 3
    assert "64 wide, the verifier's are 32" in problems[0] and f"1000 tokens, the verifier's {len(smollm_tokenizer)}" \
        in problems[1] and "0..8 only" in problems[2]
    assert draft_verifier_mismatches(draft.config, verifier) == []
    assert issubclass(MismatchError, ValueError) and issubclass(ConfigError, ValueError)


def test_topk_ranks_cover_the_depths_a_round_reached():
    from fledge.decode.loop import topk_ranks

    predicted = torch.tensor([5, 7, 9, 2])  # the verifier's argmax at the root and after drafts 1..3
    top_ids = torch.tensor([[5, 1], [3, 7], [9, 4]])  # the draft's top-2 at depths 1..3
    assert topk_ranks(predicted, top_ids, accepted=1) == [(1, 0), (2, 1)]  # depth 2 rejected: rank 1 (2nd best)
    assert topk_ranks(predicted, top_ids, accepted=3) == [(1, 0), (2, 1), (3, 0)]
    assert topk_ranks(torch.tensor([8, 7, 9, 2]), top_ids, accepted=0) == [(1, 2)]  # absent: rank k


def test_tree_report_accounts_by_depth(tiny_verifier_dir):
    verifier, draft = write_random_draft_run_in_memory(tiny_verifier_dir)
    prompts = [{"id": "a", "turns": ["Count: one two three one two three"]}, {"id": "b", "turns": ["Say hi."]}]
    cfg = EvalConfig(method="tree", tree_depth=3, tree_top_k=3, tree_total_tokens=9, max_new_tokens=10,
                     warmup_tokens=0, hf_baseline=False, out_dir=None)
    entry = evaluate(verifier, {"t": prompts}, {"eagle": EagleDrafter(draft)}, cfg)["sets"]["t"]["drafters"]["eagle"]
    tree = entry["tree"]
    assert sum(tree["path_length_histogram"]) == entry["rounds"] and len(tree["reached_depth"]) == 3
    # Tokens per round are 1 + the fraction of rounds reaching each depth: τ, read by depth.
    assert entry["expected_tokens_per_call"] == pytest.approx(entry["tau"])
    assert tree["verify_measured"] and tree["verify_steps"] == pytest.approx(entry["round_floor"]["verify_steps"])
    assert tree["predicted_round_cost_in_steps"] == pytest.approx(tree["verify_steps"] + entry["draft_cost_in_steps"])
    assert entry["predicted_speedup"] == pytest.approx(entry["tau"] / tree["predicted_round_cost_in_steps"])


@pytest.mark.parametrize("batch_size", [1, 2])
def test_method_both_runs_each_tree_drafter_as_chain_and_tree(tiny_verifier_dir, batch_size):
    """``eval.method=both``: one run gives the draft as a chain and as a tree (``<name>-tree``) against one plain run;
    prompt lookup, which grows no trees, runs once as a chain."""
    verifier, draft = write_random_draft_run_in_memory(tiny_verifier_dir)
    prompts = [{"id": "a", "turns": ["Count: one two three one two three"]}, {"id": "b", "turns": ["Say hi."]}]
    cfg = EvalConfig(method="both", num_draft_tokens=3, tree_depth=3, tree_top_k=3, tree_total_tokens=9,
                     max_new_tokens=10, warmup_tokens=2, hf_baseline=False, out_dir=None, batch_size=batch_size)
    report = evaluate(verifier, {"t": prompts}, {"eagle": EagleDrafter(draft), "lookup": PromptLookupDrafter()}, cfg)
    entries = report["sets"]["t"]["drafters"]
    assert {name: e["method"] for name, e in entries.items()} == {"eagle": "chain", "eagle-tree": "tree",
                                                                   "lookup": "chain"}
    assert all(e["greedy_match_rate"] == 1.0 for e in entries.values())
    if batch_size == 1:  # the batch-1 report's tree accounting, for the tree entry only
        assert "tree" in entries["eagle-tree"] and "tree" not in entries["eagle"]


def write_random_draft_run_in_memory(verifier_dir):
    verifier = load_verifier(VerifierConfig(name_or_path=str(verifier_dir), dtype="float32"))
    config = Eagle3Config.from_verifier(verifier.model.config, draft_vocab_size=512,
                                        aux_layer_ids=verifier.aux_layer_ids)
    draft = Eagle3Draft(config, seed=0)
    draft.load_verifier_embedding(verifier.model.get_input_embeddings().weight.detach())
    return verifier, draft


def test_draft_vocab_coverage_counts_plain_tokens_the_draft_can_propose():
    """The share of the verifier's plain tokens inside the draft vocabulary: the ceiling of the draft's acceptance."""
    config = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, vocab_size=100, draft_vocab_size=10, target_hidden_size=32,
                          aux_layer_ids=[0, 1, 2])
    draft = Eagle3Draft(config, seed=0)
    draft.d2t.copy_(torch.arange(10) * 9)  # draft id i proposes verifier id 10 * i
    plain = [DecodeResult(tokens=[0, 10, 11]), DecodeResult(tokens=[90, 5])]
    eagle = EagleDrafter(draft)
    assert draft_vocab_coverage([("eagle", eagle)], plain) == pytest.approx(3 / 5)
    hybrid = HybridDrafter(EagleDrafter(draft), PromptLookupDrafter())
    assert draft_vocab_coverage([("lookup", PromptLookupDrafter()), ("hybrid", hybrid)], plain) == pytest.approx(3 / 5)
    assert draft_vocab_coverage([("lookup", PromptLookupDrafter())], plain) is None
    full = Eagle3Draft(Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, vocab_size=100, draft_vocab_size=100,
                                    target_hidden_size=32, aux_layer_ids=[0, 1, 2]), seed=0)
    assert draft_vocab_coverage([("eagle", EagleDrafter(full))], plain) == 1.0
