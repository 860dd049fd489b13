"""Building the n-gram datastore (``decode/datastore.py``) from a data source's assistant turns: ``shipped`` (the
default verifier's own answers) or any ``data.source``."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from fledge.core.errors import ConfigError
from fledge.decode.datastore import NgramDatastore
from fledge.decode.recycle import UNKNOWN, bigram_successors

log = logging.getLogger(__name__)

SHIPPED = "shipped"
"""``hybrid_datastore=shipped``: the default verifier's answers that ship with fledge
(``data.source=sharegpt-smollm2``)."""


def answer_token_ids(conversations: Iterable[list[dict]], tokenizer) -> list[list[int]]:
    """The assistant turns of ``conversations``, each tokenized on its own (no special tokens)."""
    return [tokenizer(m["content"], add_special_tokens=False)["input_ids"]
            for conv in conversations for m in conv if m["role"] == "assistant" and m["content"]]


def load_answers(source: str, tokenizer, fingerprint: str | None = None) -> list[list[int]]:
    """The token ids of a data source's assistant turns (``shipped``, or any ``data.source``: a name or a .jsonl
    path). For the shipped answers, a warning when they are another verifier's (``fingerprint``: this one's)."""
    from fledge.data.sources import SHIPPED_SOURCE, DataConfig, load_conversations

    name = SHIPPED_SOURCE if source == SHIPPED else source
    if name == SHIPPED_SOURCE and fingerprint is not None:
        from fledge.data.shipped import warn_if_other_verifier

        warn_if_other_verifier(fingerprint)
    conversations, _ = load_conversations(DataConfig(source=name))
    return answer_token_ids(conversations, tokenizer)


def load_datastore(source: str, tokenizer, fingerprint: str | None = None) -> NgramDatastore:
    """The datastore of a data source's assistant turns (``load_answers``)."""
    answers = load_answers(source, tokenizer, fingerprint)
    store = NgramDatastore(answers)
    if not len(store):
        raise ConfigError(f"datastore {source!r}: its answers hold no {store.min_ngram}-gram",
                          fix="give a source with assistant turns, or hybrid_datastore=null")
    log.info("datastore %s: %d answers' tokens (%s), %s n-grams (n = %d..%d) in %.1f s", source, len(answers),
             f"{store.tokens:,}", f"{len(store):,}", store.min_ngram, store.max_ngram, store.seconds)
    return store


def recycle_seed(source: str | None, tokenizer, vocab_size: int, k: int,
                 fingerprint: str | None = None) -> torch.Tensor:
    """[V, k] each token's k most frequent successors in a source's answers (``load_answers``), where a recycle
    table starts (``decode/recycle.py``); all unknown for ``source`` None."""
    if source is None:
        return bigram_successors([], vocab_size, k)
    answers = load_answers(source, tokenizer, fingerprint)
    seed = bigram_successors(answers, vocab_size, k)
    known = int((seed[:, 0] != UNKNOWN).sum())
    if not known:
        raise ConfigError(f"recycle seed {source!r}: its answers hold no two consecutive tokens",
                          fix="give a source with assistant turns, or hybrid_recycle_seed=null")
    log.info("recycle seed %s: successors of %s tokens from %s answer tokens", source, f"{known:,}",
             f"{sum(len(a) for a in answers):,}")
    return seed

