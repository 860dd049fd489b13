"""Tree speculative decoding (EAGLE-2 dynamic tree): one verifier pass over the whole draft tree.

The tree goes through the verifier as one flat sequence [root, node_0..node_{M-1}] with position
``root position + depth`` per node and a 4D additive attention mask: each row sees the committed prefix, its own
ancestors and itself. transformers 5.24's ``create_causal_mask`` returns a 4D ``attention_mask`` unchanged
(``_preprocess_mask_arguments``: "If the mask is already 4D, simply return as-is"), and both the sdpa and the
eager attention of Llama / Qwen2 / Qwen3 / Mistral take an additive float mask, so no model code is patched.
A sliding window (Mistral) has to be applied by this mask too, since the model's own mask is bypassed.

After the walk only the accepted path's keys/values stay in the cache (``VerifierState.keep``).
"""

from __future__ import annotations

import torch
from torch import nn

from fledge.eval.proposals import Drafter, DraftTree, TreeShape
from fledge.eval.sampling import multi_candidate_accept
from fledge.eval.verifier_state import DecodeResult, RoundTimer, VerifierState, clock, stop_index
from fledge.models.sampling import SamplingParams, sample, target_probs


def tree_attention_mask(
    parents: torch.Tensor,
    depths: torch.Tensor,
    prefix_length: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """[1, 1, M+1, prefix_length + M+1] additive mask (0 = attend, dtype min = masked) for [root, nodes]."""
    size = parents.numel() + 1
    device = parents.device
    parent_rows = torch.cat([torch.zeros(1, dtype=torch.long, device=device), parents + 1])
    sees = torch.eye(size, dtype=torch.bool, device=device)
    # Each pass adds one more generation of ancestors; the deepest path needs depth passes.
    for _ in range(int(depths.max()) if depths.numel() else 0):
        sees = sees | sees[parent_rows]
    visible = torch.cat([torch.ones(size, prefix_length, dtype=torch.bool, device=device), sees], dim=1)
    if sliding_window is not None:
        row_depth = torch.cat([torch.zeros(1, dtype=torch.long, device=device), depths])
        key_pos = torch.cat([torch.arange(prefix_length, device=device), prefix_length + row_depth])
        query_pos = prefix_length + row_depth
        # The models' own rule (masking_utils.sliding_window_overlay): key visible iff q - k < window.
        visible &= (query_pos[:, None] - key_pos[None, :]) < sliding_window
    mask = torch.zeros(size, prefix_length + size, dtype=dtype, device=device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask.view(1, 1, size, prefix_length + size)


def sliding_window_of(model: nn.Module) -> int | None:
    """The sliding window the model's own masks would apply (Mistral; Qwen only with use_sliding_window)."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def children_lists(parents: list[int]) -> list[list[int]]:
    """Per tree row (0 = root, i+1 = node i): its children's node indices, in the order they are to be tried."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        children[parent + 1].append(node)
    return children


def walk_greedy(logits: torch.Tensor, tree: DraftTree) -> tuple[list[int], int]:
    """Follow the children that match the verifier's argmax: (accepted node path, the next token)."""
    predicted = torch.argmax(logits, dim=-1).tolist()
    tokens = tree.tokens.tolist()
    children = children_lists(tree.parents.tolist())
    path: list[int] = []
    row = 0
    while True:
        want = predicted[row]
        child = next((c for c in children[row] if tokens[c] == want), None)
        if child is None:
            return path, want
        path.append(child)
        row = child + 1


def walk_sampled(
    logits: torch.Tensor, tree: DraftTree, sampling: SamplingParams, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Recursive rejection sampling down the tree: (accepted node path, residual or bonus token)."""
    children = children_lists(tree.parents.tolist())
    vocab = logits.shape[-1]
    path: list[int] = []
    row = 0
    while True:
        p = target_probs(logits[row], sampling)
        kids = children[row]
        if not kids:
            return path, int(sample(p, generator))
        candidates = tree.tokens[kids].to(logits.device)
        q = tree.q_target(row, vocab)
        chosen, token = multi_candidate_accept(p, candidates, None if q is None else q.to(p.device), generator)
        if chosen < 0:
            return path, token
        path.append(kids[chosen])
        row = kids[chosen] + 1


def empty_tree() -> DraftTree:
    none = torch.empty(0, dtype=torch.long)
    return DraftTree(tokens=none, parents=none, depths=none, q=None, q_rows=[-1], draft_to_target=None)


@torch.inference_mode()
def generate_tree(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    drafter: Drafter,
    *,
    shape: TreeShape,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_ids: frozenset[int] = frozenset(),
    aux_layer_ids: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> DecodeResult:
    """Decode up to ``max_new_tokens`` after ``prompt_ids`` [T] with a draft tree per verifier call."""
    if not drafter.supports_tree:
        raise ValueError(f"{type(drafter).__name__} cannot propose trees; use the chain loop")
    if drafter.needs_aux and not aux_layer_ids:
        raise ValueError("this drafter reads the verifier's aux hidden states: pass aux_layer_ids")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    window = sliding_window_of(model)
    result = DecodeResult(tokens=[])
    start = clock(device)
    with VerifierState(model, aux_layer_ids if drafter.needs_aux else None) as state:
        drafter.start(prompt_ids.cpu(), state.prefill(prompt_ids))
        result.prefill_seconds = clock(device) - start
        tokens: list[int] = []
        root = prompt_ids[-1:].clone().cpu()
        done = max_new_tokens <= 0
        timer = RoundTimer(device, result)
        while not done:
            budget = max_new_tokens - len(tokens) - 1  # a path longer than this would be cut anyway
            if budget > 0:
                round_shape = shape.capped(budget)
                tree = drafter.propose_tree(round_shape, sampling, generator)
            else:
                tree = empty_tree()
            timer.lap("draft")
            prefix = state.length
            root_and_nodes = torch.cat([root, tree.tokens.cpu()]).to(device)
            depths = tree.depths.to(device)
            positions = prefix + torch.cat([torch.zeros(1, dtype=torch.long, device=device), depths])
            mask = tree_attention_mask(tree.parents.to(device), depths, prefix, dtype, window)
            timer.lap("other")
            logits, aux = state.forward(root_and_nodes, positions, mask)
            timer.lap("verify")
            if sampling.greedy:
                path, next_token = walk_greedy(logits, tree)
            else:
                path, next_token = walk_sampled(logits, tree, sampling, generator)
            timer.lap("accept")
            state.keep(prefix + 1, path)
            timer.lap("kv_update")
            new_tokens = tree.tokens[path].tolist() + [next_token]
            tokens.extend(new_tokens)
            root.fill_(next_token)
            result.accepted.append(len(path))
            result.proposed.append(int(tree.depths.max()) if tree.size else 0)
            result.tree_nodes.append(tree.size)
            done = len(tokens) >= max_new_tokens or not stop_ids.isdisjoint(new_tokens)
            timer.lap("other")
            if not done:
                rows = torch.tensor([0] + [node + 1 for node in path], device=device)
                drafter.advance(torch.tensor(new_tokens), None if aux is None else aux[rows])
                timer.lap("draft_update")
        timer.close()
    result.tokens = tokens[: stop_index(tokens, stop_ids, max_new_tokens)]
    result.seconds = clock(device) - start
    return result
