"""Does a saved adapter work on its own? Load it with PEFT on a plain base model and compare the loss.

    python -m helpers.adapter CKPT/step_K [--adapter adapter] [--json]

A LoRA job (``helpers.train --peft FILE --checkpoint-dir CKPT``) writes ``CKPT/step_K/adapter/`` in PEFT's
format. This builds the base model the job started from (``--model`` and ``--seed`` from the checkpoint's
``meta.json``: the same random init, or the same pretrained directory), loads the adapter with
``PeftModel.from_pretrained`` as any PEFT user would, casts it to the job's compute dtype (bf16 under mixed
precision: the dtype the job's forward ran the adapter in), and computes the loss on step K's batch, every
rank's slice and micro-batch, averaged as the job averages them. A job that ran step K logged that loss
(``metrics.jsonl``, step K: the weights after K updates, before the K+1-th). Exit 0 when the adapter loaded
whole (no empty tensor, no missing key), 1 otherwise.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from helpers.core.cli import OneLineParser


class AdapterError(ValueError):
    """The checkpoint or adapter cannot be checked; the message says why."""


def adapter_loss(ckpt: str | Path, adapter: str = "adapter") -> dict:
    """The loss of base + saved adapter on step K's global batch (see the module doc), and what was loaded."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file

    from helpers.core.models import build_model, resolve_model, synthetic_batch
    from helpers.job.checkpoint import read_meta

    ckpt = Path(ckpt)
    meta = read_meta(ckpt)
    where = ckpt / adapter
    if not meta.get("peft"):
        raise AdapterError(f"{ckpt}: saved by a job without --peft (no adapter to check)")
    if not (where / "adapter_model.safetensors").is_file():
        why = (meta.get(adapter) or {}).get("error")  # --save-naive-adapter under FSDP2: the save itself failed
        raise AdapterError(f"{where}: no adapter_model.safetensors" + (f" (the save failed: {why})" if why else ""))
    saved = load_file(str(where / "adapter_model.safetensors"))
    empty = sorted(k for k, v in saved.items() if v.numel() == 0)
    t, ws = meta["train"], meta["world_size"]
    bf16 = meta["mixed_precision"] == "bf16" or t["model_dtype"] == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32  # the dtype the job's forward ran in
    base = build_model(resolve_model(meta["model"]), dtype=dtype, seed=meta["seed"])
    out = {"path": str(where), "tensors": len(saved), "empty": len(empty), "step": meta["step"]}
    try:
        model = PeftModel.from_pretrained(base, str(where))
    except (RuntimeError, ValueError) as e:  # an empty or mis-shaped tensor: PEFT's size-mismatch error
        lines = [ln.strip() for ln in str(e).strip().splitlines()] or [type(e).__name__]
        first = next((ln for ln in lines if "size mismatch" in ln), lines[0])  # the first tensor PEFT could not take
        return {**out, "loaded": False, "error": first[:300], "loss": None}
    model.to(dtype).eval()
    losses = []
    with torch.no_grad():
        for rank in range(ws):
            per = [model(input_ids=(ids := synthetic_batch(
                meta["step"], seed=meta["seed"], rank=rank, world_size=ws, micro_batch=t["micro_batch"],
                seq_len=t["seq_len"], vocab_size=base.config.vocab_size, micro_step=m, grad_accum=t["grad_accum"])),
                labels=ids).loss.float() for m in range(t["grad_accum"])]
            losses.append(torch.stack(per).mean())
    return {**out, "loaded": True, "error": None, "loss": float(torch.stack(losses).mean())}


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m helpers.adapter", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="CKPT/step_K of a --peft job")
    ap.add_argument("--adapter", default="adapter", help="the directory in it: adapter (the guide's, gathered) or "
                    "adapter_naive (--save-naive-adapter)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        r = adapter_loss(args.checkpoint, args.adapter)
    except (AdapterError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(r))
    elif r["loaded"]:
        print(f"{r['path']}: {r['tensors']} tensors, {r['empty']} empty; loss on step {r['step']}'s batch "
              f"{r['loss']:.6f}")
    else:
        print(f"{r['path']}: {r['tensors']} tensors, {r['empty']} empty; PEFT could not load it: {r['error']}")
    return 0 if r["loaded"] and not r["empty"] else 1


if __name__ == "__main__":
    sys.exit(main())
