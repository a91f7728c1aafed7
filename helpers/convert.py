"""Convert a training checkpoint between FSDP and DeepSpeed, or export plain transformers weights.

    python -m helpers.convert ckpt/step_10 ckpt_ds/step_10 --to deepspeed   # then --resume it under DeepSpeed
    python -m helpers.convert ckpt_ds/step_10 ckpt_fs/step_10 --to fsdp     # then --resume it under FSDP
    python -m helpers.convert ckpt/step_10 hf_model --to hf                  # config.json + model.safetensors
    python -m helpers.convert ckpt_ds/step_10 univ/step_10 --to universal   # DeepSpeed's universal checkpoint

One process, no GPU, no process group. Every source (see helpers.job.checkpoint:
FSDP ``sharded`` DCP, FSDP ``full``, DeepSpeed ZeRO stage 0-3) is first read into one
consolidated fp32 layout, parameter by parameter, by name::

    {"model": {fqn: tensor}, "optim": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}},
                                       "param_groups": [{"lr", "betas", ..., "params": [fqn, ...]}]}}

- ``--to fsdp`` writes that as a DCP checkpoint (format ``sharded``): FSDP
  reshards it to any world size when it loads.
- ``--to deepspeed`` writes it as ``full.pt`` (format ``full``). DeepSpeed's
  own files are cut to one world size (one flat partition per rank), so the
  job that resumes it does the import at start-up, for any world size and
  ZeRO stage: weights into the module before ``deepspeed.initialize``, then
  the fp32 master and Adam state (``safe_set_full_fp32_param`` /
  ``safe_set_full_optimizer_state``; see helpers.job.ds_import.import_deepspeed).
- ``--to hf`` writes ``config.json`` + ``model.safetensors`` (fp32 weights, no
  optimizer): loadable with ``from_pretrained`` or ``--model DIR``.
- ``--to universal`` runs DeepSpeed's own ``ds_to_universal`` (format ``universal``): on a DeepSpeed
  checkpoint directly, on any other after writing DeepSpeed's ZeRO-3 files from it at one rank
  (helpers.universal). DeepSpeed resumes it at any world size with ``"checkpoint": {"load_universal": true}``.
  A universal checkpoint is also a source for the other targets.

Nothing is overwritten; ``DST`` appears only once complete. Bad input (not a
checkpoint, a partial one, state that does not match its model) exits 2 with
one ``error:`` line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

from helpers import set_ds_accelerator
from helpers.core import safeload
from helpers.universal import native_at_one_rank, read_universal, to_universal

TARGETS = ("fsdp", "deepspeed", "hf", "universal")


@contextlib.contextmanager
def single_process_dcp():
    """dcp.load/save with ``no_dist=True`` still warn that torch.distributed is uninitialized and that they
    "assume the intent" of one process: that is this converter's intent, so the warning is dropped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def read_consolidated(src: str | os.PathLike, meta: dict) -> dict:
    """Any checkpoint format -> {"model": ..., "optim": ...}, fp32, full tensors, keyed by parameter name."""

    from helpers.job.checkpoint import CheckpointError, load_full

    p = Path(src)
    if meta["format"] == "full":
        state = dict(load_full(p))
    elif meta["format"] == "sharded":  # what dcp_to_torch_save does, with metadata and items read safely
        import torch.distributed.checkpoint as dcp

        reader, planner = safeload.dcp_reader_and_planner(p / "dcp", empty=True)
        with single_process_dcp():
            dcp.load({}, storage_reader=reader, planner=planner, no_dist=True)
        state = planner.original_state_dict  # the planner built it from the checkpoint's metadata
    elif meta["format"] == "universal":
        state = _universal_with_frozen(p / "ds" / "ds", meta)
    else:
        state = read_deepspeed(p / "ds" / "ds", meta)
    for key in ("model", "optim"):
        if key not in state:
            raise CheckpointError(f"checkpoint {p}: partial checkpoint (no {key} state in it)")
    check_state(state, meta, str(p))
    return state


def _rank_of(f: Path) -> int:
    return int(f.name.split("zero_pp_rank_")[1].split("_")[0])


def _first_model_states(folder: Path) -> Path | None:
    """Rank 0's model states file: ZeRO-3 writes one per rank, the other stages one for all."""
    return next((f for f in (folder / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                             folder / "mp_rank_00_model_states.pt") if f.is_file()), None)


def _universal_with_frozen(folder: Path, meta: dict) -> dict:
    """``read_universal``, less the tied aliases it writes a directory for, plus the frozen parameters' weights,
    which ZeRO-3's universal files leave in the model states files DeepSpeed's tool copies beside them."""
    state = read_universal(folder, meta)
    ms_first = _first_model_states(folder)
    if ms_first is None:
        return state
    ms = safeload.load(ms_first, "deepspeed")
    for alias in ms.get("shared_params") or {}:  # one tensor under two names: the parameter's own is kept
        state["model"].pop(alias, None)
        state["optim"]["state"].pop(alias, None)
    for g in state["optim"]["param_groups"]:
        g["params"] = [n for n in g["params"] if n in state["optim"]["state"]]
    stage3 = ms_first.name.startswith("zero_pp_rank_")
    files = sorted(folder.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"), key=_rank_of) if stage3 else [ms_first]
    for name, t in _frozen(files, 3 if stage3 else 2).items():
        state["model"].setdefault(name, t)
    return state


def read_deepspeed(folder: Path, meta: dict) -> dict:
    """A DeepSpeed checkpoint (``engine.save_checkpoint``, ZeRO stage 0-3) -> consolidated fp32.

    Where each stage keeps the fp32 master weights and Adam's exp_avg / exp_avg_sq (always flat tensors of
    the same layout as the master), as DeepSpeed's own ``deepspeed.utils.zero_to_fp32`` reads them (it
    stops at the weights; tests/test_convert_layouts.py checks these weights against it):

    - stage 0: no partitions; ``mp_rank_00_model_states.pt`` holds the optimizer, one tensor per parameter.
    - stage 1-2: one ``*optim_states.pt`` per rank; per parameter group, the parameters are laid end to end
      in one flat vector (each followed by its ``param_alignment_paddings``, when the file has them),
      padded at the end, and cut into ``world_size`` equal pieces, one per rank.
    - stage 3: one ``*optim_states.pt`` per rank; every parameter is cut into ``ceil(numel / world_size)``
      pieces (the last padded), and rank r's partition is its piece of each parameter in turn, split into
      sub-groups of at most about ``sub_group_size`` elements (one flat tensor and one Adam state each).

    Frozen parameters (``requires_grad=False``) are not in the partitions: their weights are in the model
    states files (``frozen_param_fragments``: whole under ZeRO 1-2, each rank's piece under ZeRO-3), and
    they have no Adam state, so they are in ``model`` but not in the optimizer's ``params``. A parameter
    shared by two names (tied embeddings) is saved once; ``shared_params`` names the alias, which
    ``named_parameters`` does not list either, so it is not repeated here.
    """
    import torch

    from helpers.job.checkpoint import CheckpointError

    ws, where = meta["world_size"], folder.parent.parent
    model_file = _first_model_states(folder)
    if model_file is None:
        raise CheckpointError(f"checkpoint {where}: partial checkpoint (no model states file in {folder})")
    ms = safeload.load(model_file, "deepspeed")
    stage = int((ms.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0))
    if stage == 0:
        return _read_stage0(ms, meta, where)

    optim_files = sorted(folder.glob("*zero_pp_rank_*_optim_states.pt"), key=_rank_of)
    model_files = (sorted(folder.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"), key=_rank_of) if stage == 3
                   else [model_file])  # ZeRO 1-2: one model states file for all ranks
    if len(optim_files) != ws or len(model_files) != (ws if stage == 3 else 1):
        raise CheckpointError(f"checkpoint {where}: partial checkpoint ({len(optim_files)} optimizer and "
                              f"{len(model_files)} model state files for {ws} ranks)")
    ranks = [safeload.load(f, "deepspeed")["optimizer_state_dict"] for f in optim_files]
    if any(int(r.get("zero_stage", -1)) != stage for r in ranks):
        raise CheckpointError(f"checkpoint {where}: optimizer partitions disagree with the model states on the "
                              f"ZeRO stage ({stage})")
    shapes = [dict(g) for g in ms["param_shapes"]]  # per group (ZeRO-3: per sub-group), in flat order
    flat_key, inner_key = (("fp32_flat_groups", "optimizer_state_dict") if stage == 3
                           else ("single_partition_of_fp32_groups", "base_optimizer_state"))
    inner = [r[inner_key] for r in ranks]
    states = [[i["state"][k] for k in sorted(i["state"])] for i in inner]  # one per (sub-)group, in order
    steps = {float(s["step"]) for st in states for s in st}
    if len(steps) != 1:
        raise CheckpointError(f"checkpoint {where}: partitions disagree on the step {sorted(steps)}")
    model, state = {}, {}
    if stage == 3:  # a rank's sub-groups end to end are its partition: every parameter's piece in turn
        flats = [torch.cat([t.float() for t in r[flat_key]]) for r in ranks]
        avgs, sqs = ([torch.cat([s[k] for s in st]) for st in states] for k in ("exp_avg", "exp_avg_sq"))
        used = _split_stage3({k: v for g in shapes for k, v in g.items()}, ws, flats, avgs, sqs, model, state)
        if used != flats[0].numel():
            raise CheckpointError(f"checkpoint {where}: model mismatch: the parameters need {used} elements per "
                                  f"rank, the ZeRO-3 partitions hold {flats[0].numel()}")
    else:
        pads = ranks[0].get("param_alignment_paddings")
        for g, group in enumerate(shapes):
            flat, avg, sq = (torch.cat([x.float() for x in parts]) for parts in (
                [r[flat_key][g] for r in ranks], [st[g]["exp_avg"] for st in states],
                [st[g]["exp_avg_sq"] for st in states]))
            used = _split_flat(group, flat, avg, sq, model, state, pads[g] if pads else None)
            align = 2 * ws  # zero_to_fp32's check: ZeRO-2 pads each group to a multiple of 2 x world size
            if math.ceil(used / align) != math.ceil(flat.numel() / align):
                raise CheckpointError(f"checkpoint {where}: model mismatch: parameter group {g} needs {used} "
                                      f"elements, the ZeRO-{stage} partitions hold {flat.numel()}")
    trainable = set(model)
    model.update(_frozen(model_files, stage))
    step = torch.tensor(steps.pop())
    for s in state.values():
        s["step"] = step.clone()
    order = [n for n in meta.get("param_shapes", model) if n in model]  # the module's parameter order
    model = {n: model[n] for n in order + [n for n in model if n not in order]}
    hyper = {k: v for k, v in inner[0]["param_groups"][0].items() if k != "params"}
    return {"model": model, "optim": {"state": state, "param_groups": [
        {**hyper, "params": [n for n in model if n in trainable]}]}}


def _frozen(model_files: list[Path], stage: int) -> dict:
    """Frozen parameters' weights from the model states files (ZeRO 1-2: whole, in rank 0's; ZeRO-3: each
    rank's ``ceil(numel / world_size)`` piece, the last padded)."""
    import torch

    first = safeload.load(model_files[0], "deepspeed")
    shapes = first.get("frozen_param_shapes") or {}
    if not shapes:
        return {}
    frags = [first["frozen_param_fragments"]] + ([safeload.load(f, "deepspeed")["frozen_param_fragments"]
                                                  for f in model_files[1:]] if stage == 3 else [])
    return {name: torch.cat([f[name].reshape(-1) for f in frags])[:math.prod(shape)].float()
            .reshape(tuple(shape)).clone() for name, shape in shapes.items()}


def _split_flat(shapes: dict, flat, avg, sq, model: dict, state: dict, pads=None) -> int:
    """ZeRO-1/2: the parameters of a group end to end in ``flat``, each followed by its alignment padding
    (when given); returns how many elements they use."""

    offset = 0
    for i, (name, shape) in enumerate(shapes.items()):
        n = math.prod(shape)

        def cut(t, _o=offset, _n=n, _s=tuple(shape)):
            return t[_o:_o + _n].reshape(_s).clone()

        model[name], state[name] = cut(flat), {"exp_avg": cut(avg), "exp_avg_sq": cut(sq)}
        offset += n + (pads[i] if pads else 0)
    return offset


def _split_stage3(shapes: dict, ws: int, flats, avgs, sqs, model: dict, state: dict) -> int:
    """ZeRO-3: each rank holds a ``ceil(numel / ws)`` piece of every parameter; returns elements per rank."""
    import torch

    offset = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        part = math.ceil(numel / ws)

        def whole(parts, _o=offset, _p=part, _n=numel, _s=tuple(shape)):
            return torch.cat([t[_o:_o + _p] for t in parts])[:_n].reshape(_s).clone()

        model[name], state[name] = whole(flats), {"exp_avg": whole(avgs), "exp_avg_sq": whole(sqs)}
        offset += part
    return offset


def _read_stage0(ms: dict, meta: dict, where) -> dict:
    """ZeRO-0: the optimizer is in the model states file. In bf16/fp16 DeepSpeed's wrapper keeps one fp32
    master tensor per parameter (``fp32_groups``); in fp32 it is the torch optimizer's own state dict and
    the module holds the master weights. Either way Adam's state is keyed by parameter index."""
    import torch

    from helpers.job.checkpoint import CheckpointError

    opt = ms.get("optimizer")
    if not opt:
        raise CheckpointError(f"checkpoint {where}: partial checkpoint (ZeRO-0 model states without optimizer)")
    inner = opt.get("optimizer_state_dict", opt)
    names = list(meta["param_shapes"])  # the order of model.parameters(), which the optimizer was given
    index = [i for g in inner["param_groups"] for i in g["params"]]
    if len(index) != len(names):
        raise CheckpointError(f"checkpoint {where}: model mismatch: the optimizer has {len(index)} parameters, "
                              f"meta.json names {len(names)}")
    masters = [t for g in opt["fp32_groups"] for t in g] if "fp32_groups" in opt else \
        [ms["module"][n] for n in names]
    model, state = {}, {}
    for name, i, w in zip(names, index, masters, strict=True):
        s = inner["state"][i]
        model[name] = w.float().clone()
        state[name] = {"step": torch.as_tensor(s["step"]).float().clone(), "exp_avg": s["exp_avg"].clone(),
                       "exp_avg_sq": s["exp_avg_sq"].clone()}
    hyper = {k: v for k, v in inner["param_groups"][0].items() if k != "params"}
    return {"model": model, "optim": {"state": state, "param_groups": [{**hyper, "params": names}]}}


def check_state(state: dict, meta: dict, where: str) -> None:
    """The state holds exactly the parameters meta.json names, with their shapes, and Adam state for each."""
    from helpers.job.checkpoint import CheckpointError, check_model

    check_model(meta, {k: list(v.shape) for k, v in state["model"].items()}, where)
    groups = state["optim"].get("param_groups") or [{}]
    stepped = {n for g in groups for n in g.get("params", state["model"])}  # frozen parameters: no Adam state
    missing = [k for k in state["model"] if k in stepped and k not in state["optim"].get("state", {})]
    if missing:
        raise CheckpointError(f"checkpoint {where}: partial checkpoint: no optimizer state for {len(missing)} "
                              f"parameters (e.g. {missing[0]})")


def _saved_dtypes(state: dict) -> dict[str, list[str]]:
    return {"model": sorted({str(v.dtype).removeprefix("torch.") for v in state["model"].values()}),
            "optim": sorted({str(v.dtype).removeprefix("torch.") for s in state["optim"]["state"].values()
                             for v in s.values() if hasattr(v, "dtype") and v.dim() > 0})}


def convert(src: str, dst: str, to: str) -> dict:
    """Write ``dst`` from checkpoint ``src``; returns the new meta. Raises CheckpointError on bad input."""
    import torch

    from helpers.job.checkpoint import META, CheckpointError, dir_bytes, read_meta

    if to not in TARGETS:
        raise CheckpointError(f"--to {to!r}: allowed values are {', '.join(TARGETS)}")
    meta = read_meta(src)
    safeload.scan(src, meta["format"])  # refuse a file that would run code before reading anything
    d = Path(dst)
    if d.exists() and (not d.is_dir() or any(d.iterdir())):
        raise CheckpointError(f"DST {dst}: already exists and is not empty; pick a new path (nothing is overwritten)")
    if meta["format"] == "sharded" or to == "fsdp":  # imports (seconds) are not the conversion
        import torch.distributed.checkpoint  # noqa: F401
    if meta["format"] == "deepspeed":
        import deepspeed  # noqa: F401 - its pickled classes are in DeepSpeed's files
    if to == "universal" and meta["format"] == "universal":
        raise CheckpointError(f"--to universal: {src} is a universal checkpoint already")
    t0 = time.perf_counter()
    state = read_consolidated(src, meta) if to != "universal" else None
    tmp = d.with_name(f".{d.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if to == "universal":
        if meta["format"] != "deepspeed":  # DeepSpeed's tool reads DeepSpeed's files: write them first (1 rank)
            native_at_one_rank(Path(src), tmp / "native")
        to_universal(Path(src) if meta["format"] == "deepspeed" else tmp / "native", tmp)
        shutil.rmtree(tmp / "native", ignore_errors=True)
        state = _universal_with_frozen(tmp / "ds" / "ds", meta)  # read back what DeepSpeed wrote, checked as a source
        check_state(state, meta, str(tmp))
        fmt = "universal"
    elif to == "hf":
        from safetensors.torch import save_file

        cfg = dict(meta["model_config"])
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file({k: v.contiguous() for k, v in state["model"].items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        new = {"format": "hf", "converted_from": str(src), "step": meta["step"]}
        (tmp / "conversion.json").write_text(json.dumps(new, indent=2))
    else:
        if to == "fsdp":
            import torch.distributed.checkpoint as dcp

            # what torch_save_to_dcp does after reading its input file (FileSystemWriter, no_dist), without
            # first writing the whole state to a temporary state.pt: the same files, half the bytes written
            with single_process_dcp():
                dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp / "dcp")), no_dist=True)
            fmt = "sharded"
        else:
            torch.save(state, tmp / "full.pt")
            fmt = "full"
    if to != "hf":
        if (Path(src) / "rng").is_dir():  # restored only when the new job has the same world size
            shutil.copytree(Path(src) / "rng", tmp / "rng")
        new = {**{k: v for k, v in meta.items() if k not in ("save_seconds", "bytes")},
               "format": fmt, "converted_from": str(src), "converted_to": to,
               "saved_dtypes": _saved_dtypes(state)}
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
    ap.add_argument("--to", required=True, help="fsdp, deepspeed, hf or universal")
    args = ap.parse_args(argv)
    set_ds_accelerator(cpu=True)
    from helpers.job.checkpoint import CheckpointError

    try:
        new = convert(args.src, args.dst, args.to)
    except (CheckpointError, safeload.UnreadableFile) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.dst} ({new['format']}, {new['bytes'] / 1e6:.1f} MB, {new['convert_seconds']:.2f} s) "
          f"from {args.src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
