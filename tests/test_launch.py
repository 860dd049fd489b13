"""launch/slurm.sbatch: the commands it runs on each node, with srun and scontrol replaced by shims."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def run_sbatch(tmp_path: Path, args: list[str], **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    # srun: run the command once per node of the step, with that node's SLURM_NODEID
    _script(bin_dir / "srun", """
nodes=1
while [[ $# -gt 0 && $1 == -* ]]; do
  case $1 in --nodes=*) nodes=${1#--nodes=} ;; esac
  shift
done
for ((i = 0; i < nodes; i++)); do SLURM_NODEID=$i "$@" || exit $?; done
""")
    _script(bin_dir / "scontrol", 'echo gpu-node-a\necho gpu-node-b\n')
    # python: torchrun.sh asks it whether CUDA is there (say yes); every other call is logged, not run
    python = _script(tmp_path / "python", f"""
if [[ $1 == -c ]]; then echo 1; exit 0; fi
echo "node_rank=${{NODE_RANK:-}} $*" >> {log}
""")
    full_env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHON": str(python),
        "SLURM_JOB_NODELIST": "gpu-node-[a-b]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_SUBMIT_DIR": str(REPO),
        **env,
    }
    proc = subprocess.run(["bash", str(REPO / "launch" / "slurm.sbatch"), *args], env=full_env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    return proc, (log.read_text().splitlines() if log.exists() else [])


def test_sbatch_runs_each_stage_on_every_node_then_eval_and_export_once(tmp_path):
    proc, calls = run_sbatch(tmp_path, ["preset=llama3.3-70b-instruct", "train.lr=2e-4"], VERIFIER_PROCS_PER_NODE="1")
    assert proc.returncode == 0, proc.stderr
    dist = [c for c in calls if "torch.distributed.run" in c]
    assert len(dist) == 6  # regenerate, cache, train x 2 nodes
    for i, stage in enumerate(["regenerate", "cache", "train"]):
        procs = 8 if stage == "train" else 1  # a 70B verifier spreads over a whole node (verifier.device_map=auto)
        for node in (0, 1):
            call = dist[2 * i + node]
            assert call.startswith(f"node_rank={node} -m torch.distributed.run --nproc_per_node {procs} --nnodes 2 "
                                   f"--node_rank {node} --rdzv_backend c10d --rdzv_endpoint gpu-node-a:29500 "
                                   f"--rdzv_id 4242-{stage} -m fledge.launch.cli {stage} ")
            assert call.endswith("preset=llama3.3-70b-instruct train.lr=2e-4")
    single = [c for c in calls if "torch.distributed.run" not in c]
    assert single == [
        "node_rank= -m fledge.launch.cli eval preset=llama3.3-70b-instruct train.lr=2e-4",
        "node_rank= -m fledge.launch.cli export preset=llama3.3-70b-instruct train.lr=2e-4",
    ]


def test_sbatch_on_one_node_uses_a_standalone_rendezvous_and_chosen_stages(tmp_path):
    proc, calls = run_sbatch(tmp_path, ["preset=qwen3-8b"], SLURM_NNODES="1", STAGES="cache train", GPUS_PER_NODE="4")
    assert proc.returncode == 0, proc.stderr
    assert calls == [
        "node_rank=0 -m torch.distributed.run --nproc_per_node 4 --standalone -m fledge.launch.cli cache preset=qwen3-8b",
        "node_rank=0 -m torch.distributed.run --nproc_per_node 4 --standalone -m fledge.launch.cli train preset=qwen3-8b",
    ]


def test_sbatch_refuses_an_unknown_stage_and_a_run_outside_slurm(tmp_path):
    proc, _ = run_sbatch(tmp_path, [], STAGES="cache trian")
    assert proc.returncode == 2 and "unknown stage 'trian'" in proc.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(REPO / "launch" / "slurm.sbatch")], env={**env, "FLEDGE_ROOT": str(REPO)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "sbatch" in proc.stderr


def test_deepspeed_launcher_with_a_hostfile_hands_fledge_variables_to_every_host(tmp_path):
    """launch/deepspeed.sh: the launcher command, and the env file that carries FLEDGE_RUNS to the other hosts."""
    log = tmp_path / "calls.log"
    python = _script(tmp_path / "python", "echo 1\n")  # "CUDA is there"
    _script(tmp_path / "deepspeed", f'echo "$*" >> {log}\ncat "$DS_ENV_FILE" >> {log}\n')
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-0 slots=8\nnode-1 slots=8\n")
    env = {**os.environ, "PYTHON": str(python), "HOSTFILE": str(hostfile), "FLEDGE_RUNS": "/shared/runs",
           "WANDB_MODE": "online"}
    env.pop("DS_ENV_FILE", None)
    proc = subprocess.run(["bash", str(REPO / "launch" / "deepspeed.sh"), "8", "preset=llama3.3-70b-instruct"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = log.read_text().splitlines()
    assert lines[0] == (f"--no_local_rank --master_port 29500 --hostfile {hostfile} --num_gpus 8 --module fledge.launch.cli "
                        "train engine.kind=deepspeed preset=llama3.3-70b-instruct")
    assert "FLEDGE_RUNS=/shared/runs" in lines[1:] and "WANDB_MODE=online" in lines[1:]


def test_the_launchers_ask_for_expandable_cuda_segments_unless_the_user_set_it():
    for name in ("torchrun.sh", "deepspeed.sh", "slurm.sbatch"):
        text = (REPO / "launch" / name).read_text()
        assert "export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}" in text, name
