"""vLLM as a decoding engine for fledge's data stages, in a process and an environment of its own.

vLLM pins its own torch and transformers, so it never goes into fledge's environment: ``make vllm-env`` builds
``.venv-vllm`` beside ``.venv`` (``launch/vllm_env.sh``), and :class:`VllmEngine` starts ``data/vllm_worker.py`` with
that environment's Python and speaks JSON lines to it. fledge keeps everything that decides *what* is generated (the
chat template, the tokenizer, the stop tokens, the limits, the seeds) and hands vLLM token ids; vLLM only decodes.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

from fledge.core.errors import FledgeError

log = logging.getLogger(__name__)

WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
REPO = Path(__file__).resolve().parents[1]
INSTALL = ("make vllm-env (vLLM's CPU build in .venv-vllm), or point regenerate.vllm_python / cache.vllm_python at a "
           "Python with vLLM installed")


class EngineError(FledgeError, RuntimeError):
    """The vLLM engine is missing, would not start, or stopped answering."""


def find_vllm_python(explicit: str | None) -> Path:
    """The Python of vLLM's environment: ``explicit``, else ``$FLEDGE_VLLM_PYTHON``, else ``.venv-vllm`` in the
    checkout. Refused, with the install command, when it is not there."""
    choice = explicit or os.environ.get("FLEDGE_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    path = Path(choice).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise EngineError(f"engine=vllm needs a Python with vLLM installed; there is none at {path}", fix=INSTALL)
    return path


class VllmEngine:
    """One vLLM ``LLM`` in a worker process; :meth:`generate` decodes a batch of token-id prompts.

    ``settings`` are ``LLM(**settings)``'s keywords (``model``, ``dtype``, ``max_model_len``, ...). The worker's
    stderr (vLLM's log) goes to ``log_path``; its last lines are in any error.
    """

    def __init__(self, python: Path, settings: dict[str, Any], log_path: Path, env: dict[str, str] | None = None):
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "a")
        self._proc = subprocess.Popen(
            [str(python), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            bufsize=1, env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
        )
        self.info = self._call({**settings, "env": env or {}})
        if not self.info.get("ready"):
            self._fail(f"vLLM did not start (it answered {self.info})")
        log.info("vLLM %s (torch %s) loaded %s in %.1f s", self.info["vllm"], self.info["torch"], settings["model"],
                 self.info["load_seconds"])

    def _fail(self, what: str) -> None:
        self.close()
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-15:] if self.log_path.is_file() else []
        raise EngineError(f"{what}; the end of its log ({self.log_path}):\n" + "\n".join(tail), fix=INSTALL)

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        if self._proc.poll() is not None:
            self._fail(f"the vLLM worker exited with status {self._proc.returncode}")
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            self._fail("the vLLM worker stopped reading")
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait()
            self._fail(f"the vLLM worker exited with status {self._proc.returncode}")
        reply = json.loads(line)
        if "error" in reply:
            self._fail(f"vLLM failed: {reply['error']}")
        return reply

    def generate(self, prompts: list[list[int]], max_tokens: list[int], stop_ids: list[int], temperature: float,
                 top_p: float, seeds: list[int]) -> list[dict[str, Any]]:
        """Per prompt ``{"token_ids": [...], "finish_reason": "stop" | "length"}``, in the prompts' order."""
        reply = self._call({"prompts": prompts, "max_tokens": max_tokens, "stop_ids": stop_ids,
                            "temperature": temperature, "top_p": top_p, "seeds": seeds})
        return reply["outputs"]

    def capture(self, prompts: list[list[int]]) -> list[str]:
        """The safetensors file of each prompt's captured states (an engine started with ``"capture": true``)."""
        return self._call({"capture": prompts})["files"]

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=120)
            except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def vllm_dtype(dtype) -> str:
    """vLLM's name for a torch dtype."""
    return {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}[str(dtype)]


def cpu_env() -> dict[str, str]:
    """What vLLM's CPU build needs set before it starts: a KV cache it can hold (GiB), unless the caller set one."""
    return {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}

