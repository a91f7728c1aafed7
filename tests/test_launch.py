"""Multi-node: helpers.launch and the Slurm scripts, with two "nodes" simulated on this machine."""

import os
import shlex
import subprocess
import sys

import pytest
from conftest import FSDP, REPO, ZERO3, job_env, summary

from helpers.launch import free_port, torchrun_command

JOB = ["--config", FSDP, "--out", "runs/x"]


def launch(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "helpers.launch", *args], cwd=REPO, env=job_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_one_node_is_standalone_several_use_c10d_on_loopback_unless_told():
    one = launch("--nproc-per-node", "2", "--", *JOB)
    assert one.returncode == 0 and one.stdout == (
        f"torchrun --standalone --nnodes 1 --nproc-per-node 2 -m helpers.train {shlex.join(JOB)}\n")
    two = shlex.split(launch("--nnodes", "2", "--nproc-per-node", "4", "--master-port", "29400", "--", *JOB).stdout)
    assert two[two.index("--rdzv-backend") + 1] == "c10d"
    assert two[two.index("--rdzv-endpoint") + 1] == "127.0.0.1:29400"
    assert two[two.index("--local-addr") + 1] == "127.0.0.1" and "--standalone" not in two
    cluster = torchrun_command(JOB, 2, 8, master_addr="node001", master_port=29500)
    assert "node001:29500" in cluster and "--local-addr" not in cluster
    assert torchrun_command(JOB, 2, 1, node_rank=1)[-len(JOB) - 4:-len(JOB) - 2] == ["--rdzv-conf", "is_host=0"]


@pytest.mark.parametrize("args,needle", [
    (["--nnodes", "0"], "--nnodes = 0: must be an integer >= 1"),
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank = 2: must be in 0..1"),
    (["--master-port", "70000", "--nnodes", "2"], "--master-port = 70000"),
    (["--nnodes", "two"], "argument --nnodes: invalid int value: 'two'"),
])
def test_launch_refuses_bad_settings_in_one_line(args, needle):
    proc = launch(*args, "--", *JOB)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and needle in proc.stderr, proc.stderr
    assert launch("--nnodes", "1").stderr.startswith("error: give the job after --")


@pytest.mark.cpu_only("two nodes on one machine both take GPU 0, which nccl refuses")
@pytest.mark.parametrize("backend,config", [("fsdp", FSDP), ("deepspeed", ZERO3)])
def test_two_nodes_train_like_one(tiny_pair, tmp_path, backend, config):
    """Two torchrun processes (--nnodes 2, one rank each) meet on 127.0.0.1 and train like one 2-rank node."""
    out, port = tmp_path / "two_nodes", free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "helpers.launch", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(r), "--master-port", str(port), "--run", "--",
                               "--config", config, "--out", str(out), "--model", "tiny", "--steps", "4"],
                              cwd=REPO, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    try:
        logs = [node.communicate(timeout=600)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill() if node.poll() is None else None
    assert [node.returncode for node in nodes] == [0, 0], [log[-3000:] for log in logs]
    two, one = summary(out), summary(tiny_pair[backend])
    assert two["num_nodes"] == 2 and two["world_size"] == 2 and one["num_nodes"] == 1
    assert two["losses"] == one["losses"][:4]  # exact: the same 4 steps as the single-node 2-rank run


def _fake_slurm(tmp_path, hosts: str, srun_body: str) -> dict:
    """PATH shims for scontrol (prints ``hosts``) and srun, plus the variables Slurm sets."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && printf "{hosts}"\n')
    (bin_dir / "srun").write_text("#!/bin/bash\n" + srun_body)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = job_env()
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SLURM_JOB_NODELIST="node[1-2]", SLURM_NNODES="2",
               SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(REPO), SLURM_GPUS_ON_NODE="8")
    return env


@pytest.mark.cpu_only("two nodes on one machine both take GPU 0, which nccl refuses")
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_sbatch_runs_the_launch_command_once_per_node(tmp_path, backend):
    env = _fake_slurm(tmp_path, "node1\\nnode2\\n", 'printf "%s\\n" "$@"\n')  # dry run: print srun's argv
    env["SLURM_JOB_NAME"] = f"guide-{backend}"
    proc = subprocess.run(["bash", f"launch_configs/slurm/{backend}.sbatch"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.splitlines()
    assert argv[:2] == ["--ntasks-per-node=1", "--kill-on-bad-exit=1"]  # one torchrun per node
    train = ["--config", {"fsdp": FSDP, "deepspeed": ZERO3}[backend], "--out", f"runs/guide-{backend}-4242",
             "--model", "small", "--steps", "100"]
    # c10d rendezvous on the first node, a port of its own per job: what helpers.launch prints
    assert argv[2:] == torchrun_command(train, 2, 8, master_addr="node1", master_port=20000 + 4242,
                                        rdzv_id="4242")

