"""Why a greedy speculative output parted from plain greedy decoding: a numerical tie, or a mismatch (a bug).

Checking k tokens in one forward rounds differently from checking one: in bf16 the two paths' logits differ by
about the dtype's rounding, and where the verifier's top two tokens are closer than that, the two decoders may pick
different ones. That is the verifier's own ambiguity, not a loss of exactness, and it cannot be told from a bug by
the outputs alone. So at each first difference the two competing tokens are scored again:

* the reference: the prefix (prompt + the common tokens) through the verifier in float32, one full forward;
* the rounding: the same forward in the evaluation's dtype; δ, the larger change it makes to the two tokens' logits;
* the gap: |l32(plain's token) - l32(the loop's token)|.

The difference is a **tie** when the gap is within what rounding can flip, ``gap <= 2δ + tolerance·eps·scale`` (each
logit may move by δ; ``eps`` is the dtype's machine epsilon and ``scale`` the largest |logit| there, a floor for a
float32 evaluation whose δ is zero), and a **mismatch** otherwise: a loop that is not exact. In float32 every
difference beyond a few ulps is a mismatch.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch
from torch import nn

DEFAULT_TIE_TOLERANCE = 2.0
"""Multiples of eps·scale added to 2δ: about one ulp of the logits themselves for each of the two tokens, the
rounding of the output alone, which the one measured forward may happen not to show."""


@dataclass
class Divergence:
    """The first position where a loop's greedy output parts from plain greedy decoding."""

    id: str
    position: int
    """Index in the generated tokens."""
    plain_token: int | None
    loop_token: int | None
    """None where that output had ended (a length difference without a token difference)."""
    kind: str
    """``tie`` or ``mismatch``."""
    gap: float | None = None
    """|l32(plain) - l32(loop)|: how far apart the two tokens are in float32."""
    rounding: float | None = None
    """δ: the larger change the evaluation's dtype makes to the two tokens' logits at this position."""
    threshold: float | None = None
    """What the gap was compared with: 2δ + tolerance·eps·scale."""

    def to_json(self) -> dict:
        return asdict(self)


class TieJudge:
    """Classifies first differences for one verifier; its float32 copy is made on first use (a bf16 verifier's
    copy doubles its memory for the length of the evaluation) and shared by every drafter and prompt set."""

    def __init__(self, model: nn.Module, tolerance: float = DEFAULT_TIE_TOLERANCE):
        self.model = model
        self.tolerance = tolerance
        self.dtype = next(model.parameters()).dtype
        self.device = model.get_input_embeddings().weight.device
        self._reference: nn.Module | None = model if self.dtype == torch.float32 else None

    @property
    def reference(self) -> nn.Module:
        if self._reference is None:
            self._reference = copy.deepcopy(self.model).float()
        return self._reference

    @torch.inference_mode()
    def _last_logits(self, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids.view(1, -1).to(self.device), logits_to_keep=1).logits[0, -1].float()

    def judge(self, prompt_id: str, prompt_ids: torch.Tensor, plain: list[int], loop: list[int]) -> Divergence:
        """Classify where ``loop`` first differs from ``plain`` (both greedy outputs after ``prompt_ids``)."""
        position = next((i for i, (a, b) in enumerate(zip(plain, loop)) if a != b), min(len(plain), len(loop)))
        a = plain[position] if position < len(plain) else None
        b = loop[position] if position < len(loop) else None
        if a is None or b is None:
            # Equal tokens up to where one output ends: the stop and length rules are exact, so this is a bug.
            return Divergence(str(prompt_id), position, a, b, "mismatch")
        prefix = torch.cat([prompt_ids.cpu(), torch.tensor(plain[:position], dtype=torch.long)])
        exact = self._last_logits(self.reference, prefix)
        rounded = exact if self.reference is self.model else self._last_logits(self.model, prefix)
        gap = float((exact[a] - exact[b]).abs())
        rounding = float(torch.maximum((rounded[a] - exact[a]).abs(), (rounded[b] - exact[b]).abs()))
        threshold = 2 * rounding + self.tolerance * torch.finfo(self.dtype).eps * float(exact.abs().max())
        kind = "tie" if gap <= threshold else "mismatch"
        return Divergence(str(prompt_id), position, a, b, kind, gap, rounding, threshold)

    def close(self) -> None:
        self._reference = self.model if self.dtype == torch.float32 else None
