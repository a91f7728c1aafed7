"""DeepSpeed's universal checkpoint, beside the guide's own formats (helpers.job.checkpoint: format ``universal``).

``to_universal`` runs DeepSpeed's own ``ds_to_universal`` on a DeepSpeed checkpoint (``helpers.convert --to
universal``); DeepSpeed resumes the result at any world size with ``"checkpoint": {"load_universal": true}``
(launch_configs/deepspeed/zero3_universal.yaml). From any other format (FSDP's, or the guide's ``full.pt``)
``python -m helpers.universal_native SRC OUT`` first writes DeepSpeed's own ZeRO-3 files at one rank: an engine in
that process imports the state as a resuming job does (helpers.job.ds_import) and saves; ``ds_to_universal``
then reads those. ``read_universal`` reads a universal checkpoint into the converter's consolidated layout,
so it is also a source for ``--to fsdp|deepspeed|hf``.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from pathlib import Path

from helpers.core import safeload


def read_universal(folder: Path, meta: dict) -> dict:
    """A DeepSpeed universal checkpoint (``zero/NAME/{fp32,exp_avg,exp_avg_sq}.pt``, ``zero/optimizer_state.pt``)
    -> the consolidated layout. ZeRO-3's tensors are stored flat: shaped here as ``meta`` names them."""
    from helpers.job.checkpoint import CheckpointError

    zero = folder / "zero"
    glob_state = zero / "optimizer_state.pt"
    if not glob_state.is_file():
        raise CheckpointError(f"checkpoint {folder.parent.parent}: partial universal checkpoint (no {glob_state})")
    osd = safeload.load(glob_state, "deepspeed")
    if "optimizer_state_dict" in osd:  # ZeRO-3: one step for all, the groups inside
        osd = osd["optimizer_state_dict"]
        step = osd["state"][0]["step"]
    else:  # ZeRO-1/2: a step.pt per parameter
        step = None
    group = {k: v for k, v in osd["param_groups"][0].items() if k != "params"}
    model, state = {}, {}
    for d in sorted(x for x in zero.iterdir() if x.is_dir()):
        parts = {k: safeload.load(d / f"{k}.pt", "deepspeed") for k in ("fp32", "exp_avg", "exp_avg_sq", "step")
                 if (d / f"{k}.pt").is_file()}
        parts = {k: v["param"] if isinstance(v, dict) else v for k, v in parts.items()}  # ZeRO-1/2: {param, cat_dim}
        if step is not None:
            parts["step"] = step.clone() if hasattr(step, "clone") else step
        if "fp32" not in parts:
            raise CheckpointError(f"checkpoint {folder.parent.parent}: partial universal checkpoint "
                                  f"(no {d / 'fp32.pt'})")
        shape = meta["param_shapes"].get(d.name)
        parts = {k: v.reshape(shape) if k != "step" and shape is not None and v.numel() == math.prod(shape) else v
                 for k, v in parts.items()}
        model[d.name] = parts["fp32"]
        if "exp_avg" in parts:
            state[d.name] = {"step": parts["step"], "exp_avg": parts["exp_avg"], "exp_avg_sq": parts["exp_avg_sq"]}
    return {"model": model, "optim": {"state": state, "param_groups": [{**group, "params": sorted(state)}]}}


def to_universal(src: Path, tmp: Path) -> None:
    """DeepSpeed's own ``ds_to_universal`` on a ``deepspeed`` checkpoint, into ``tmp/ds/ds`` (tag "ds")."""


    out = tmp / "ds" / "ds"
    out.parent.mkdir(parents=True)
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(src / "ds" / "ds"),
           "--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1",
           "--inject_missing_state"]  # ZeRO-1/2: the universal_checkpoint_info Megatron would save (its own flag)
    _run_tool(cmd, f"DeepSpeed's ds_to_universal failed on {src}", {"DS_ACCELERATOR": "cpu"})
    shutil.rmtree(out / "tmp", ignore_errors=True)  # its scratch slices (it keeps them only when asked)


def native_at_one_rank(src: Path, out: Path) -> None:
    """Another process: ``src`` (any format) -> DeepSpeed's own ZeRO-3 files at one rank in ``out/ds/ds``."""


    _run_tool([sys.executable, "-m", "helpers.universal_native", str(src), str(out)],
              f"writing DeepSpeed's files from {src} failed", {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})


def _run_tool(cmd: list[str], failed: str, env: dict) -> None:
    """Run a conversion step in its own process; a failure is one CheckpointError line: ``failed`` and the last
    line the step wrote to stderr."""
    import subprocess

    from helpers.job.checkpoint import CheckpointError

    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    if proc.returncode != 0:
        last = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or ["(no message)"]
        raise CheckpointError(f"{failed}: {last[0].strip()}")
