"""What ``python -m helpers.switch`` prints and writes once both jobs ran: the settings side by side (read from
the two runs' ``summary.json``), the verdict (``helpers.compare``) and the known cause (``helpers.core.causes``).
``OUT/switch.json`` holds the same, for notebooks."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from helpers.compare import compare
from helpers.core.causes import Evidence, explain
from helpers.core.metrics import ACTIVATION_FILE

_BYTES = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2}
_DTYPES = ("loaded", "stored_param", "forward_weight", "grad_before_reduce", "reduce_dtype", "stored_grad",
           "master_param", "optimizer_states")
_STATES = {"params": "stored_param", "grads": "stored_grad", "optimizer_states": "optimizer_states",
           "master_params": "master_param"}


def settings(s: dict) -> dict[str, str]:
    """One run's settings as {row: value}, read from its summary.json."""
    rows = {"backend, mode": f"{s['backend']} {s['mode']}", "ranks": str(s["world_size"]),
            "mixed_precision": s["mixed_precision"], "tokens per step": str(s["tokens_per_step"])}
    dt = s.get("dtypes") or {}
    for key in _DTYPES:  # "?": the job's dtype probe does not read this stage for this backend (ZeRO-0/1/2)
        rows[f"dtype: {key}"] = str(dt.get(key) or ("-" if key == "master_param" and s["backend"] == "fsdp" else "?"))
    held = (s.get("memory_bytes") or [{}])[0]
    for cat, dkey in _STATES.items():
        n = held.get(cat)
        whole = s["num_params"] * _BYTES.get(dt.get(dkey) or "", 0) * (2 if cat == "optimizer_states" else 1)
        frac = f" ({n / whole:.2f} of a whole copy)" if n and whole and not s.get("peft") else ""
        rows[f"held by rank 0: {cat}"] = "-" if n is None else f"{n:,} B{frac}"
    for key, v in (s.get("effective") or {}).items():
        rows[key] = "-" if v is None else str(v)
    rows["activation checkpointing"] = s.get("activation_checkpointing") or "off"
    return rows


def side_by_side(sa: dict, sb: dict) -> list[tuple[str, str, str, bool | None]]:
    """(row, A, B, differs): True, False, or None when one side was not measured ("?"); differing rows first."""
    a, b = settings(sa), settings(sb)
    keys = list(dict.fromkeys([*a, *b]))
    rows = [(k, a.get(k, "-"), b.get(k, "-"), None if "?" in (a.get(k), b.get(k)) else a.get(k, "-") != b.get(k, "-"))
            for k in keys]
    return [r for r in rows if r[3]] + [r for r in rows if r[3] is None] + [r for r in rows if r[3] is False]


def table(rows, a_name: str, b_name: str) -> str:
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(a_name), *(len(r[1]) for r in rows))
    lines = [f"  {'setting':<{w0}}  {a_name:<{w1}}  {b_name}"]
    lines += [f"{'*' if d else '?' if d is None else ' '} {k:<{w0}}  {va:<{w1}}  {vb}" for k, va, vb, d in rows]
    return "\n".join(lines)


def _forward_before(run: Path, diff) -> list[tuple[str, str]]:
    """Side A's forward module outputs (name, dtype) met before the first differing module."""
    for line in (run / ACTIVATION_FILE).read_text().splitlines()[1:]:
        rec = json.loads(line)
        if rec["step"] == diff.step:
            out = []
            for name, _, dt in rec["ranks"][diff.rank][diff.micro]["forward"]:
                if diff.phase == "forward" and name == diff.module:
                    break
                out.append((name, dt))
            return out
    return []


def verdict(run_a: Path, run_b: Path, untraced: str | None = None) -> dict:
    """compare's verdict on two runs, and the known causes that apply. ``untraced``: why the runs have no tensor
    trace (said instead of compare's advice to take one)."""
    c = compare(run_a, run_b)
    sa, sb = (json.loads((r / "summary.json").read_text()) for r in (run_a, run_b))
    text = c.report()
    if untraced:
        text = "\n".join(f"tensor traces: not taken ({untraced})" if ln.startswith("no tensor trace in") else ln
                         for ln in text.splitlines())
    out = {"identical": c.identical and c.tensor is None and c.module is None, "steps": c.steps, "report": text,
           "first_step": c.first_step, "tensor": asdict(c.tensor) if c.tensor else None,
           "module": asdict(c.module) if c.module else None, "causes": [], "settings": side_by_side(sa, sb)}
    if not out["identical"]:
        before = _forward_before(run_a, c.module) if c.module else []
        ev = Evidence((sa, sb), c.tensor.stage if c.tensor else None, c.module.phase if c.module else None,
                      c.module.cls if c.module else None, bool(c.module and c.module.biased),
                      c.module.step if c.module else None, c.losses_equal, before)
        out["causes"] = [{"key": cause.key, "text": text, "test": cause.test} for cause, text in explain(ev)]
    return out


def report(out: Path, a: str, b: str, labels: list[str], warnings: list[str], untraced: str | None = None) -> int:
    """Print the settings, then each model's verdict and cause; write OUT/switch.json; the exit status."""
    results = {label: verdict(out / "runs" / label / "a", out / "runs" / label / "b", untraced) for label in labels}
    first = results[labels[0]]
    print(f"settings, read from the two runs of {labels[0]} (* differs; ? not measured on one side):\n"
          + table(first["settings"], "A: " + Path(a).stem, "B: " + Path(b).stem))
    for label, r in results.items():
        head = f"{label}: " + ("identical" if r["identical"] else "differs")
        print(f"\n{head}\n  " + r["report"].replace("\n", "\n  "))
        for cause in r["causes"]:
            print(f"  known cause ({cause['key']}): {cause['text']}\n    tested in {cause['test']}")
        if not r["identical"] and not r["causes"]:
            where = ("the first differing module above" if r["module"] else "the first differing tensor above"
                     if r["tensor"] else "the settings that differ (* rows)")
            print(f"  no known cause: {where} is where to look")
    (out / "switch.json").write_text(json.dumps({"a": a, "b": b, "translation_warnings": warnings,
                                                 "models": results}, indent=1))
    same = sum(r["identical"] for r in results.values())
    if len(results) > 1:
        print(f"\n{same} of {len(results)} identical; wrote {out / 'switch.json'}")
    return 0 if same == len(results) else 1
