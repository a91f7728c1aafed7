"""Read the ``--profile`` traces of a run (helpers.job.observe.profiling): who communicated, who computed, when.

``events(run)``  one row per interval: rank, lane (``comm`` / ``compute``), name, start and end in
                 ms from the start of the first profiled step (ranks share one host clock).
``phases(run)``  the ``guide::forward`` / ``guide::backward`` / ``guide::optimizer_step`` spans (as the
                 host ran them; Kineto's GPU-side copies, ``gpu_user_annotation``, are left out).
``collectives(run)``  count and bytes of all-gathers, reduce-scatters and all-reduces per step
                 and rank, read from the collective calls themselves (``c10d::*``, on every thread).
``peak_allocated(run)``  per rank, the most bytes the allocator held during the profiled steps (one
                 device: the compute device, or the one asked for).

What counts as what (on CPU, gloo):
  * communication: ``gloo:*`` events on gloo's own threads (``pt_gloo_runloop``), the time the
    bytes are on the wire. On a GPU: the NCCL kernels.
  * compute: the operators the training thread runs at top level, minus the ``c10d::*`` calls
    that hand work to gloo and wait for it. On a GPU: every other kernel.
On gloo, a reduce-scatter runs as an all-reduce on the wire (``gloo:all_reduce``); the call on the
training thread (``c10d::_reduce_scatter_base_``) says what it is, so counts come from the calls.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from functools import lru_cache
from pathlib import Path

import pandas as pd

from helpers.job.observe.profiling import trace_path

# the collective calls a rank makes (any thread), by kind; bytes = the larger (unsharded) tensor
KINDS = {
    "c10d::_allgather_base_": "all_gather",
    "c10d::allgather_into_tensor_coalesced_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d::reduce_scatter_": "reduce_scatter",
    "c10d::allreduce_": "all_reduce",
    "c10d::allreduce_coalesced_": "all_reduce",
    "c10d::broadcast_": "broadcast",
    "c10d::allgather_": "other",  # list form: the guide's own bookkeeping, not parameters
    "c10d::barrier": "other",
}
DTYPE_BYTES = {"c10::BFloat16": 2, "c10::Half": 2, "float": 4, "double": 8, "long int": 8, "int": 4,
               "signed char": 1, "unsigned char": 1, "bool": 1, "c10::Float8_e4m3fn": 1}
PHASES = ("guide::forward", "guide::backward", "guide::optimizer_step")


def _run_path(run) -> Path:
    return Path(getattr(run, "path", run))


@lru_cache(maxsize=32)
def _load(path: str, mtime: float) -> dict:
    return json.loads(Path(path).read_text())


def raw_trace(run, rank: int) -> dict:
    """The Chrome-trace dict rank ``rank`` wrote (cached while the file is unchanged)."""
    p = trace_path(_run_path(run), rank)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no trace; was the run started with --profile?")
    return _load(str(p), p.stat().st_mtime)


def ranks(run) -> list[int]:
    return sorted(int(m.group(1)) for p in _run_path(run).glob("trace_rank*.json")
                  if (m := re.fullmatch(r"trace_rank(\d+)\.json", p.name)))


def _gloo_threads(trace: dict) -> set:
    """Threads ever named pt_gloo_runloop (a thread can carry several names in one trace)."""
    return {e["tid"] for e in trace["traceEvents"] if e.get("ph") == "M" and e.get("name") == "thread_name"
            and "pt_gloo_runloop" in e["args"]["name"]}


def _steps(trace: dict) -> list[dict]:
    """The host's ProfilerStep#N events (a GPU trace repeats them as gpu_user_annotation: left out)."""
    return sorted((e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")
                   and e.get("cat") != "gpu_user_annotation"), key=lambda e: e["ts"])


def step_numbers(run, rank: int = 0) -> list[int]:
    """The step numbers the profiler recorded on ``rank`` (its ``ProfilerStep#N`` events), in order."""
    return [int(e["name"].split("#")[1]) for e in _steps(raw_trace(run, rank))]


def fsdp_gathers_per_step(run, rank: int = 0) -> dict[str, float]:
    """{FSDP unit: all-gathers per profiled step} on ``rank``, from FSDP2's trace labels ``FSDP::all_gather (unit)``."""
    trace = raw_trace(run, rank)
    tag = "FSDP::all_gather ("
    counts = Counter(e["name"] for e in trace["traceEvents"]
                     if e.get("ph") == "X" and e.get("cat") != "gpu_user_annotation" and e["name"].startswith(tag))
    n = len(_steps(trace))
    return {x[len(tag):-1]: counts[x] / n for x in sorted(counts)}


def _origin(run) -> float:
    """Start of the first profiled step, earliest over ranks (us)."""
    return min(_steps(raw_trace(run, r))[0]["ts"] for r in ranks(run))


def _main_tid(trace: dict):
    return _steps(trace)[0]["tid"]


def _step_of(ts: float, steps: list[dict]) -> int | None:
    for s in steps:
        if s["ts"] <= ts <= s["ts"] + s["dur"]:
            return int(s["name"].split("#")[1])
    return None


def _top_level(evs: list[dict]) -> list[dict]:
    """Events not inside another event of the list (same thread)."""
    out, end = [], -1.0
    for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def events(run) -> pd.DataFrame:
    """Communication and compute intervals of every rank, in ms from the first profiled step."""
    t0, rows = _origin(run), []
    for r in ranks(run):
        tr = raw_trace(run, r)
        evs = [e for e in tr["traceEvents"] if e.get("ph") == "X"]
        steps, gloo = _steps(tr), _gloo_threads(tr)
        kernels = [e for e in evs if e.get("cat") == "kernel"]
        if kernels:  # GPU: what the device did
            chosen = [("comm" if "nccl" in e["name"].lower() else "compute", e) for e in kernels]
        else:
            comm = [e for e in evs if e["name"].startswith("gloo:") and e["tid"] in gloo]
            main = _main_tid(tr)
            ops = _top_level([e for e in evs if e.get("cat") == "cpu_op" and e["tid"] == main])
            chosen = [("comm", e) for e in comm] + [("compute", e) for e in ops if not e["name"].startswith("c10d::")]
        for lane, e in chosen:
            step = _step_of(e["ts"], steps)
            if step is None:
                continue
            rows.append({"rank": r, "lane": lane, "name": e["name"], "step": step,
                         "start_ms": (e["ts"] - t0) / 1e3, "end_ms": (e["ts"] + e["dur"] - t0) / 1e3})
    return pd.DataFrame(rows, columns=["rank", "lane", "name", "step", "start_ms", "end_ms"])


def phases(run) -> pd.DataFrame:
    """forward / backward / optimizer_step spans per rank and step (ms from the first profiled step)."""
    t0, rows = _origin(run), []
    for r in ranks(run):
        tr = raw_trace(run, r)
        steps = _steps(tr)
        for e in tr["traceEvents"]:  # the host's spans only: Kineto copies annotations to the GPU's lanes
            if e.get("ph") == "X" and e["name"] in PHASES and e.get("cat") != "gpu_user_annotation":
                step = _step_of(e["ts"], steps)
                if step is not None:
                    rows.append({"rank": r, "phase": e["name"].split("::")[1], "step": step,
                                 "start_ms": (e["ts"] - t0) / 1e3, "end_ms": (e["ts"] + e["dur"] - t0) / 1e3})
    return pd.DataFrame(rows, columns=["rank", "phase", "step", "start_ms", "end_ms"])


def _nbytes(e: dict) -> int:
    args = e.get("args", {})
    sizes = []
    for dims, dtype in zip(args.get("Input Dims", []), args.get("Input type", []), strict=False):
        if isinstance(dims, list) and all(isinstance(d, int) for d in dims) and dtype in DTYPE_BYTES:
            n = 1
            for d in dims:
                n *= d
            sizes.append(n * DTYPE_BYTES[dtype])
    return max(sizes[:2], default=0)


def collective_calls(run) -> pd.DataFrame:
    """Every collective call, on any thread: rank, step, kind, op, bytes (unsharded size).

    Any thread, not only the training thread: on CUDA, autograd runs the backward of GPU ops on its own
    device thread, so FSDP2's backward all-gathers and reduce-scatters (issued from autograd hooks) are
    recorded there. (gloo's own threads record ``gloo:*`` events, never ``c10d::*`` calls: no double count.)"""
    rows = []
    for r in ranks(run):
        tr = raw_trace(run, r)
        steps = _steps(tr)
        for e in tr["traceEvents"]:
            if e.get("ph") == "X" and e["name"] in KINDS:
                step = _step_of(e["ts"], steps)
                if step is not None:
                    rows.append({"rank": r, "step": step, "kind": KINDS[e["name"]], "op": e["name"],
                                 "bytes": _nbytes(e)})
    return pd.DataFrame(rows, columns=["rank", "step", "kind", "op", "bytes"])


def collectives(run, rank: int = 0) -> pd.DataFrame:
    """Per profiled step: count and MB of all-gathers, reduce-scatters and all-reduces on ``rank``."""
    calls = collective_calls(run)
    calls = calls[calls["rank"] == rank]
    steps = sorted(calls["step"].unique())
    out = {}
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        sub = calls[calls.kind == kind]
        out[f"{kind}s"] = [int((sub.step == s).sum()) for s in steps]
        out[f"{kind}_MB"] = [float(sub[sub.step == s].bytes.sum()) / 1e6 for s in steps]
        if kind == "all_gather":  # what one gather puts in memory at once
            out["largest_all_gather_MB"] = [float(sub[sub.step == s].bytes.max()) / 1e6 for s in steps]
    return pd.DataFrame(out, index=pd.Index(steps, name="step"))


DEVICE_TYPES = {"cpu": 0, "cuda": 1}  # a [memory] event's args["Device Type"]: c10::DeviceType's number


def peak_allocated(run, device: str | None = None) -> list[int]:
    """Per rank: the most bytes ``device``'s allocator held during the profiled steps (``[memory]`` events).

    The profiler records host and GPU allocations alike, each ``Total Allocated`` is its own allocator's
    running total, so one device is counted at a time: ``"cpu"`` or ``"cuda"``; ``None`` (default) is the
    job's compute device, cuda when the trace holds GPU memory events, else cpu (under offload the host's
    bytes are then left out, ask for ``"cpu"`` to see them)."""
    if device is not None and device not in DEVICE_TYPES:
        raise ValueError(f"device = {device!r}: allowed values are {', '.join(DEVICE_TYPES)} or None "
                         "(the job's compute device)")
    out = []
    for r in ranks(run):
        mem = [e["args"] for e in raw_trace(run, r)["traceEvents"] if e.get("name") == "[memory]"]
        cuda = any(a.get("Device Type", 0) == DEVICE_TYPES["cuda"] for a in mem)
        want = DEVICE_TYPES[device or ("cuda" if cuda else "cpu")]
        out.append(int(max((a.get("Total Allocated", 0) for a in mem if a.get("Device Type", 0) == want),
                           default=0)))
    return out


def busy_ms(run, rank: int = 0) -> dict:
    """Per lane: ms of the profiled steps covered by at least one interval (overlaps merged)."""
    ev = events(run)
    out = {}
    for lane in ("comm", "compute"):
        sub = ev[(ev["rank"] == rank) & (ev.lane == lane)].sort_values("start_ms")
        total, end = 0.0, float("-inf")
        for s, e in zip(sub.start_ms, sub.end_ms, strict=True):
            if e > end:
                total += e - max(s, end)
                end = e
        out[lane] = total
    return out


def collective_table(runs, labels=None, rank: int = 0) -> pd.DataFrame:
    """One row per run: collectives per step (first profiled step) and MB moved, plus peak allocated."""
    rows = {}
    for i, run in enumerate(runs):
        c = collectives(run, rank).iloc[0]
        label = labels[i] if labels else getattr(run, "name", str(run))
        rows[label] = {"backend": run.summary["backend"] if hasattr(run, "summary") else None,
                       **{k: int(c[k]) if k.endswith("s") else float(c[k]) for k in c.index},
                       "peak_allocated_MB": peak_allocated(run)[rank] / 1e6}
    return pd.DataFrame.from_dict(rows, orient="index")


def annotation_start(run, name: str, step: int | None = None, rank: int = 0) -> float:
    """ms (from the first profiled step) at which the first event called ``name`` starts in ``step``."""
    tr, t0 = raw_trace(run, rank), _origin(run)
    steps = _steps(tr)
    step = int(steps[0]["name"].split("#")[1]) if step is None else step
    hits = [e["ts"] for e in tr["traceEvents"] if e.get("ph") == "X" and e["name"] == name
            and e.get("cat") != "gpu_user_annotation" and _step_of(e["ts"], steps) == step]
    if not hits:
        raise KeyError(f"{name!r}: no such event in step {step} of rank {rank}")
    return (min(hits) - t0) / 1e3


def overlap_ms(run, rank: int = 0) -> float:
    """ms during which ``rank`` both computed and communicated (the overlap prefetch is for)."""
    return float(overlap_by_op(run, rank).sum())


def _op_overlaps(run, rank: int):
    """Per compute-lane operator of ``rank``: (name, start ms, end ms, ms it overlapped the comm lane)."""
    ev = events(run)
    ev = ev[ev["rank"] == rank]
    comm = sorted(zip(ev[ev.lane == "comm"].start_ms, ev[ev.lane == "comm"].end_ms, strict=True))
    for name, s, e in zip(*(ev[ev.lane == "compute"][k] for k in ("name", "start_ms", "end_ms")), strict=True):
        both = 0.0
        for cs, ce in comm:
            if cs >= e:
                break
            both += max(0.0, min(e, ce) - max(s, cs))
        yield name, s, e, both


def overlap_by_op(run, rank: int = 0) -> pd.Series:
    """``overlap_ms`` split by the compute lane's operator that overlapped (ms, largest first). An autograd
    node that calls a collective and waits in it (a backward hook) counts here: on gloo that is waiting."""
    out: dict[str, float] = {}
    for name, _, _, both in _op_overlaps(run, rank):
        out[name] = out.get(name, 0.0) + both
    return pd.Series(out, dtype=float).sort_values(ascending=False)


def overlap_in_calls_ms(run, rank: int = 0) -> float:
    """The part of ``overlap_ms`` that fell inside a compute-lane operator during which the training thread itself
    called a collective (a ``c10d::*`` call nested in it: an autograd hook's gather or reduce-scatter). On gloo that
    is the thread inside a hook that hands work to gloo and waits for it, not compute running beside a transfer.
    CPU traces only: on a GPU the compute lane is kernels, which call nothing."""
    tr = raw_trace(run, rank)
    if any(e.get("cat") == "kernel" for e in tr["traceEvents"]):
        raise ValueError(f"{_run_path(run)}: a GPU trace; overlap_in_calls_ms reads CPU (gloo) traces only")
    t0, main = _origin(run), _main_tid(tr)
    calls = sorted((e["ts"] - t0) / 1e3 for e in tr["traceEvents"]
                   if e.get("ph") == "X" and e["tid"] == main and e["name"].startswith("c10d::"))
    return sum(both for _, s, e, both in _op_overlaps(run, rank) if any(s <= c <= e for c in calls))
