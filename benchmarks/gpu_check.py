"""The GPU paths in one run, on one GPU (world size 1: nccl refuses two ranks on one GPU), in under 10 minutes.

    python benchmarks/gpu_check.py --out $OUT/gpu_check     # on the GPU machine
    python benchmarks/gpu_check.py --dry-run                # the same plumbing on a CPU (gloo)

Checks what a read of the code against torch 2.13 / DeepSpeed 0.19.8 says would differ under nccl
(issue 23), each with real ``helpers.train`` jobs on the ``tiny`` preset, and prints one table
(also ``OUT/gpu_check.json``):

  nccl + CPU tensor      a raw all-reduce of a CPU tensor fails on the group; ``helpers.comm.all_reduce`` works
  pretrained loading     ``--model DIR`` (FSDP RAM-efficient, ZeRO-3 init): weights equal the file
  convert + resume       FSDP full state dict -> ``helpers.convert --to deepspeed`` -> ZeRO-3 resumes, same losses
  offload placement      FSDP offload: params/grads/optimizer on the host; no offload: all on the device
  host bytes             the offloaded run's training peak on the GPU is below the run without offload
  backward collectives   CUDA autograd runs backward on its own thread (so traces count every thread)
  setup vs training      peak memory of the set-up and of training, both recorded
  fp32 peak              an fp32 job's MFU uses the fp32 peak (TF32 off), and a measured fp32 matmul stays under it
  aligned parity         FSDP full_shard and ZeRO-3 give bit-identical losses

``--dry-run`` runs the same jobs on the CPU (gloo, nccl simulated by ``helpers.comm.CollectiveCheck``);
the rows that only a GPU can answer say ``skip``. It took 7.5 minutes on the shared 2-core box it was
written on (8 one-rank jobs; each DeepSpeed job spends about a minute starting up on a busy CPU).

How to run it on the lent GPU machine (see ../shared/GPU_CHECK.md): its Python has a CUDA torch,
transformers, accelerate, matplotlib and pandas, but no DeepSpeed, and nothing can be downloaded there.
Here, once: ``pip wheel --no-deps deepspeed==0.19.8 -w .whl`` with ``/.whl/`` in ``.git/info/exclude``
(add ``hjson``, ``ninja``, ``py-cpuinfo``, ``msgpack``, ``pydantic`` wheels if the import asks for them),
then carry ``.whl`` with the run and, on the machine:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \\
        && export PYTHONPATH=/tmp/site:$PWD && python3 benchmarks/gpu_check.py --out $OUT/gpu_check

Use the machine's own torch (do not carry one); DeepSpeed JIT-builds its ops there with its nvcc. Written for,
not yet run on, a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TINY = ["--model", "tiny", "--micro-batch", "4", "--seq-len", "64"]
FSDP, ZERO3 = "launch_configs/fsdp/full_shard.yaml", "launch_configs/deepspeed/zero3.yaml"
rows: list[dict] = []


def check(name: str, ok: bool | None, detail: str) -> None:
    rows.append({"check": name, "result": {True: "PASS", False: "FAIL", None: "skip"}[ok], "detail": detail})
    print(f"  {rows[-1]['result']:4s}  {name}: {detail}", flush=True)


def job(out: Path, config: str, *extra: str) -> dict:
    """One rank, no launcher (``python -m helpers.train``): gloo on a CPU, nccl on a GPU. Returns summary.json."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::FutureWarning", "GUIDE_PROGRESS": "0"}
    cmd = [sys.executable, "-m", "helpers.train", "--config", config, "--out", str(out), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    print(f"    job {out.name}: exit {proc.returncode} in {time.perf_counter() - t0:.0f} s", flush=True)
    (out.parent / f"{out.name}.log").write_text(proc.stdout + proc.stderr)
    summary = out / "summary.json"
    s = json.loads(summary.read_text()) if summary.is_file() else {"status": "no summary"}
    s["returncode"], s["stderr_tail"] = proc.returncode, proc.stderr[-1500:]
    return s


def ok_job(s: dict) -> bool:
    return s.get("returncode") == 0 and s.get("status") == "completed"


def why(s: dict) -> str:
    return f"job failed ({s.get('status')}): {s.get('reason') or s['stderr_tail'][-300:]}"


def nccl_cpu_tensor(gpu: bool) -> None:
    import torch
    import torch.distributed as dist

    from helpers import comm

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    kw = dict(device_id=torch.device("cuda", 0)) if gpu else {}
    if gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if gpu else "gloo", store=dist.HashStore(), rank=0, world_size=1, **kw)
    try:
        # on the GPU nccl itself must refuse; on a CPU the check stands in for it
        with nullcontext() if gpu else comm.CollectiveCheck(simulate_accelerator=True):
            try:
                dist.all_reduce(torch.ones(2))  # what loading.checksum did
                raw = "accepted"
            except RuntimeError as e:
                raw = f"refused ({str(e).splitlines()[0][:100]})"
            t = comm.all_reduce(torch.tensor([1.0, 2.0]))
        good = raw.startswith("refused") and t.tolist() == [1.0, 2.0]
        check("nccl + CPU tensor", good, f"raw CPU all-reduce {raw}; comm.all_reduce -> {t.tolist()} on "
              f"{'nccl' if gpu else 'gloo (nccl simulated)'}, group serves {comm.device_types()}")
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/gpu_check", help="where the runs and gpu_check.json go")
    ap.add_argument("--dry-run", action="store_true", help="on a CPU: the plumbing, GPU-only rows skipped")
    args = ap.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    if not gpu and not args.dry_run:
        print("error: no GPU visible; use --dry-run on a CPU", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    steps = ["--steps", "4"]
    t0 = time.perf_counter()
    print(f"gpu_check: {'GPU ' + torch.cuda.get_device_name(0) if gpu else 'dry run on the CPU'}, "
          f"torch {torch.__version__}, out {out}", flush=True)

    nccl_cpu_tensor(gpu)

    from helpers.loading import save_preset

    save_preset("tiny", str(out / "pretrained"), seed=3)
    loads = {m: job(out / f"load_{m}", cfg, "--model", str(out / "pretrained"), "--steps", "1")
             for m, cfg in (("fsdp_ram_efficient", "launch_configs/fsdp/full_shard_ram_efficient.yaml"),
                            ("zero3_init", "launch_configs/deepspeed/zero3_init.yaml"))}
    check("pretrained loading", all(ok_job(s) and s["loading"]["weights_match"] for s in loads.values()),
          "; ".join(f"{m}: " + (f"weights match {s['loading']['weights_match']}" if ok_job(s) else why(s))
                    for m, s in loads.items()))

    # the aligned pair; FSDP also profiled and checkpointed (one consolidated file at step 2)
    ckpt = out / "ckpt"
    fsdp = job(out / "fsdp", "launch_configs/fsdp/full_shard_full_state_dict.yaml", *TINY, *steps, "--profile",
               "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2")
    ds = job(out / "zero3", ZERO3, *TINY, *steps)
    if ok_job(fsdp) and ok_job(ds):
        gap = max(abs(a - b) for a, b in zip(fsdp["losses"], ds["losses"], strict=True))
        check("aligned parity", fsdp["losses"] == ds["losses"], f"max |FSDP - ZeRO-3| loss {gap:.2e} over 4 steps")
    else:
        check("aligned parity", False, why(fsdp if not ok_job(fsdp) else ds))

    conv = subprocess.run([sys.executable, "-m", "helpers.convert", str(ckpt / "step_2"), str(out / "ckpt_ds"),
                           "--to", "deepspeed"], cwd=REPO, capture_output=True, text=True, timeout=300)
    res = job(out / "zero3_resumed", ZERO3, *TINY, *steps, "--resume", str(out / "ckpt_ds")) \
        if conv.returncode == 0 else {"status": "not run", "reason": conv.stderr[-300:], "stderr_tail": ""}
    if ok_job(res) and ok_job(fsdp):
        same = res["losses"] == fsdp["losses"][2:]
        check("convert + resume", same, f"ZeRO-3 resumed from FSDP's step 2: losses {res['losses']} vs "
              f"{fsdp['losses'][2:]}")
    else:
        check("convert + resume", False, why(res))

    plain_fsdp = fsdp
    off = job(out / "fsdp_offload", "launch_configs/fsdp/full_shard_offload.yaml", *TINY, *steps)
    ds_off = job(out / "zero3_offload_optimizer", "launch_configs/deepspeed/zero3_offload_optimizer.yaml",
                 *TINY, *steps)
    if ok_job(off) and ok_job(ds_off) and ok_job(plain_fsdp):
        def places(s, cat):
            return {k for k, v in s["memory_location_bytes"][0][cat].items() if v}
        cats = ("params", "grads", "optimizer_states")
        got = {c: (places(plain_fsdp, c), places(off, c)) for c in cats}
        good = all(a == {"device"} and b == {"host"} for a, b in got.values())
        good &= places(ds_off, "optimizer_states") == {"host"} == places(ds_off, "master_params")
        check("offload placement", good, "; ".join(f"{c}: {sorted(a)} -> {sorted(b)}" for c, (a, b) in got.items())
              + f"; ZeRO-3 optimizer offload: states {sorted(places(ds_off, 'optimizer_states'))}")
        if gpu:
            p_off, p_plain = off["peak_memory_bytes"][0], plain_fsdp["peak_memory_bytes"][0]
            check("host bytes", p_off < p_plain, f"training peak on the GPU {p_off / 2**20:.1f} MiB with offload, "
                  f"{p_plain / 2**20:.1f} MiB without")
        else:
            check("host bytes", None, "CPU: host and device are one memory")
    else:
        check("offload placement", False, why(next(s for s in (off, ds_off, plain_fsdp) if not ok_job(s))))
        check("host bytes", False, "offload runs failed")

    if ok_job(fsdp):  # at world size 1 FSDP2 and ZeRO-3 skip their gathers: what is checkable is the thread
        from helpers import traces

        tr = traces.raw_trace(out / "fsdp", 0)
        main = traces._main_tid(tr)
        x = [e for e in tr["traceEvents"] if e.get("ph") == "X"]
        bwd = [e for e in x if e["name"].startswith("autograd::engine::evaluate_function")]
        off = sum(e.get("tid") != main for e in bwd)
        calls = traces.collective_calls(out / "fsdp")
        detail = (f"{off} of {len(bwd)} autograd backward ops off the training thread (where FSDP2's backward "
                  f"collectives run at 2+ ranks; traces.collective_calls reads every thread: {len(calls)} calls)")
        check("backward collectives", off > 0 if gpu else None, detail)
        setup, train = fsdp["setup_peak_memory_bytes"][0], fsdp["peak_memory_bytes"][0]
        state = sum(fsdp["memory_bytes"][0].values())
        check("setup vs training", setup is not None and train >= state,
              f"set-up peak {setup / 2**20:.1f} MiB, training peak {train / 2**20:.1f} MiB "
              f"({fsdp['peak_memory_source']}), state {state / 2**20:.1f} MiB")
    else:
        check("backward collectives", False, why(fsdp))
        check("setup vs training", False, why(fsdp))

    fp32 = job(out / "zero3_fp32", "launch_configs/deepspeed/zero3_fp32.yaml", *TINY, *steps)
    if not ok_job(fp32):
        check("fp32 peak", False, why(fp32))
    elif gpu:
        n, a = 4096, torch.randn(4096, 4096, device="cuda")
        torch.mm(a, a)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            torch.mm(a, a)
        torch.cuda.synchronize()
        measured = 10 * 2 * n**3 / (time.perf_counter() - t)
        table = fp32["peak_flops"]
        check("fp32 peak", "fp32" in fp32["peak_flops_source"] and table and measured <= 1.1 * table,
              f"{fp32['peak_flops_source']}: {table / 1e12 if table else None} TFLOPS; measured fp32 matmul "
              f"{measured / 1e12:.1f} TFLOPS; MFU {fp32['mfu']}")
    else:
        check("fp32 peak", None, f"CPU: measured, {fp32['peak_flops_source']}")

    results = {"device": torch.cuda.get_device_name(0) if gpu else "cpu (dry run)", "torch": torch.__version__,
               "seconds": time.perf_counter() - t0, "rows": rows}
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    width = max(len(r["check"]) for r in rows)
    print(f"\n{'check':{width}s}  result  detail   ({results['device']}, {results['seconds']:.0f} s)")
    for r in rows:
        print(f"{r['check']:{width}s}  {r['result']:6s}  {r['detail']}")
    return 0 if all(r["result"] != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
