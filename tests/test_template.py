"""Chat-template tokenisation: the loss mask lies exactly on assistant content + end-of-turn, for each template family.

There is no hub on these machines, so every family runs on the real SmolLM2 tokenizer (the default verifier's) with
``chat_template`` set to that family's published Jinja text (tests/fixtures/chat_templates) and its special tokens
added. The byte-level BPE underneath is SmolLM2's; the template logic is the family's.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

import fledge.data.template as template
from fledge.data.sources import DataConfig, load_conversations
from fledge.data.template import (
    Tokenized,
    check_loss_mask,
    end_of_turn_token,
    tokenize_all,
    tokenize_conversation,
)
from fledge.models.verifier import VerifierConfig, load_tokenizer

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
FAMILIES = ["chatml", "llama3", "qwen2_5", "qwen3", "mistral_v0_1", "mistral_v0_3"]
EOT = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "qwen2_5": "<|im_end|>", "qwen3": "<|im_end|>",
       "mistral_v0_1": "</s>", "mistral_v0_3": "</s>"}


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(VerifierConfig())


def family(base, name: str):
    """The SmolLM2 tokenizer dressed as a template family (a copy: the module's tokenizer stays untouched)."""
    tok = copy.deepcopy(base)
    if name == "chatml":
        return tok
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    if name == "llama3":
        tok.add_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                       special_tokens=True)
        tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    elif name.startswith("mistral"):
        tok.add_tokens(["<s>", "</s>"], special_tokens=True)
        tok.bos_token, tok.eos_token = "<s>", "</s>"
    elif name == "qwen3":
        tok.add_tokens(["<think>", "</think>"])  # added, not special, as in Qwen3's own tokenizer
    return tok


def masked_spans(tok, t: Tokenized) -> list[str]:
    return [tok.decode(t.input_ids[a:b], skip_special_tokens=False) for a, b in template._runs(t.loss_mask)]


def unmasked_text(tok, t: Tokenized) -> str:
    return tok.decode([i for i, m in zip(t.input_ids, t.loss_mask) if not m], skip_special_tokens=False)


SYSTEM = {"role": "system", "content": "You answer in one sentence."}
TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "And of Italy? Also, what did I ask first?"},
    {"role": "assistant", "content": "Rome; first you asked about France."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."},
]


def expected_spans(name: str, conversation: list[dict]) -> list[str]:
    """What each family's assistant turns must look like inside the mask, written out by hand."""
    answers = [m["content"] for m in conversation if m["role"] == "assistant"]
    eot = EOT[name]
    if name == "mistral_v0_3":
        return [f" {a}{eot}" for a in answers]  # the template writes " " + content|trim + eos
    if name == "qwen3":
        # the verifier writes an (empty) think block after "<|im_start|>assistant\n" in its last turn only
        return [f"{a}{eot}" for a in answers[:-1]] + [f"<think>\n\n</think>\n\n{answers[-1]}{eot}"]
    return [f"{a}{eot}" for a in answers]


@pytest.mark.parametrize("name", FAMILIES)
def test_mask_covers_exactly_assistant_content_and_end_of_turn(smollm2, name):
    tok = family(smollm2, name)
    assert end_of_turn_token(tok) == EOT[name]
    with_system = name != "mistral_v0_1"  # v0.1 refuses system turns (tested below)
    conversation = ([SYSTEM] if with_system else []) + TURNS
    t = tokenize_conversation(tok, conversation, max_length=4096)
    assert not t.truncated and len(t.loss_mask) == len(t.input_ids)
    assert masked_spans(tok, t) == expected_spans(name, conversation)
    check_loss_mask(tok, conversation, t)
    # what is not masked: every header, user turn and system prompt, and no assistant text
    rest = unmasked_text(tok, t)
    for m in conversation:
        if m["role"] == "assistant":
            assert m["content"] not in rest
        elif name != "mistral_v0_3" or m["role"] == "user":  # v0.3 drops the system prompt of a finished chat
            assert m["content"] in rest
    # the template's own rendering, tokenised whole, is what we trained on
    full = tok.apply_chat_template(conversation, tokenize=False)
    assert t.input_ids == tok(full, add_special_tokens=False)["input_ids"]


def test_chatml_default_system_prompt_and_trailing_newline_are_unmasked(smollm2):
    tok = smollm2
    conversation = TURNS[:2]
    t = tokenize_conversation(tok, conversation, max_length=512)
    text = tok.decode(t.input_ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_end|>\n")
    assert t.loss_mask[-1] == 0 and t.loss_mask[-2] == 1  # "\n" after <|im_end|> is not the assistant's
    assert t.input_ids[-2] == tok.convert_tokens_to_ids("<|im_end|>")
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    first = t.loss_mask.index(1)
    assert t.input_ids[first - len(header) : first] == header


def test_qwen3_think_blocks_of_earlier_turns_and_the_last(smollm2, monkeypatch):
    tok = family(smollm2, "qwen3")
    conversation = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nFour."},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "<think>\nagain\n</think>\n\nSix."},
    ]
    fallback_calls = []
    original = template._content_span
    monkeypatch.setattr(template, "_content_span",
                        lambda *a, **k: fallback_calls.append(a[2]) or original(*a, **k))
    t = tokenize_conversation(tok, conversation, max_length=512)
    full = tok.decode(t.input_ids)
    assert "add them" not in full  # the template drops the think block of an earlier turn...
    # ...and keeps the last one's
    assert masked_spans(tok, t) == ["Four.<|im_end|>", "<think>\nagain\n</think>\n\nSix.<|im_end|>"]
    assert fallback_calls == [1]  # turn 1 renders differently once it is no longer last: located by content
    check_loss_mask(tok, conversation, t)

    # no think content at all: the template still gives the last turn an empty think block, in the mask
    plain = [{"role": m["role"], "content": m["content"].split("\n\n")[-1]} for m in conversation]
    t = tokenize_conversation(tok, plain, max_length=512)
    assert masked_spans(tok, t) == ["Four.<|im_end|>", "<think>\n\n</think>\n\nSix.<|im_end|>"]
    check_loss_mask(tok, plain, t)

    # thinking off: the empty block belongs to the generation prompt, so it is outside the mask
    t = tokenize_conversation(tok, plain, max_length=512, template_kwargs={"enable_thinking": False})
    assert "<think>\n\n</think>\n\nSix." in tok.decode(t.input_ids)
    assert masked_spans(tok, t) == ["Four.<|im_end|>", "Six.<|im_end|>"]
    check_loss_mask(tok, plain, t)


def test_mistral_v0_3_system_prompt_moves_to_the_last_user_turn(smollm2, monkeypatch):
    tok = family(smollm2, "mistral_v0_3")
    conversation = [SYSTEM] + TURNS[:4]
    prompt = tok.apply_chat_template(conversation[:2], tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(conversation, tokenize=False)
    assert SYSTEM["content"] in prompt and not full.startswith(prompt)  # the prefix rendering does not hold
    calls = []
    original = template._content_span
    monkeypatch.setattr(template, "_content_span", lambda *a, **k: calls.append(a[2]) or original(*a, **k))
    t = tokenize_conversation(tok, conversation, max_length=512)
    assert calls == [2, 4]
    assert masked_spans(tok, t) == [" Paris is the capital of France.</s>", " Rome; first you asked about France.</s>"]


def test_truncation_cuts_tokens_and_keeps_a_partial_last_span(smollm2):
    tok = smollm2
    conversation = [SYSTEM] + TURNS
    whole = tokenize_conversation(tok, conversation, max_length=4096)
    second = [a for a, _ in template._runs(whole.loss_mask)][1]
    cut = second + 3  # three tokens into the second answer
    t = tokenize_conversation(tok, conversation, max_length=cut)
    assert t.truncated and len(t.input_ids) == cut
    assert t.input_ids == whole.input_ids[:cut] and t.loss_mask == whole.loss_mask[:cut]
    spans = masked_spans(tok, t)
    assert len(spans) == 2 and spans[0] == "Paris is the capital of France.<|im_end|>"
    assert "Rome; first you asked about France.".startswith(spans[1])
    check_loss_mask(tok, conversation, t)
    # a cut before the first answer leaves nothing to learn from: dropped, and counted
    early = whole.loss_mask.index(1) - 1
    short = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hey."}]
    kept, stats = tokenize_all(tok, [conversation, short], max_length=early)
    assert stats["dropped_no_mask"] == 1 and stats["truncated"] == 1 and stats["kept"] == len(kept) == 1
    assert masked_spans(tok, kept[0]) == ["Hey.<|im_end|>"]


@pytest.mark.parametrize("name", ["chatml", "llama3", "qwen3", "mistral_v0_3"])
def test_long_conversations_tokenise_like_the_whole_text(smollm2, name):
    """Only the head of a long conversation is tokenised; its tokens must be those of the whole rendering."""
    tok = family(smollm2, name)
    conversations, _ = load_conversations(DataConfig(max_conversations=12, offset=100))
    for conversation in conversations:
        if name == "mistral_v0_3" or name == "llama3":
            conversation = [m for m in conversation if m["role"] != "system"]
        full = tok.apply_chat_template(conversation, tokenize=False)
        reference = tok(full, add_special_tokens=False)["input_ids"]
        for max_length in (64, 300):
            t = tokenize_conversation(tok, conversation, max_length=max_length)
            assert t.input_ids == reference[:max_length]
            assert t.truncated == (len(reference) > max_length)


def test_tokenize_all_on_sharegpt_with_the_default_verifier(smollm2):
    conversations, _ = load_conversations(DataConfig(max_conversations=40))
    samples, stats = tokenize_all(smollm2, conversations, max_length=512, verify=40)
    assert stats["conversations"] == 40 and stats["kept"] == len(samples) == 40 - stats["dropped_no_mask"]
    assert stats["tokens"] == sum(len(s.input_ids) for s in samples)
    assert stats["masked_tokens"] == sum(sum(s.loss_mask) for s in samples)
    assert 0 < stats["masked_tokens"] < stats["tokens"]
    assert stats["truncated"] > 0 and all(len(s.input_ids) <= 512 for s in samples)
    one_by_one = [(c, tokenize_conversation(smollm2, c, max_length=512)) for c in conversations]
    one_by_one = [(c, t) for c, t in one_by_one if any(t.loss_mask)]
    assert [t for _, t in one_by_one] == samples
    for conversation, sample in one_by_one:
        check_loss_mask(smollm2, conversation, sample)


def test_template_refusals_are_counted_unless_all_are_refused(smollm2):
    tok = family(smollm2, "mistral_v0_1")
    ok = TURNS[:2]
    refused = [SYSTEM] + TURNS[:2]  # v0.1 raises "Conversation roles must alternate" on a system turn
    samples, stats = tokenize_all(tok, [ok, refused, ok], max_length=256)
    assert stats["template_errors"] == 1 and stats["kept"] == 2 == len(samples)
    with pytest.raises(ValueError, match="refused every conversation"):
        tokenize_all(tok, [refused], max_length=256)


def test_check_loss_mask_catches_damaged_masks(smollm2):
    tok = smollm2
    conversation = [SYSTEM] + TURNS
    good = tokenize_conversation(tok, conversation, max_length=4096)
    check_loss_mask(tok, conversation, good)
    runs = template._runs(good.loss_mask)

    def damaged(mask: list[int]) -> Tokenized:
        return Tokenized(list(good.input_ids), mask, False)

    def set_range(lo: int, hi: int, value: int) -> list[int]:
        mask = list(good.loss_mask)
        mask[lo:hi] = [value] * (hi - lo)
        return mask

    (a0, b0), (a1, b1) = runs[0], runs[1]
    cases = {
        "shifted right": [0] + good.loss_mask[:-1],
        "end-of-turn unmasked": set_range(b0 - 1, b0, 0),
        "header masked": set_range(a0 - 2, a0, 1),
        "first answer token unmasked": set_range(a0, a0 + 1, 0),
        "trailing newline masked": set_range(b0, b0 + 1, 1),
        "a turn unmasked": set_range(a1, b1, 0),
        "user turn masked": set_range(b0 + 1, a1, 1),
        "nothing masked": [0] * len(good.loss_mask),
        "not 0/1": set_range(a0, a0 + 1, 2),
    }
    # (a mask reaching over only the header's final newline is not caught: some templates, e.g. Zephyr's, do write a
    # newline after the generation prompt that the verifier generates, and it is masked with the turn)
    for what, mask in cases.items():
        with pytest.raises(ValueError):
            check_loss_mask(tok, conversation, damaged(mask))
            pytest.fail(f"check_loss_mask accepted a mask with {what}")
    with pytest.raises(ValueError, match="entries"):
        check_loss_mask(tok, conversation, Tokenized(good.input_ids, good.loss_mask[:-1], False))
