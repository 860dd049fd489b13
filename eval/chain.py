"""Chain speculative decoding: the drafter proposes n tokens, one verifier forward checks them all.

Per round: one forward over [newest token, d_1..d_n]; greedy accepts the longest prefix that matches the
verifier's argmax, sampling applies Leviathan's rule; the verifier cache is cropped back to the accepted prefix
and the drafter is told which tokens were committed (with the verifier's features of those positions).
"""

from __future__ import annotations

import torch
from torch import nn

from fledge.eval.proposals import Drafter
from fledge.eval.sampling import greedy_accept, leviathan_accept
from fledge.eval.verifier_state import DecodeResult, RoundTimer, VerifierState, clock, stop_index
from fledge.models.sampling import SamplingParams, target_probs


def topk_ranks(predicted: torch.Tensor, top_ids: torch.Tensor, accepted: int) -> list[tuple[int, int]]:
    """(depth, rank of the verifier's token among the draft's top-k) for each depth the round reached: depths
    1..accepted+1, as far as there were drafts. A rank of k means "not among the top k"."""
    reached = min(accepted + 1, top_ids.shape[0])
    hits = top_ids[:reached] == predicted[:reached, None]
    k = top_ids.shape[1]
    ranks = torch.where(hits.any(dim=1), hits.int().argmax(dim=1), torch.full((reached,), k, device=hits.device))
    return list(enumerate(ranks.tolist(), start=1))


@torch.inference_mode()
def generate_chain(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    drafter: Drafter,
    *,
    num_draft_tokens: int,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_ids: frozenset[int] = frozenset(),
    aux_layer_ids: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> DecodeResult:
    """Decode up to ``max_new_tokens`` after ``prompt_ids`` [T]; lossless with respect to ``generate_plain``."""
    if drafter.needs_aux and not aux_layer_ids:
        raise ValueError("this drafter reads the verifier's aux hidden states: pass aux_layer_ids")
    device = next(model.parameters()).device
    result = DecodeResult(tokens=[])
    start = clock(device)
    with VerifierState(model, aux_layer_ids if drafter.needs_aux else None) as state:
        drafter.start(prompt_ids.cpu(), state.prefill(prompt_ids))
        result.prefill_seconds = clock(device) - start
        tokens: list[int] = []
        root = prompt_ids[-1:].clone().to(device)
        done = max_new_tokens <= 0
        timer = RoundTimer(device, result)
        while not done:
            # A round emits at most n+1 tokens; drafting past the budget would only cost time.
            draft = drafter.propose_chain(min(num_draft_tokens, max_new_tokens - len(tokens) - 1), sampling, generator)
            timer.lap("draft")
            n = draft.tokens.numel()
            draft_tokens = draft.tokens.to(device)
            verifier_input = torch.cat([root, draft_tokens])
            timer.lap("other")
            logits, aux = state.forward(verifier_input)
            timer.lap("verify")
            if sampling.greedy:
                accepted, next_token, predicted = greedy_accept(logits, draft_tokens)
                if draft.top_ids is not None:
                    result.topk_ranks += topk_ranks(predicted, draft.top_ids.to(device), accepted)
                    result.topk_width = int(draft.top_ids.shape[1])
            else:
                q = None if draft.q is None else draft.q.to(device)
                accepted, next_token = leviathan_accept(target_probs(logits, sampling), draft_tokens, q, generator)
            timer.lap("accept")
            # Keep the root and the accepted drafts; the rejected drafts' keys/values go.
            state.crop(state.length - n + accepted)
            timer.lap("kv_update")
            new_tokens = draft.tokens[:accepted].tolist() + [next_token]
            tokens.extend(new_tokens)
            root.fill_(next_token)
            result.accepted.append(accepted)
            result.proposed.append(n)
            result.tree_nodes.append(n)
            done = len(tokens) >= max_new_tokens or not stop_ids.isdisjoint(new_tokens)
            timer.lap("other")
            if not done:
                drafter.advance(torch.tensor(new_tokens), None if aux is None else aux[: accepted + 1])
                timer.lap("draft_update")
        timer.close()
    result.tokens = tokens[: stop_index(tokens, stop_ids, max_new_tokens)]
    result.seconds = clock(device) - start
    return result
