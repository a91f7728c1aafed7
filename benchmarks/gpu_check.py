"""Verify the guide's GPU rows on one GPU in under ten minutes; with 2+ GPUs also at 2 ranks.

    python benchmarks/gpu_check.py --out $OUT/gpu_check      # on the GPU machine
    python benchmarks/gpu_check.py --dry-run                 # on a CPU: every check listed, the CPU-possible run
    python benchmarks/gpu_check.py --dry-run --only "memory budget,aligned parity"   # a few, by name

Every job is a real ``torchrun --standalone --nproc_per_node N -m helpers.train`` launch (nccl on a GPU,
gloo on a CPU), with its own ``--timeout`` below the check's own limit, so a hung job is stopped by its
watchdog and becomes a FAIL row; a job that outlives even that, or a check that raises, is a FAIL row too.
The table is printed and ``OUT/gpu_check.json`` rewritten after every row (never lost), with the versions
of torch, DeepSpeed, transformers and Accelerate and the GPU. The checks (``CHECKS``):

  nccl + CPU tensor       a raw all-reduce of a CPU tensor fails on the group; ``helpers.job.comm.all_reduce`` works
  torchrun launch         each backend starts under torchrun, over nccl on a GPU
  aligned parity          FSDP full_shard and ZeRO-3, both ``--deterministic``: bit-identical losses where
                          ``helpers.nb.bitwise_parity_expected`` says so, close otherwise
  convert + resume        FSDP full state dict -> ``helpers.convert --to deepspeed`` -> ZeRO-3 resumes, same losses
  pretrained loading      ``--model DIR`` (FSDP RAM-efficient, ZeRO-3 init): weights equal the file
  RAM-efficient + offload RAM-efficient loading with FSDP CPU offload (pinned on a GPU): weights equal the file
  offload placement       FSDP offload (pinned host memory on a GPU): params/grads/optimizer on the host,
                          ``--trace-tensors`` on top (its all-reduce of host sums)
  host bytes              the offloaded run's device peak is below the run without offload
  backward collectives    CUDA autograd runs backward on its own thread (so traces count every thread)
  setup vs training       peak memory of the set-up and of training, both recorded
  fp32 peak               an fp32 job's MFU uses the fp32 peak (TF32 off); a measured fp32 matmul stays under it
  bf16 throughput         both backends on the largest preset that fits, tokens/s and MFU, next to a measured
                          bf16 matmul peak; AdamW fused on both (--optimizer-impl fused: one kernel for FSDP's
                          many tensors as for ZeRO's few flat partitions)
  estimator               helpers.estimate's peak against the measured one (max_memory_allocated on a GPU,
                          peak_tensor_bytes on a CPU) on a few rows
  memory budget           a budget too small to hold the model: the job stops, and says so, as a result
  2 ranks (offload)       with 2+ GPUs (or in a dry run): the aligned pair, and FSDP offload + --trace-tensors,
                          at 2 ranks

How to run it on the lent GPU machine (see ../shared/GPU_CHECK.md): its Python has a CUDA torch,
transformers, accelerate, matplotlib and pandas, but no DeepSpeed, and nothing can be downloaded there.
Here, once: ``pip wheel --no-deps deepspeed==0.19.8 -w .whl`` with ``/.whl/`` in ``.git/info/exclude``
(add ``hjson``, ``ninja``, ``py-cpuinfo``, ``msgpack``, ``pydantic`` wheels if the import asks for them),
then carry ``.whl`` with the run and, on the machine:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \\
        && export PYTHONPATH=/tmp/site:$PWD && python3 benchmarks/gpu_check.py --out $OUT/gpu_check

Use the machine's own torch (do not carry one). Written for, not yet run on, a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TINY = ["--model", "tiny", "--micro-batch", "4", "--seq-len", "64"]
FSDP, ZERO3 = "launch_configs/fsdp/full_shard.yaml", "launch_configs/deepspeed/zero3.yaml"
FSDP_FULL = "launch_configs/fsdp/full_shard_full_state_dict.yaml"
FSDP_OFFLOAD = "launch_configs/fsdp/full_shard_offload.yaml"
GRACE_S = 60  # a job's own watchdog (--timeout) fires first; this much later the check gives up on it


@dataclass
class Ctx:
    out: Path
    gpu: bool
    gpus: int
    job_timeout: float  # each job's --timeout, seconds
    rows: list[dict] = field(default_factory=list)
    runs: dict = field(default_factory=dict)  # name -> summary, for checks that reuse another's runs
    meta: dict = field(default_factory=dict)

    def row(self, name: str, ok: bool | None, detail: str) -> None:
        self.rows.append({"check": name, "result": {True: "PASS", False: "FAIL", None: "skip"}[ok],
                          "detail": detail})
        print(f"  {self.rows[-1]['result']:4s}  {name}: {detail}", flush=True)
        self.save()

    def save(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps({**self.meta, "rows": self.rows}, indent=2))

    def job(self, name: str, config: str, *extra: str, nproc: int = 1) -> dict:
        if name not in self.runs:
            self.runs[name] = job(self.out / name, config, *extra, nproc=nproc, timeout=self.job_timeout)
        return self.runs[name]


def job(out: Path, config: str, *extra: str, nproc: int = 1, timeout: float = 240) -> dict:
    """``torchrun --standalone --nproc_per_node nproc -m helpers.train ... --timeout timeout``; its summary.json,
    with ``returncode`` and ``stderr_tail``. A job still running ``GRACE_S`` after its own watchdog should have
    stopped it is killed and comes back as ``status: "timed out"``, never as an exception."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::FutureWarning", "GUIDE_PROGRESS": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "helpers.train", "--config", config, "--out", str(out), *extra, "--timeout", f"{timeout:g}"]
    t0 = time.perf_counter()
    # its own session: a job that outlives its watchdog is killed with every rank torchrun started (killing
    # torchrun alone would leave its ranks holding the GPU for the next check)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout + GRACE_S)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        code = None
        stderr += (f"\nkilled by gpu_check after {timeout + GRACE_S:g} s (the job's --timeout {timeout:g} s "
                   "did not end it)")
    print(f"    job {out.name}: exit {code} in {time.perf_counter() - t0:.0f} s", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / f"{out.name}.log").write_text(stdout + stderr)
    summary = out / "summary.json"
    s = json.loads(summary.read_text()) if summary.is_file() else {"status": "no summary"}
    if code is None:
        s["status"] = "timed out"
    s["returncode"], s["stderr_tail"] = code, stderr[-1500:]
    return s


def ok_job(s: dict) -> bool:
    return s.get("returncode") == 0 and s.get("status") == "completed"


def why(s: dict) -> str:
    return f"job failed ({s.get('status')}): {s.get('reason') or s.get('stderr_tail', '')[-300:]}"


def mib(b) -> str:
    return "n/a" if b is None else f"{b / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------------------------ the checks


def nccl_cpu_tensor(c: Ctx) -> None:
    import torch
    import torch.distributed as dist

    from helpers.job import comm

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    kw = dict(device_id=torch.device("cuda", 0)) if c.gpu else {}
    if c.gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if c.gpu else "gloo", store=dist.HashStore(), rank=0, world_size=1, **kw)
    try:
        # on the GPU nccl itself must refuse; on a CPU the check stands in for it
        with nullcontext() if c.gpu else comm.CollectiveCheck(simulate_accelerator=True):
            try:
                dist.all_reduce(torch.ones(2))  # what loading.checksum did
                raw = "accepted"
            except RuntimeError as e:
                raw = f"refused ({str(e).splitlines()[0][:100]})"
            t = comm.all_reduce(torch.tensor([1.0, 2.0]))
        good = raw.startswith("refused") and t.tolist() == [1.0, 2.0]
        c.row("nccl + CPU tensor", good, f"raw CPU all-reduce {raw}; comm.all_reduce -> {t.tolist()} on "
              f"{'nccl' if c.gpu else 'gloo (nccl simulated)'}, group serves {comm.device_types()}")
    finally:
        dist.destroy_process_group()


def aligned_pair(c: Ctx, nproc: int = 1, suffix: str = "") -> tuple[dict, dict]:
    """FSDP (profiled, checkpointed at step 2 in one consolidated file) and ZeRO-3, both --deterministic."""
    extra = [*TINY, "--steps", "4", "--deterministic"]
    fsdp = c.job(f"fsdp{suffix}", FSDP_FULL, *extra, *(["--profile", "--checkpoint-dir", str(c.out / "ckpt"),
                                                         "--checkpoint-every", "2"] if nproc == 1 else []),
                 nproc=nproc)
    return fsdp, c.job(f"zero3{suffix}", ZERO3, *extra, nproc=nproc)


def torchrun_launch(c: Ctx) -> None:
    fsdp, ds = aligned_pair(c)
    want = "nccl" if c.gpu else "gloo"
    got = {n: (s.get("dist_backend"), s.get("device")) for n, s in (("FSDP", fsdp), ("ZeRO-3", ds))}
    good = ok_job(fsdp) and ok_job(ds) and all(b == want for b, _ in got.values())
    c.row("torchrun launch", good, "; ".join(f"{n}: {b} on {d}" for n, (b, d) in got.items())
          + ("" if ok_job(fsdp) and ok_job(ds) else f"; {why(fsdp if not ok_job(fsdp) else ds)}"))


def parity_row(c: Ctx, name: str, fsdp: dict, ds: dict, nproc: int) -> None:
    from helpers import nb

    if not (ok_job(fsdp) and ok_job(ds)):
        return c.row(name, False, why(fsdp if not ok_job(fsdp) else ds))
    det = bool(fsdp.get("deterministic")) and bool(ds.get("deterministic"))
    expected = nb.bitwise_parity_expected(nproc, deterministic=det)  # CPU: always; GPU: deterministic, <= 2 ranks
    gap = max(abs(a - b) for a, b in zip(fsdp["losses"], ds["losses"], strict=True))
    same = fsdp["losses"] == ds["losses"]
    good = same if expected else gap <= 1e-3 * max(abs(x) for x in fsdp["losses"])
    c.row(name, good, f"{nproc} rank(s), deterministic={det}: {'bitwise expected' if expected else 'close expected'}"
          f", max |FSDP - ZeRO-3| loss {gap:.2e} over {len(fsdp['losses'])} steps")


def aligned_parity(c: Ctx) -> None:
    fsdp, ds = aligned_pair(c)
    parity_row(c, "aligned parity", fsdp, ds, 1)


def convert_resume(c: Ctx) -> None:
    fsdp, _ = aligned_pair(c)
    if not ok_job(fsdp):
        return c.row("convert + resume", False, why(fsdp))
    conv = subprocess.run([sys.executable, "-m", "helpers.convert", str(c.out / "ckpt" / "step_2"),
                           str(c.out / "ckpt_ds"), "--to", "deepspeed"], cwd=REPO, capture_output=True, text=True,
                          timeout=c.job_timeout)
    if conv.returncode != 0:
        return c.row("convert + resume", False, f"helpers.convert failed: {conv.stderr[-300:]}")
    res = c.job("zero3_resumed", ZERO3, *TINY, "--steps", "4", "--deterministic", "--resume", str(c.out / "ckpt_ds"))
    if not ok_job(res):
        return c.row("convert + resume", False, why(res))
    c.row("convert + resume", res["losses"] == fsdp["losses"][2:],
          f"ZeRO-3 resumed from FSDP's step 2: losses {res['losses']} vs {fsdp['losses'][2:]}")


def pretrained_loading(c: Ctx) -> None:
    from helpers.job.loading import save_preset

    save_preset("tiny", str(c.out / "pretrained"), seed=3)
    loads = {m: c.job(f"load_{m}", cfg, "--model", str(c.out / "pretrained"), "--steps", "1")
             for m, cfg in (("fsdp_ram_efficient", "launch_configs/fsdp/full_shard_ram_efficient.yaml"),
                            ("zero3_init", "launch_configs/deepspeed/zero3_init.yaml"))}
    c.row("pretrained loading", all(ok_job(s) and s["loading"]["weights_match"] for s in loads.values()),
          "; ".join(f"{m}: " + (f"weights match {s['loading']['weights_match']}" if ok_job(s) else why(s))
                    for m, s in loads.items()))


def ram_efficient_offload(c: Ctx) -> None:
    import yaml

    from helpers.job.loading import save_preset

    if not (c.out / "pretrained").is_dir():
        save_preset("tiny", str(c.out / "pretrained"), seed=3)
    cfg = yaml.safe_load((REPO / "launch_configs/fsdp/full_shard_ram_efficient.yaml").read_text())
    cfg["fsdp_config"]["fsdp_offload_params"] = True
    path = c.out / "full_shard_ram_efficient_offload.yaml"
    path.write_text(yaml.safe_dump(cfg))
    s = c.job("load_ram_efficient_offload", str(path), "--model", str(c.out / "pretrained"), "--steps", "1")
    c.row("RAM-efficient + offload", ok_job(s) and s["loading"]["weights_match"],
          f"weights match {s['loading']['weights_match']}, shards on the host ({'pinned' if c.gpu else 'unpinned'})"
          if ok_job(s) else why(s))


def places(s: dict, cat: str) -> set[str]:
    return {k for k, v in s["memory_location_bytes"][0][cat].items() if v}


def offload(c: Ctx) -> None:
    plain = c.job("fsdp_plain", FSDP, *TINY, "--steps", "4")
    off = c.job("fsdp_offload", FSDP_OFFLOAD, *TINY, "--steps", "4", "--trace-tensors")
    if not (ok_job(off) and ok_job(plain)):
        c.row("offload placement", False, why(next(s for s in (off, plain) if not ok_job(s))))
        return c.row("host bytes", False if c.gpu else None, "offload runs failed")
    cats = ("params", "grads", "optimizer_states")
    got = {k: (places(plain, k), places(off, k)) for k in cats}
    traced = (c.out / "fsdp_offload" / "tensor_trace.jsonl").is_file()
    # job.observe.offload labels offloaded state "host" on a CPU too (there it is the same memory: see "host bytes")
    good = all(a == {"device"} and b == {"host"} for a, b in got.values()) and traced
    c.row("offload placement", good, "; ".join(f"{k}: {sorted(a)} -> {sorted(b)}" for k, (a, b) in got.items())
          + f"; pin_memory={c.gpu}; --trace-tensors wrote its trace: {traced}")
    if c.gpu:
        p_off, p_plain = off["peak_memory_bytes"][0], plain["peak_memory_bytes"][0]
        c.row("host bytes", p_off < p_plain, f"training peak on the GPU {mib(p_off)} with offload, "
              f"{mib(p_plain)} without")
    else:
        c.row("host bytes", None, "CPU: host and device are one memory")


def backward_collectives(c: Ctx) -> None:
    from helpers.nb import traces

    fsdp, _ = aligned_pair(c)
    if not ok_job(fsdp):
        c.row("backward collectives", False, why(fsdp))
        return c.row("setup vs training", False, why(fsdp))
    tr = traces.raw_trace(c.out / "fsdp", 0)
    main = traces._main_tid(tr)
    bwd = [e for e in tr["traceEvents"] if e.get("ph") == "X"
           and e["name"].startswith("autograd::engine::evaluate_function")]
    off = sum(e.get("tid") != main for e in bwd)
    calls = traces.collective_calls(c.out / "fsdp")
    c.row("backward collectives", off > 0 if c.gpu else None,
          f"{off} of {len(bwd)} autograd backward ops off the training thread (where FSDP2's backward "
          f"collectives run at 2+ ranks; traces.collective_calls reads every thread: {len(calls)} calls)")
    setup, train = fsdp["setup_peak_memory_bytes"][0], fsdp["peak_memory_bytes"][0]
    state = sum(fsdp["memory_bytes"][0].values())
    c.row("setup vs training", setup is not None and train >= state,
          f"set-up peak {mib(setup)}, training peak {mib(train)} ({fsdp['peak_memory_source']}), state {mib(state)}")


def matmul_peak(dtype) -> float:
    """Best FLOP/s of a square matmul in ``dtype`` on this machine's GPU (CPU: job.observe.throughput's bench)."""
    import torch

    from helpers.job.observe.throughput import measure_cpu_peak

    if not torch.cuda.is_available():
        return measure_cpu_peak(dtype)
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    torch.mm(a, a)
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(10):
            torch.mm(a, a)
        torch.cuda.synchronize()
        best = max(best, 10 * 2 * n**3 / (time.perf_counter() - t))
    return best


def fp32_peak(c: Ctx) -> None:
    import torch

    fp32 = c.job("zero3_fp32", "launch_configs/deepspeed/zero3_fp32.yaml", *TINY, "--steps", "4")
    if not ok_job(fp32):
        return c.row("fp32 peak", False, why(fp32))
    if not c.gpu:
        return c.row("fp32 peak", None, f"CPU: measured, {fp32['peak_flops_source']}")
    measured, table = matmul_peak(torch.float32), fp32["peak_flops"]
    c.row("fp32 peak", "fp32" in fp32["peak_flops_source"] and bool(table) and measured <= 1.1 * table,
          f"{fp32['peak_flops_source']}: {table / 1e12 if table else None} TFLOPS; measured fp32 matmul "
          f"{measured / 1e12:.1f} TFLOPS; MFU {fp32['mfu']}")


THROUGHPUT_SHAPE = {"micro_batch": 8, "seq_len": 1024}


def largest_preset(c: Ctx) -> str:
    """The largest preset whose estimated peak (one rank, full_shard, THROUGHPUT_SHAPE) fits in 80% of the GPU's
    free memory; tiny on a CPU (the plumbing only)."""
    import torch

    from helpers.estimate import run

    if not c.gpu:
        return "tiny"
    free = torch.cuda.mem_get_info()[0]
    for preset in ("medium", "small", "tiny"):
        e = run(argparse.Namespace(config=str(REPO / FSDP), model=preset, world_size=1, budget_gib=None,
                                   device="cuda", **THROUGHPUT_SHAPE))
        if max(e["peak_bytes_per_rank"]) < 0.8 * free:
            return preset
    return "tiny"


def bf16_throughput(c: Ctx) -> None:
    import torch

    preset = largest_preset(c)
    shape = (["--micro-batch", str(THROUGHPUT_SHAPE["micro_batch"]), "--seq-len", str(THROUGHPUT_SHAPE["seq_len"])]
             if c.gpu else ["--micro-batch", "4", "--seq-len", "64"])
    steps = ["--steps", "12" if c.gpu else "4", "--optimizer-impl", "fused"]  # a fair step on both backends
    c.meta["throughput_preset"] = preset
    runs = {"FSDP": c.job("tput_fsdp", FSDP, "--model", preset, *shape, *steps),
            "ZeRO-3": c.job("tput_zero3", ZERO3, "--model", preset, *shape, *steps)}
    bad = [s for s in runs.values() if not ok_job(s)]
    if bad:
        return c.row("bf16 throughput", False, why(bad[0]))
    measured = matmul_peak(torch.bfloat16)
    table = runs["FSDP"]["peak_flops"]
    parts = [f"{n}: {s['tokens_per_s_per_rank']:.0f} tokens/s, MFU {s['mfu']}, AdamW {s['optimizer_impl']}"
             for n, s in runs.items()]
    detail = (f"{preset}, {' x '.join(shape[1::2])}; " + "; ".join(parts)
              + f"; peak {runs['FSDP']['peak_flops_source']} {table / 1e12 if table else None} TFLOPS, "
              f"measured bf16 matmul {measured / 1e12:.1f} TFLOPS")
    if not c.gpu:
        return c.row("bf16 throughput", None, "CPU (plumbing only): " + detail)
    good = bool(table) and measured <= 1.1 * table and all(s["mfu"] and 0 < s["mfu"] < 1 and s["optimizer_impl"]
                                                           == "fused" for s in runs.values())
    c.row("bf16 throughput", good, detail)


def estimator(c: Ctx) -> None:
    """helpers.estimate against the measured peak on the runs other checks made (and the throughput pair)."""
    from helpers.estimate import run

    key = "peak_memory_bytes" if c.gpu else "peak_tensor_bytes"
    preset = c.meta.get("throughput_preset", "tiny")
    tput = ["--micro-batch", str(THROUGHPUT_SHAPE["micro_batch"]), "--seq-len", str(THROUGHPUT_SHAPE["seq_len"])] \
        if c.gpu else TINY[2:]
    rows = [("fsdp_plain", FSDP, "tiny", TINY[2:]), ("zero3", ZERO3, "tiny", TINY[2:]),
            ("tput_fsdp", FSDP, preset, tput), ("tput_zero3", ZERO3, preset, tput)]
    out, worst = [], 0.0
    for name, cfg, model, shape in rows:
        s = c.runs.get(name)
        if not s or not ok_job(s) or not s.get(key):
            continue
        e = run(argparse.Namespace(config=str(REPO / cfg), model=model, world_size=1, budget_gib=None,
                                   micro_batch=int(shape[1]), seq_len=int(shape[3]),
                                   device="cuda" if c.gpu else "cpu"))
        pred, meas = max(e["peak_bytes_per_rank"]), max(s[key])
        err = (pred - meas) / meas
        worst = max(worst, abs(err), key=abs)
        out.append(f"{name} ({model}): predicted {mib(pred)}, measured {mib(meas)} ({err:+.0%})")
    if not out:
        return c.row("estimator", False, "no run to compare with (their checks failed or were not selected)")
    c.row("estimator", worst <= 0.3, f"against {key}: " + "; ".join(out) + " (pass: every row within 30%)")


def memory_budget(c: Ctx) -> None:
    s = c.job("budget_oom", FSDP, *TINY, "--steps", "2", "--memory-budget-gib", "0.001")
    reason = str(s.get("reason") or "")
    stopped = s.get("status") == "failed" and s.get("returncode") == 1 and "--memory-budget-gib" in reason
    c.row("memory budget", stopped and s.get("memory_budget_fits") is False,
          f"status {s.get('status')}, exit {s.get('returncode')}, memory_budget_fits {s.get('memory_budget_fits')}: "
          f"{reason[:200] or s.get('stderr_tail', '')[-200:]}")


def two_ranks(c: Ctx) -> None:
    if c.gpu and c.gpus < 2:
        c.row("2 ranks", None, f"{c.gpus} GPU: nccl needs one GPU per rank")
        return c.row("2 ranks offload", None, f"{c.gpus} GPU: nccl needs one GPU per rank")
    fsdp, ds = aligned_pair(c, nproc=2, suffix="_2ranks")
    parity_row(c, "2 ranks", fsdp, ds, 2)
    off = c.job("fsdp_offload_2ranks", FSDP_OFFLOAD, *TINY, "--steps", "2", "--trace-tensors", nproc=2)
    c.row("2 ranks offload", ok_job(off) and (c.out / "fsdp_offload_2ranks" / "tensor_trace.jsonl").is_file(),
          "FSDP offload + --trace-tensors at 2 ranks (the fingerprints' all-reduce of host sums): "
          + ("completed" if ok_job(off) else why(off)))


# (name, function, runs on a CPU in --dry-run); functions that add two rows are listed under both names
CHECKS = [
    ("nccl + CPU tensor", nccl_cpu_tensor, True),
    ("torchrun launch", torchrun_launch, True),
    ("aligned parity", aligned_parity, True),
    ("convert + resume", convert_resume, True),
    ("pretrained loading", pretrained_loading, True),
    ("RAM-efficient + offload", ram_efficient_offload, True),
    ("offload placement", offload, True),  # and "host bytes"
    ("backward collectives", backward_collectives, True),  # and "setup vs training"
    ("fp32 peak", fp32_peak, True),
    ("bf16 throughput", bf16_throughput, True),
    ("estimator", estimator, True),
    ("memory budget", memory_budget, True),
    ("2 ranks", two_ranks, True),
]
ALSO = {"offload placement": ["host bytes"], "backward collectives": ["setup vs training"],
        "2 ranks": ["2 ranks offload"]}


def versions(gpu: bool) -> dict:
    import torch

    out = {}
    for pkg in ("torch", "deepspeed", "transformers", "accelerate"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    out["cuda"] = torch.version.cuda
    if gpu:
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_count"] = torch.cuda.device_count()
        out["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        out["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/gpu_check", help="where the runs and gpu_check.json go")
    ap.add_argument("--dry-run", action="store_true", help="on a CPU: every check listed, the CPU-possible run")
    ap.add_argument("--only", help="comma-separated check names (default: all): " + ", ".join(n for n, *_ in CHECKS))
    ap.add_argument("--job-timeout", type=float, help="each job's --timeout, s (default: 240 on a GPU, 420 on a CPU)")
    args = ap.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    if not gpu and not args.dry_run:
        print("error: no GPU visible; use --dry-run on a CPU", file=sys.stderr)
        return 2
    names = [n for n, *_ in CHECKS]
    only = [x.strip() for x in args.only.split(",")] if args.only else names
    unknown = [x for x in only if x not in names]
    if unknown:
        print(f"error: --only = {args.only!r}: unknown check(s) {unknown}; allowed: {', '.join(names)}",
              file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    c = Ctx(out, gpu, torch.cuda.device_count() if gpu else 0, args.job_timeout or (240 if gpu else 420))
    t0 = time.perf_counter()
    c.meta = {"device": torch.cuda.get_device_name(0) if gpu else "cpu (dry run)", "versions": versions(gpu),
              "job_timeout_s": c.job_timeout, "checks": [n for name in names for n in (name, *ALSO.get(name, []))]}
    print(f"gpu_check: {c.meta['device']}, {c.meta['versions']}, out {out}", flush=True)
    for name, fn, cpu_ok in CHECKS:
        also = ALSO.get(name, [])
        if name not in only or not (gpu or cpu_ok):
            for n in (name, *also):
                c.row(n, None, "not selected (--only)" if name not in only else "GPU only")
            continue
        before = len(c.rows)
        try:
            fn(c)
        except Exception as e:  # noqa: BLE001 - every failure is a row; the table is never lost
            c.row(name, False, f"the check raised {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        done = {r["check"] for r in c.rows[before:]}
        for n in also:
            if n not in done:
                c.row(n, False, f"not reached: {name} failed")
    c.meta["seconds"] = time.perf_counter() - t0
    c.save()
    width = max(len(r["check"]) for r in c.rows)
    print(f"\n{'check':{width}s}  result  detail   ({c.meta['device']}, {c.meta['seconds']:.0f} s)")
    for r in c.rows:
        print(f"{r['check']:{width}s}  {r['result']:6s}  {r['detail']}")
    return 0 if all(r["result"] != "FAIL" for r in c.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
