"""Chat-template tokenisation with a loss mask on exactly the assistant's tokens.

A conversation is rendered once with the verifier's own chat template and tokenised (without adding special
tokens: the template already places BOS where it wants). Each assistant turn is then located in that text:

* Stable templates (ChatML, Llama-3, Qwen2.5, ...): the rendering of ``messages[:i]`` with the generation prompt
  is a prefix of the full text, and so is the rendering of ``messages[:i+1]``. The turn is what lies between the
  two, up to and including its end-of-turn token.
* Templates whose rendering of a turn depends on later turns (Qwen3 drops ``<think>`` blocks of earlier turns and
  gives the last one an empty think block; Mistral v0.3 moves the system prompt into the *last* user message) break
  one of those prefixes. Then the turn's content is found by rendering the conversation again with only that turn's
  content replaced by a sentinel: the text where the two renderings differ is the content, wherever the template
  put it. The end-of-turn token must follow it.

The mask covers what the assistant produces after its generation prompt: the content and the end-of-turn token
(``<|im_end|>``, ``<|eot_id|>``, ``</s>``), never the role header nor the newline a template writes after the
end-of-turn token. For Qwen3 in thinking mode, the last turn's ``<think>\\n\\n</think>\\n\\n`` is inside the mask, as
the verifier itself generates it after ``<|im_start|>assistant\\n``; with ``enable_thinking=False`` the template puts
it in the generation prompt and it is outside. Earlier turns lose their think block in the rendering and carry only
their answer. Spans become tokens through the fast tokenizer's offset mapping: a token is masked when its characters
overlap the span.
"""

from __future__ import annotations

import logging
import re
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Any

from jinja2.exceptions import TemplateError
from tqdm.auto import tqdm

from fledge.core.errors import ConfigError
from fledge.data.sources import Conversation

log = logging.getLogger(__name__)

# Private-use code points: no chat template writes them, so they mark a turn's content unambiguously.
_SENTINELS = [chr(c) for c in range(0xE000, 0xE100)]
_THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]
    """1 exactly on assistant tokens (content + that turn's end-of-turn token), else 0; same length as input_ids."""
    truncated: bool
    """The rendered conversation was longer than max_length tokens and was cut."""


def render(tokenizer, messages: Conversation, add_generation_prompt: bool, template_kwargs: dict[str, Any]) -> str:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    return text


def _sentinel(avoid: str, length: int = 3) -> str:
    """A short string of private-use characters none of which occurs in ``avoid``."""
    free = [c for c in _SENTINELS if c not in avoid]
    if len(free) < length:
        raise ValueError("a message uses every private-use sentinel character; cannot locate its turn")
    return "".join(free[:length])


def end_of_turn_token(tokenizer, template_kwargs: dict[str, Any] | None = None) -> str:
    """The token the chat template writes after an assistant's content, e.g. ``<|im_end|>``, ``<|eot_id|>``, ``</s>``.

    Found by rendering a probe conversation and matching the special / added tokens against the text that follows
    the assistant content (blank characters in between are allowed, as in Llama-2's ``' ' + eos_token``).
    """
    user = _sentinel("")
    reply = _sentinel(user)
    probe = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    text = render(tokenizer, probe, False, template_kwargs or {})
    at = text.find(reply)
    if at < 0:
        raise ValueError("the chat template does not write the assistant's content verbatim; cannot find its turns")
    after = text[at + len(reply) :].lstrip()
    candidates = set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())
    for token in sorted(candidates, key=len, reverse=True):
        if token and after.startswith(token):
            return token
    raise ValueError(
        f"no special token follows the assistant's content in the chat template (it is followed by {after[:40]!r}); "
        "the loss mask needs an end-of-turn token"
    )


def stop_token_ids(
    tokenizer, generation_config: Any = None, template_kwargs: dict[str, Any] | None = None
) -> list[int]:
    """The tokens that end an answer: the chat template's end-of-turn token, the tokenizer's eos and the model's
    generation-config eos (one id or a list). Regeneration stops on them and evaluation cuts its outputs at them."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(generation_config, "eos_token_id", None)
    if gen_eos is not None:
        ids.update(int(i) for i in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
    eot_id = tokenizer.convert_tokens_to_ids(end_of_turn_token(tokenizer, template_kwargs))
    if isinstance(eot_id, int) and eot_id != tokenizer.unk_token_id:
        ids.add(eot_id)
    if not ids:
        raise ConfigError(
            "the verifier's tokenizer has no eos token and its chat template no end-of-turn token",
            fix="use a verifier whose tokenizer defines an eos token",
        )
    return sorted(ids)


def _content_span(
    tokenizer, conversation: Conversation, i: int, full: str, template_kwargs: dict[str, Any]
) -> tuple[int, int]:
    """[a, b) of turn i's content in ``full``, from where a rendering with that content replaced differs from it.

    Only the answer (what follows a ``</think>``) is replaced: templates that parse think blocks (Qwen3) would
    otherwise render the turn differently around it. A think block the template wrote back verbatim just before the
    answer is then included in the span.
    """
    content = conversation[i]["content"]
    cut = content.rfind("</think>")
    head = content[: cut + len("</think>")] if cut >= 0 else ""
    sentinel = _sentinel(full)
    altered = [dict(m) for m in conversation]
    altered[i]["content"] = head + sentinel
    alt = render(tokenizer, altered, False, template_kwargs)
    limit = min(len(full), len(alt))
    a = _common_prefix(full, alt, limit)
    suffix = _common_prefix(full[::-1], alt[::-1], limit - a)
    b, alt_b = len(full) - suffix, len(alt) - suffix
    if alt[a:alt_b] != sentinel:
        raise ValueError(
            f"cannot locate assistant turn {i}: replacing its content changed more of the rendering than the content "
            f"({alt[a:alt_b][:60]!r}); the chat template transforms this turn in a way fledge does not handle"
        )
    before = full[:a].rstrip()
    if head.strip() and before.endswith(head.strip()):
        a = len(before) - len(head.strip())
    return a, b


def _common_prefix(x: str, y: str, limit: int) -> int:
    """Length of the common prefix of x and y, at most ``limit``; binary search over slices runs in C."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if x[lo:mid] == y[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def assistant_spans(
    tokenizer,
    conversation: Conversation,
    full: str,
    eot: str,
    template_kwargs: dict[str, Any],
    char_limit: int | None = None,
) -> list[tuple[int, int]]:
    """Character spans [start, end) in ``full`` of each assistant turn, from its first generated character through its
    end-of-turn token. Turns starting at or after ``char_limit`` (cut by truncation) are not located."""
    char_limit = len(full) if char_limit is None else char_limit
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, conversation[:i], True, template_kwargs)
        start = len(prompt) if full.startswith(prompt) else None
        if start is not None and start >= char_limit:
            break
        turn = render(tokenizer, conversation[: i + 1], False, template_kwargs)
        if start is not None and len(turn) > start and full.startswith(turn):
            eot_at = full.rfind(eot, start, len(turn))
            if eot_at < 0:
                raise ValueError(f"assistant turn {i}: no end-of-turn token {eot!r} in its rendering")
        else:
            a, b = _content_span(tokenizer, conversation, i, full, template_kwargs)
            if a >= char_limit:
                break
            # The generation prompt, when it is a prefix, marks the turn's start (it may precede template-added text
            # such as a think block); otherwise the turn starts with its content.
            if start is None or start > a or eot in full[start:a]:
                start = a
            eot_at = b + (len(full[b:]) - len(full[b:].lstrip()))
            if not full.startswith(eot, eot_at):
                raise ValueError(
                    f"assistant turn {i}: its content is followed by {full[b:b + 30]!r}, "
                    f"not the end-of-turn token {eot!r}"
                )
        spans.append((start, eot_at + len(eot)))
    return spans


def _tokenize_head(tokenizer, text: str, max_length: int, eot: str) -> tuple[list[int], list[tuple[int, int]], bool]:
    """The first ``max_length`` tokens of ``text`` with their offsets, and whether there were more.

    Long conversations are tokenised only as far as needed: the text is cut right after an end-of-turn token, an
    added token that the tokenizer splits off before any merging, so the cut text's tokens are exactly the first
    tokens of the whole. The cut is pushed further (doubling) until it holds more than ``max_length`` tokens.
    """
    reach = max_length * 8  # characters; most tokens are 2-6 characters long
    while True:
        cut = text.find(eot, reach)
        head = text if cut < 0 else text[: cut + len(eot)]
        enc = tokenizer(head, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = enc["input_ids"]
        if cut < 0 or len(ids) > max_length:
            break
        reach = max(2 * reach, cut + len(eot))
    offsets = [tuple(o) for o in enc["offset_mapping"][:max_length]]
    return list(ids[:max_length]), offsets, len(ids) > max_length


def tokenize_conversation(
    tokenizer,
    conversation: Conversation,
    max_length: int,
    *,
    template_kwargs: dict[str, Any] | None = None,
    eot: str | None = None,
) -> Tokenized:
    """Render with the tokenizer's chat template, tokenise, mask the assistant turns, cut to ``max_length`` tokens.

    ``template_kwargs`` go to ``apply_chat_template`` (e.g. ``{"enable_thinking": False}`` for Qwen3); ``eot`` skips
    finding the end-of-turn token again when many conversations share a tokenizer.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer; the loss mask needs offset mappings")
    kwargs = template_kwargs or {}
    eot = eot or end_of_turn_token(tokenizer, kwargs)
    full = render(tokenizer, conversation, False, kwargs)
    ids, offsets, truncated = _tokenize_head(tokenizer, full, max_length, eot)
    char_limit = offsets[-1][1] if offsets else 0

    mask = [0] * len(ids)
    starts = [s for s, _ in offsets]
    ends = [e for _, e in offsets]
    for a, b in assistant_spans(tokenizer, conversation, full, eot, kwargs, char_limit):
        # Tokens overlapping [a, b): a token that straddles the header/content edge is the model's to predict too.
        for t in range(bisect_right(ends, a), bisect_left(starts, b)):
            mask[t] = 1
    return Tokenized(input_ids=ids, loss_mask=mask, truncated=truncated)


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for t, m in enumerate(mask + [0]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            runs.append((start, t))
            start = None
    return runs


def _answer(content: str) -> str:
    """The visible answer of an assistant message: what follows its think block, if it has one."""
    return content.split("</think>")[-1].strip()


def _is_preamble(text: str) -> bool:
    """Whether text may precede an answer inside its turn's span: nothing, blanks, or one think block."""
    text = text.strip()
    return not text or _THINK_BLOCK.fullmatch(text) is not None


def check_loss_mask(tokenizer, conversation: Conversation, tok: Tokenized, eot: str | None = None) -> None:
    """Raise ValueError unless each masked span, decoded, is one assistant turn: [think block] + content + eot.

    Allowed slack: blanks at either end (templates trim or pad content), a think block before the answer, and one
    token straddling the span's start (byte-level BPE may merge the header's last character with the content's first).
    A span cut by truncation must be a prefix of its turn.
    """
    eot = eot or end_of_turn_token(tokenizer)
    if len(tok.loss_mask) != len(tok.input_ids):
        raise ValueError(f"loss_mask has {len(tok.loss_mask)} entries for {len(tok.input_ids)} tokens")
    if any(m not in (0, 1) for m in tok.loss_mask):
        raise ValueError("loss_mask holds values other than 0 and 1")
    answers = [_answer(m["content"]) for m in conversation if m["role"] == "assistant"]
    runs = _runs(tok.loss_mask)
    if not runs:
        raise ValueError("no token is masked for loss")
    if len(runs) > len(answers) or (not tok.truncated and len(runs) != len(answers)):
        raise ValueError(f"{len(runs)} masked spans for {len(answers)} assistant turns")
    for k, (lo, hi) in enumerate(runs):
        text = tokenizer.decode(tok.input_ids[lo:hi], skip_special_tokens=False)
        # At most this many leading characters may belong to the header, in a token that reaches into the answer.
        straddle = len(tokenizer.decode(tok.input_ids[lo : lo + 1], skip_special_tokens=False)) - 1
        if tok.truncated and hi == len(tok.input_ids) and not text.endswith(eot):
            body = text.rstrip("\ufffd")  # the cut may split a multi-byte character
            if not any(_starts_turn(body[j:], answers[k]) for j in range(min(straddle, len(body)) + 1)):
                raise ValueError(
                    f"masked span {k} (cut by truncation) is not the start of assistant turn {k}: {text[:80]!r}"
                )
            continue
        if not text.endswith(eot):
            raise ValueError(f"masked span {k} does not end with the end-of-turn token {eot!r}: ...{text[-80:]!r}")
        body = text[: -len(eot)].rstrip()
        if not body.endswith(answers[k]):
            raise ValueError(f"masked span {k} is not assistant turn {k}: {body[:80]!r} vs {answers[k][:80]!r}")
        extra = body[: len(body) - len(answers[k])]
        if not any(_is_preamble(extra[j:]) for j in range(min(straddle, len(extra)) + 1)):
            raise ValueError(f"masked span {k} holds more than assistant turn {k}: it starts with {extra[:80]!r}")


def _starts_turn(text: str, answer: str) -> bool:
    """Whether text is how a turn with this answer begins: [blanks][think block][blanks] and a prefix of the answer."""
    text = text.lstrip()
    if text.startswith("<think>"):
        block = _THINK_BLOCK.match(text)
        if block is None:
            return True  # cut inside the think block: nothing of the answer to compare yet
        text = text[block.end() :]
    elif "<think>".startswith(text):
        return True
    return answer.startswith(text) or answer.startswith(text.rstrip())


def tokenize_all(
    tokenizer,
    conversations: list[Conversation],
    max_length: int,
    desc: str = "tokenize",
    *,
    template_kwargs: dict[str, Any] | None = None,
    verify: int = 16,
) -> tuple[list[Tokenized], dict[str, int]]:
    """Tokenise many conversations; those with no masked token left after truncation are dropped (counted).

    The first ``verify`` results are checked with ``check_loss_mask``, so that a template the span finder gets wrong
    fails at once instead of training on the wrong tokens. A conversation the template itself rejects (Jinja
    ``raise_exception``, e.g. a system turn for Mistral v0.1) is skipped and counted, unless every one is.
    """
    kwargs = template_kwargs or {}
    eot = end_of_turn_token(tokenizer, kwargs)
    stats = {k: 0 for k in ("conversations", "kept", "tokens", "masked_tokens", "truncated", "dropped_no_mask",
                            "template_errors")}
    out: list[Tokenized] = []
    first_error: str | None = None
    for conversation in tqdm(conversations, desc=desc):
        stats["conversations"] += 1
        try:
            tok = tokenize_conversation(tokenizer, conversation, max_length, template_kwargs=kwargs, eot=eot)
        except TemplateError as e:
            stats["template_errors"] += 1
            if first_error is None:
                first_error = f"conversation {stats['conversations'] - 1}: the chat template refused it: {e}"
                log.warning("%s (such conversations are skipped)", first_error)
            continue
        stats["truncated"] += tok.truncated
        masked = sum(tok.loss_mask)
        if masked == 0:
            stats["dropped_no_mask"] += 1
            if tok.truncated and "first_cut_length" not in stats:  # what a refusal of all of them has to say
                full = render(tokenizer, conversation, False, kwargs)
                stats["first_cut_length"] = len(tokenizer(full, add_special_tokens=False)["input_ids"])
            continue
        if len(out) < verify:
            check_loss_mask(tokenizer, conversation, tok, eot)
        out.append(tok)
        stats["kept"] += 1
        stats["tokens"] += len(tok.input_ids)
        stats["masked_tokens"] += masked
    if conversations and stats["template_errors"] == len(conversations):
        raise ValueError(f"the chat template refused every conversation; the first: {first_error}")
    return out, stats
