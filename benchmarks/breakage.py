"""Break the code on purpose, one breakage at a time, and see which test catches it.

    python benchmarks/breakage.py                 # every breakage (tens of minutes on 2 cores)
    python benchmarks/breakage.py --only rng      # the breakages whose name contains "rng"
    python benchmarks/breakage.py --list

Not a test, not in CI. It copies the repository's tracked and untracked files (never the
repository itself) into a temporary directory, applies one textual edit there, runs the
tests meant to catch it, puts the file back, and goes on. At the end it prints a table
``breakage -> caught by``. A breakage whose text is no longer in the code is reported as
``stale`` (the code moved on; update its edit here).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Breakage:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


BREAKAGES = [
    Breakage("GUIDE_PROGRESS=0 ignored", "helpers/job/observe/progress.py",
             'if not active or os.environ.get("GUIDE_PROGRESS", "1") == "0":', "if not active:",
             ("tests/test_promises.py::test_guide_progress_0_turns_the_bar_off",)),
    Breakage("gloo not kept on loopback", "helpers/job/run.py",
             '        os.environ.setdefault("GLOO_SOCKET_IFNAME", names[0])', "        pass",
             ("tests/test_promises.py::test_gloo_stays_on_loopback_for_a_local_rendezvous",)),
    Breakage("load_run ignores metrics/summary disagreement", "helpers/nb/results.py",
             'if len(metrics) != summary["steps"]:', "if False:",
             ("tests/test_promises.py::test_load_run_refuses_incomplete_and_inconsistent_runs",)),
    Breakage("translate: ZeRO-1 -> SHARD_GRAD_OP not warned", "helpers/core/deepspeed_to_fsdp.py",
             '        warn(f"zero_optimization.stage {d.zero_stage}',
             '        (lambda *a: None)(f"zero_optimization.stage {d.zero_stage}',
             ("tests/test_translate.py::test_round_trip_every_shipped_config",)),
    Breakage("--peak-tflops ignored", "helpers/job/observe/throughput.py",
             "    if override_tflops is not None:", "    if False:",
             ("tests/test_train.py::test_single_process_without_torchrun_and_a_given_peak",)),
    Breakage("peer-death detection a no-op", "helpers/job/guard.py",
             '    """True when a process on this host is gone or a zombie (exited, not yet reaped)."""\n',
             '    """True when a process on this host is gone or a zombie (exited, not yet reaped)."""\n'
             "    return False\n",
             ("tests/test_failures.py::test_killed_rank_ends_the_job_at_once",)),
    Breakage("timeout leaves no error_rank file", "helpers/job/guard.py",
             "        written = ours and write_report(",
             "        written = ours and kind != 'timeout' and write_report(",
             ("tests/test_failures.py::test_hung_rank_ends_the_job_within_the_timeout",)),
    Breakage("MFU from global tokens", "helpers/job/observe/throughput.py",
             "mfu = flops * tokens_per_s_per_rank / peak", "mfu = 2 * flops * tokens_per_s_per_rank / peak",
             ("tests/test_throughput.py::test_mfu_and_tokens_per_s_in_both_backends",)),
    Breakage("activations count the weights", "helpers/job/observe/memory.py",
             "        seen = {_local(p).untyped_storage().data_ptr() for p in self.model.parameters()}",
             "        seen = set()",
             ("tests/test_memory.py::test_state_per_rank_matches_theory[zero3]",)),
    Breakage("mapping: ZeRO-2 said not to shard gradients", "helpers/core/mapping.py",
             '("optimizer_states", "master_params", "grads"), "launch_configs/deepspeed/zero2.yaml"',
             '("optimizer_states", "master_params"), "launch_configs/deepspeed/zero2.yaml"',
             ("tests/test_memory.py::test_state_per_rank_matches_theory[zero2]",)),
    Breakage("rng restore skipped", "helpers/job/checkpoint.py",
             "        set_rng_state(", "        (lambda state: None)(",  # the file is read, not applied
             ("tests/test_resume_anywhere.py::test_resume_continues_the_rng_exactly",)),
    # (skipping set_optimizer_state_dict alone changes nothing: dcp.load already wrote into the live Adam state)
    Breakage("FSDP resume drops the optimizer state", "helpers/job/checkpoint.py",
             '        set_optimizer_state_dict(model, optim, sd["optim"])', "        optim.state.clear()",
             ("tests/test_resume_anywhere.py::test_fsdp_resumes_its_dcp_files_at_another_world_size",)),
    Breakage("FSDP --grad-clip ignored", "helpers/job/backends/fsdp.py",
             "            if self.grad_clip > 0:", "            if False:",
             ("tests/test_promises.py::test_fsdp_grad_clip_matches_deepspeed_clipping",)),
    Breakage("FSDP clipping without DeepSpeed's 1e-6", "helpers/job/backends/fsdp.py",
             "(norm + 1e-6) / self.grad_clip", "norm / self.grad_clip",
             ("tests/test_promises.py::test_fsdp_grad_clip_matches_deepspeed_clipping",)),
    Breakage("DeepSpeed world-size check removed", "helpers/job/checkpoint.py",
             'if meta["world_size"] != world_size:', "if False:",
             ("tests/test_resume_anywhere.py::test_deepspeed_refuses_its_own_files_at_another_world_size",)),
    Breakage("converter drops exp_avg_sq (ZeRO-3)", "helpers/convert.py",
             '{"exp_avg": whole(avgs), "exp_avg_sq": whole(sqs)}',
             '{"exp_avg": whole(avgs), "exp_avg_sq": torch.zeros_like(whole(sqs))}',
             ("tests/test_resume_anywhere.py::test_deepspeed_resumes_converted_files_at_another_world_size",)),
    Breakage("DeepSpeed import skips Adam's moments", "helpers/job/checkpoint.py",
             '        for key in ("exp_avg", "exp_avg_sq"):\n            safe_set_full_optimizer_state',
             '        for key in ():\n            safe_set_full_optimizer_state',
             ("tests/test_resume_anywhere.py::test_deepspeed_resumes_converted_files_at_another_world_size",)),
    Breakage("DeepSpeed resume skips the optimizer state", "helpers/job/checkpoint.py",
             "load_optimizer_states=True", "load_optimizer_states=False",
             ("tests/test_checkpoint.py::test_resume_is_exact",)),
    Breakage("FSDP offload ignored", "helpers/job/backends/fsdp.py",
             "    if o.offload_params:\n", "    if False:\n",
             ("tests/test_offload.py::test_fsdp_offload_moves_everything_together",)),
]


def copy_repo(dst: Path) -> None:
    """Tracked and untracked (not ignored) files, as git sees them; .venv is linked, not copied."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for f in filter(None, files):
        src = REPO / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)
    if (REPO / ".venv").exists():
        os.symlink((REPO / ".venv").resolve(), dst / ".venv")


def run_tests(root: Path, tests: tuple[str, ...], timeout: int) -> tuple[str, str]:
    """('caught' | 'NOT caught' | 'timeout', the failing test ids)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rfE", *tests]
    log = root / ".breakage_last.log"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONWARNINGS": "ignore::FutureWarning"}
    try:
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", ""
    log.write_text(p.stdout + p.stderr)
    failed = [ln.split(maxsplit=2)[:2] for ln in p.stdout.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
    if p.returncode == 0:
        return "NOT caught", ""
    # ERROR: a job of the test's fixture failed (the code's own check stopped it)
    return "caught", ", ".join(f"{t.split('::', 1)[-1]}{' (its job failed)' * (k == 'ERROR')}"
                               for k, t in failed) or f"pytest exit {p.returncode}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="run the breakages whose name contains this text")
    ap.add_argument("--skip", action="append", default=[], help="leave out the breakages whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the breakages and exit")
    ap.add_argument("--show", action="store_true", help="print the end of each pytest output")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per breakage (default 1800)")
    args = ap.parse_args(argv)
    todo = [b for b in BREAKAGES if (not args.only or args.only.lower() in b.name.lower())
            and not any(k.lower() in b.name.lower() for k in args.skip)]
    if args.list:
        for b in todo:
            print(f"{b.name:48s} {b.file}  ->  {' '.join(b.tests)}")
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="breakage-") as tmp:
        root = Path(tmp)
        copy_repo(root)
        for b in todo:
            path = root / b.file
            original = path.read_text()
            if original.count(b.old) != 1:
                rows.append((b.name, "stale", f"{b.old.strip()[:40]!r} found {original.count(b.old)} times"))
                continue
            path.write_text(original.replace(b.old, b.new))
            t0 = time.monotonic()
            try:
                verdict, by = run_tests(root, b.tests, args.timeout)
            finally:
                path.write_text(original)  # back before the next one
            rows.append((b.name, verdict, f"{by} ({time.monotonic() - t0:.0f} s)"))
            print(f"{b.name}: {verdict} {by}", flush=True)
            if args.show:
                print((root / ".breakage_last.log").read_text()[-3000:], flush=True)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'breakage':{width}s}  verdict     caught by")
    for name, verdict, by in rows:
        print(f"{name:{width}s}  {verdict:10s}  {by}")
    return 0 if all(r[1] == "caught" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
