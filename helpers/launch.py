"""The torchrun command for N nodes x M ranks per node: print it (default) or run it (``--run``).

    python -m helpers.launch --nnodes 1 --nproc-per-node 2 -- \\
        --config launch_configs/fsdp/full_shard.yaml --out runs/fsdp --model tiny --steps 20
    python -m helpers.launch --nnodes 2 --nproc-per-node 8 --master-addr node001 --master-port 29500 -- \\
        --config launch_configs/deepspeed/zero3.yaml --out runs/ds        # then run that line on every node

One node: ``torchrun --standalone``, a private rendezvous on a port the system
picks, so two jobs started at once never collide. Several nodes: c10d
rendezvous at ``--master-addr:--master-port``; the same command runs on every
node, and the node whose address is the master address hosts the rendezvous
store. Without ``--master-addr`` the rendezvous is on 127.0.0.1, which only
the "nodes" of this machine can reach (how the tests simulate two nodes); name
the head node to reach other machines. ``--node-rank 0`` marks the command of
the node that hosts the store (``is_host``), the others get ``is_host=0``.

On a Slurm cluster, ``launch_configs/slurm/*.sbatch`` run the same command with
the first node of the allocation as the master.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys

from helpers.core.cli import OneLineParser

LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 29500  # torchrun's own default; pick another for a second job on the same head node


class LaunchError(ValueError):
    """Impossible launch settings; the message names the value and what is allowed."""


def free_port(host: str = LOOPBACK) -> int:
    """A port that is free on ``host`` right now (for a rendezvous you start at once)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_command(train_args: list[str], nnodes: int = 1, nproc_per_node: int = 1, *,
                     node_rank: int | None = None, master_addr: str | None = None,
                     master_port: int | None = None, rdzv_id: str = "guide",
                     launcher: tuple[str, ...] = ("torchrun",)) -> list[str]:
    """argv of the torchrun command that runs ``helpers.train train_args`` on this node."""
    for name, v in (("--nnodes", nnodes), ("--nproc-per-node", nproc_per_node)):
        if not isinstance(v, int) or v < 1:
            raise LaunchError(f"{name} = {v!r}: must be an integer >= 1")
    if master_port is not None and not 0 < master_port < 65536:
        raise LaunchError(f"--master-port = {master_port}: must be in 1..65535")
    if node_rank is not None and not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank = {node_rank}: must be in 0..{nnodes - 1} for --nnodes {nnodes}")
    cmd = [*launcher]
    if nnodes == 1 and master_addr is None and master_port is None:
        cmd += ["--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc_per_node)]
    else:
        host = master_addr or LOOPBACK
        port = master_port or DEFAULT_PORT
        cmd += ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{port}", "--rdzv-id", rdzv_id]
        if host == LOOPBACK:  # every "node" is this machine: advertise loopback, not the hostname
            cmd += ["--local-addr", LOOPBACK]
        if node_rank is not None and nnodes > 1:
            cmd += ["--rdzv-conf", f"is_host={int(node_rank == 0)}"]
    return [*cmd, "-m", "helpers.train", *train_args]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = OneLineParser(prog="python -m helpers.launch", description=__doc__.split("\n\n")[0],
                 epilog="Everything after -- goes to helpers.train (--config ... --out ...).")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--nproc-per-node", type=int, default=1)
    ap.add_argument("--node-rank", type=int, help="0 on the node that hosts the rendezvous store")
    ap.add_argument("--master-addr", help=f"head node name or address (default {LOOPBACK}: this machine only)")
    ap.add_argument("--master-port", type=int, help=f"rendezvous port (default {DEFAULT_PORT} for several nodes)")
    ap.add_argument("--rdzv-id", default="guide", help="the same on every node of one job (e.g. $SLURM_JOB_ID)")
    ap.add_argument("--run", action="store_true", help="run the command here instead of printing it")
    args = ap.parse_args(ours)
    if "--config" not in train_args or "--out" not in train_args:
        ap.error("give the job after --, e.g. -- --config launch_configs/fsdp/full_shard.yaml --out runs/NAME")
    try:
        cmd = torchrun_command(train_args, args.nnodes, args.nproc_per_node, node_rank=args.node_rank,
                               master_addr=args.master_addr, master_port=args.master_port, rdzv_id=args.rdzv_id,
                               launcher=(sys.executable, "-m", "torch.distributed.run") if args.run else ("torchrun",))
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.run:
        print(shlex.join(cmd))
        return 0
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank, and no torchrun banner about it
    proc = subprocess.Popen(cmd, env=env)
    signal.signal(signal.SIGTERM, lambda sig, _: proc.send_signal(sig))  # e.g. Slurm's: torchrun stops the ranks
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # torchrun got the same Ctrl-C and stops its ranks: wait for it
            continue


if __name__ == "__main__":
    sys.exit(main())
