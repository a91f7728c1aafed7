"""Start the unit tests' CPU jobs by forking their ranks from a process that has imported torch already.

A 2-rank `tiny` job under torchrun spends about 8 CPU-seconds here before its first step: the launcher
and each rank import torch, each rank imports transformers (and DeepSpeed, in a DeepSpeed job). The unit
tests run over a hundred jobs, so most of their time was that start-up. This module keeps one server process
per pytest worker (``python tests/zygote.py --serve``) with those modules imported (DeepSpeed too: the suite
took 282 s with it, 331 s without, one run each); for each job it forks the ranks,
gives each the environment torchrun gives a rank (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), runs the module as ``python -m`` would (its
``__main__`` block included), and answers what ``subprocess.run`` would. As under torchrun, the ranks
share one stdout and one stderr, a failed rank gets the others stopped (SIGTERM, then SIGKILL after
30 s), and a failed job exits 1; a one-process job (nproc 0) exits with its own code.

It does not stand for torchrun itself (its messages, elastic agent, restarts): tests of those launch
torchrun (``launcher="torchrun"`` in ``conftest.run_job``), every notebook does, and
``GUIDE_TEST_LAUNCHER=torchrun make test-unit`` runs every test job under torchrun. A GPU node always
uses torchrun (nccl; a CUDA context does not survive a fork).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint", "transformers",
           "transformers.models.llama.modeling_llama", "deepspeed"]  # not helpers: each rank imports its own (_rank)
TERM_GRACE_S = 30.0  # torchrun's own wait between SIGTERM and SIGKILL when a rank fails

_server: subprocess.Popen | None = None
_lock = threading.Lock()


# ---- the client: the pytest worker ------------------------------------------------------------------------


def _start(env: dict, cwd: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--serve"], cwd=cwd, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)


def run(module: str, argv: list[str], nproc: int, env: dict, cwd: str | Path, timeout: float,
        cmd: list[str], server_env: dict) -> subprocess.CompletedProcess:
    """``python -m module argv`` on ``nproc`` ranks (0: one process, no process group), as subprocess.run.
    ``env``: the job's environment; ``server_env``: the server's, when this call starts it (no job's own)."""
    global _server
    with _lock, tempfile.TemporaryDirectory(prefix="zygote_") as tmp:
        if _server is None or _server.poll() is not None:
            _server = _start(server_env, str(cwd))
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        request = dict(module=module, argv=list(argv), nproc=nproc, env=env, cwd=str(cwd), out=out, err=err,
                       timeout=timeout)
        _server.stdin.write(json.dumps(request) + "\n")
        _server.stdin.flush()
        line = _server.stdout.readline()
        if not line:
            _server = None
            raise RuntimeError("tests/zygote.py: the job server died (run with GUIDE_TEST_LAUNCHER=torchrun to "
                               "compare)")
        reply = json.loads(line)
        stdout, stderr = (Path(p).read_text(errors="replace") if os.path.exists(p) else "" for p in (out, err))
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
        return subprocess.CompletedProcess(cmd, reply["returncode"], stdout, stderr)


# ---- the server: forks the ranks --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(req: dict, env: dict) -> None:
    """In the forked child: the rank's cwd, environment and output files, then the module as ``-m``."""
    import runpy

    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(env)
    for name in [n for n in sys.modules if n == "helpers" or n.startswith("helpers.")]:
        del sys.modules[name]  # our own modules start fresh, as in a new process (their env defaults, state)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, req["out"]), (2, req["err"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), fd)
    sys.argv = [req["module"], *req["argv"]]
    code = 1
    try:
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)  # helpers.train ends in os._exit
        code = 0
    except SystemExit as e:  # what the interpreter does with it
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve_one(req: dict) -> dict:
    nproc, base = req["nproc"], req["env"]
    port = _free_port()
    pids = {}
    for r in range(max(nproc, 1)):
        env = dict(base) if nproc == 0 else {
            **base, "RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        pid = os.fork()
        if pid == 0:
            _rank(req, env)
        pids[pid] = None
    deadline, failed_at = time.monotonic() + req["timeout"], None
    while any(code is None for code in pids.values()):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            pids[pid] = os.waitstatus_to_exitcode(status)
            if pids[pid] != 0 and failed_at is None:  # as torchrun: the other ranks are stopped
                failed_at = time.monotonic()
                for p, code in pids.items():
                    if code is None:
                        os.kill(p, 15)
            continue
        now = time.monotonic()
        if now > deadline or (failed_at is not None and now > failed_at + TERM_GRACE_S):
            for p, code in pids.items():
                if code is None:
                    os.kill(p, 9)
            for p, code in pids.items():
                if code is None:
                    pids[p] = os.waitstatus_to_exitcode(os.waitpid(p, 0)[1])
            if now > deadline:
                return {"returncode": None, "timed_out": True}
            break
        time.sleep(0.02)
    codes = list(pids.values())
    if nproc == 0:
        code = codes[0]  # as subprocess.run: -N for a signal
    else:
        code = 1 if any(codes) else 0
    return {"returncode": code, "timed_out": False}


def serve() -> None:
    import importlib

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as a CPU job sets it (helpers.train); the zygote is CPU-only
    for name in PRELOAD:
        importlib.import_module(name)
    for line in sys.stdin:
        reply = _serve_one(json.loads(line))
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
