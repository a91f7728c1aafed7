"""Convert a training checkpoint between FSDP and DeepSpeed, or export plain transformers weights.

    python -m helpers.convert ckpt/step_10 ckpt_ds/step_10 --to deepspeed   # then --resume it under DeepSpeed
    python -m helpers.convert ckpt_ds/step_10 ckpt_fs/step_10 --to fsdp     # then --resume it under FSDP
    python -m helpers.convert ckpt/step_10 hf_model --to hf                  # config.json + model.safetensors

One process, no GPU, no process group. Every source (see helpers.checkpoint:
FSDP ``sharded`` DCP, FSDP ``full``, DeepSpeed ZeRO-3) is first read into one
consolidated fp32 layout, parameter by parameter, by name::

    {"model": {fqn: tensor}, "optim": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}},
                                       "param_groups": [{"lr", "betas", ..., "params": [fqn, ...]}]}}

- ``--to fsdp`` writes that as a DCP checkpoint (format ``sharded``): FSDP
  reshards it to any world size when it loads.
- ``--to deepspeed`` writes it as ``full.pt`` (format ``full``). DeepSpeed's
  own files are cut to one world size (one flat partition per rank), so the
  job that resumes it does the import at start-up, for any world size:
  weights into the module before ``deepspeed.initialize``, then the fp32
  master and Adam state with ``safe_set_full_fp32_param`` /
  ``safe_set_full_optimizer_state``.
- ``--to hf`` writes ``config.json`` + ``model.safetensors`` (fp32 weights, no
  optimizer): loadable with ``from_pretrained`` or ``--model DIR``.

Nothing is overwritten; ``DST`` appears only once complete. Bad input (not a
checkpoint, a partial one, state that does not match its model) exits 2 with
one ``error:`` line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

TARGETS = ("fsdp", "deepspeed", "hf")


def read_consolidated(src: str | os.PathLike, meta: dict) -> dict:
    """Any checkpoint format -> {"model": ..., "optim": ...}, fp32, full tensors, keyed by parameter name."""
    import torch

    from .checkpoint import CheckpointError, load_full

    p = Path(src)
    if meta["format"] == "full":
        state = dict(load_full(p))
    elif meta["format"] == "sharded":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(str(p / "dcp"), os.path.join(tmp, "state.pt"))
            state = torch.load(os.path.join(tmp, "state.pt"), map_location="cpu", weights_only=False)
    else:
        state = read_deepspeed(p / "ds" / "ds", meta)
    for key in ("model", "optim"):
        if key not in state:
            raise CheckpointError(f"checkpoint {p}: partial checkpoint (no {key} state in it)")
    check_state(state, meta, str(p))
    return state


def read_deepspeed(folder: Path, meta: dict) -> dict:
    """A ZeRO-3 checkpoint (one model_states and one optim_states file per rank) -> consolidated fp32.

    ZeRO-3 cuts every parameter into ``ceil(numel / world_size)``-element pieces (the last padded); rank
    r's flat fp32 partition is its piece of each parameter, one after another, in ``param_shapes`` order.
    Adam's exp_avg / exp_avg_sq are flat tensors of the same layout."""
    import torch

    from .checkpoint import CheckpointError

    ws = meta["world_size"]
    optim_files = sorted(folder.glob("*zero_pp_rank_*_optim_states.pt"),
                         key=lambda f: int(f.name.split("zero_pp_rank_")[1].split("_")[0]))
    model_file = folder / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    if len(optim_files) != ws or not model_file.is_file():
        found = "found" if model_file.is_file() else "missing"
        raise CheckpointError(f"checkpoint {folder.parent.parent}: partial checkpoint ({len(optim_files)} of "
                              f"{ws} optimizer partitions, model states {found})")
    shapes = {}
    for group in torch.load(model_file, map_location="cpu", weights_only=False)["param_shapes"]:
        shapes.update(group)
    flats, avgs, sqs, steps, groups = [], [], [], set(), None
    for f in optim_files:
        osd = torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        if osd.get("zero_stage") != 3:
            raise CheckpointError(f"checkpoint {folder.parent.parent}: DeepSpeed ZeRO stage {osd.get('zero_stage')}; "
                                  "helpers.convert reads ZeRO-3 checkpoints")
        inner = osd["optimizer_state_dict"]
        n = len(osd["fp32_flat_groups"])
        flats.append(torch.cat([t.float() for t in osd["fp32_flat_groups"]]))
        avgs.append(torch.cat([inner["state"][i]["exp_avg"] for i in range(n)]))
        sqs.append(torch.cat([inner["state"][i]["exp_avg_sq"] for i in range(n)]))
        steps |= {float(inner["state"][i]["step"]) for i in range(n)}
        groups = inner["param_groups"]
    if len(steps) != 1:
        raise CheckpointError(f"checkpoint {folder.parent.parent}: partitions disagree on the step {sorted(steps)}")
    step = torch.tensor(steps.pop())
    model, state, offset = {}, {}, 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        part = math.ceil(numel / ws)

        def whole(parts, _o=offset, _p=part, _n=numel, _s=tuple(shape)):
            return torch.cat([t[_o:_o + _p] for t in parts])[:_n].reshape(_s).clone()

        model[name] = whole(flats)
        state[name] = {"step": step.clone(), "exp_avg": whole(avgs), "exp_avg_sq": whole(sqs)}
        offset += part
    if offset != flats[0].numel():
        raise CheckpointError(f"checkpoint {folder.parent.parent}: model mismatch: parameters need {offset} "
                              f"elements per rank, the partitions hold {flats[0].numel()}")
    hyper = {k: v for k, v in groups[0].items() if k != "params"}
    return {"model": model, "optim": {"state": state, "param_groups": [{**hyper, "params": list(model)}]}}


def check_state(state: dict, meta: dict, where: str) -> None:
    """The state holds exactly the parameters meta.json names, with their shapes, and Adam state for each."""
    from .checkpoint import CheckpointError, check_model

    check_model(meta, {k: list(v.shape) for k, v in state["model"].items()}, where)
    missing = [k for k in state["model"] if k not in state["optim"].get("state", {})]
    if missing:
        raise CheckpointError(f"checkpoint {where}: partial checkpoint: no optimizer state for {len(missing)} "
                              f"parameters (e.g. {missing[0]})")


def convert(src: str, dst: str, to: str) -> dict:
    """Write ``dst`` from checkpoint ``src``; returns the new meta. Raises CheckpointError on bad input."""
    import torch

    from .checkpoint import META, CheckpointError, dir_bytes, read_meta

    if to not in TARGETS:
        raise CheckpointError(f"--to {to!r}: allowed values are {', '.join(TARGETS)}")
    meta = read_meta(src)
    d = Path(dst)
    if d.exists() and (not d.is_dir() or any(d.iterdir())):
        raise CheckpointError(f"DST {dst}: already exists and is not empty; pick a new path (nothing is overwritten)")
    t0 = time.perf_counter()
    state = read_consolidated(src, meta)
    tmp = d.with_name(f".{d.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if to == "hf":
        from safetensors.torch import save_file

        cfg = dict(meta["model_config"])
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file({k: v.contiguous() for k, v in state["model"].items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        new = {"format": "hf", "converted_from": str(src), "step": meta["step"]}
        (tmp / "conversion.json").write_text(json.dumps(new, indent=2))
    else:
        if to == "fsdp":
            from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

            torch.save(state, tmp / "state.pt")
            torch_save_to_dcp(str(tmp / "state.pt"), str(tmp / "dcp"))
            (tmp / "state.pt").unlink()
            fmt = "sharded"
        else:
            torch.save(state, tmp / "full.pt")
            fmt = "full"
        if (Path(src) / "rng").is_dir():  # restored only when the new job has the same world size
            shutil.copytree(Path(src) / "rng", tmp / "rng")
        new = {**{k: v for k, v in meta.items() if k not in ("save_seconds", "bytes")},
               "format": fmt, "converted_from": str(src), "converted_to": to,
               "saved_dtypes": {"model": sorted({str(v.dtype).removeprefix("torch.")
                                                 for v in state["model"].values()}), "optim": ["float32"]}}
    new["convert_seconds"] = time.perf_counter() - t0
    new["bytes"] = dir_bytes(tmp)
    (tmp / (META if to != "hf" else "conversion.json")).write_text(json.dumps(new, indent=2))
    d.parent.mkdir(parents=True, exist_ok=True)
    if d.exists():
        d.rmdir()
    os.replace(tmp, d)
    return new


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m helpers.convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="checkpoint directory (DIR/step_K)")
    ap.add_argument("dst", help="new directory to write (must not exist)")
    ap.add_argument("--to", required=True, help="fsdp, deepspeed or hf")
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from .checkpoint import CheckpointError

    try:
        new = convert(args.src, args.dst, args.to)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.dst} ({new['format']}, {new['bytes'] / 1e6:.1f} MB, {new['convert_seconds']:.2f} s) "
          f"from {args.src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
