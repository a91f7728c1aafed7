"""LoRA fine-tuning through PEFT: ``helpers.train --peft FILE``.

FILE is a LoRA config as PEFT writes it (``adapter_config.json``, or a directory holding one, or a JSON
file with the same keys). The job builds the model as usual, then, before any wrapping:

* injects the adapter in place with PEFT's ``inject_adapter_in_model`` (the model keeps its class and
  module paths; a target ``q_proj`` becomes ``q_proj.base_layer`` + ``q_proj.lora_A.default`` +
  ``q_proj.lora_B.default``), which also freezes every other parameter;
* keeps the adapter in the dtype of the layer it adapts, as ``inject_adapter_in_model`` makes it (the model's
  ``--model-dtype``, bf16 by default), like the rest of the model: FSDP then upcasts it to fp32 (Accelerate
  upcasts every trainable parameter under mixed precision) and DeepSpeed builds its fp32 master from it, so both
  start from the same values. (``get_peft_model`` would instead make a bf16 model's adapter fp32,
  ``autocast_adapter_dtype=True``: FSDP keeps those fp32 values, DeepSpeed's bf16 engine rounds them to bf16
  and builds its master from the rounded copy, and the two runs part at the first update.)
* seeds the adapter's initialisation from ``--seed``, so every rank and both backends start alike.

Both backends then hand only the trainable parameters to the optimizer, as transformers' Trainer does
(a frozen parameter has no gradient, no Adam state and, under DeepSpeed bf16, no fp32 master). What
each backend still holds for a frozen parameter is measured by the job (``memory_split_bytes``).

With ``--checkpoint-dir`` every checkpoint also holds ``adapter/`` in PEFT's own format
(``export``): the trainable parameters gathered whole in fp32 (FSDP's ``full_tensor``, DeepSpeed's
``safe_get_full_fp32_param``) and written by rank 0, so ``PeftModel.from_pretrained(base, DIR/step_K/adapter)``
loads it on a plain model (``python -m helpers.adapter DIR/step_K`` does, and compares the loss).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import torch

from helpers.core.cli import first_line

ADAPTER = "default"  # PEFT's adapter name
PREFIX = "base_model.model."  # how PeftModel names the keys of a saved adapter

# LoraConfig keys this guide does not train with (each changes what is trainable or how it is
# initialised in ways its jobs do not measure): refused with one line instead of run untested.
UNTESTED = ("modules_to_save", "trainable_token_indices", "layer_replication", "use_dora", "use_qalora",
            "alora_invocation_tokens", "target_parameters", "megatron_config", "loftq_config", "eva_config",
            "corda_config", "lora_ga_config", "velora_config", "arrow_config", "kasa_config", "monteclora_config",
            "use_bdlora")
INITS = (True, False, "gaussian")  # init_lora_weights values that need no data and no full weight


class PeftConfigError(ValueError):
    """A ``--peft`` file this guide cannot train with; the message names the key, the value and what is allowed."""


def read_config(path: str):
    """The LoraConfig of ``--peft PATH``, or PeftConfigError (one line)."""
    from peft import LoraConfig

    p = Path(path)
    if p.is_dir():
        p = p / "adapter_config.json"
    where = f"--peft {path}"
    if not p.is_file():
        raise PeftConfigError(f"{where}: no such file (give a LoRA config as PEFT writes it: adapter_config.json, "
                              "a directory holding one, or a JSON file with its keys)")
    try:
        raw = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PeftConfigError(f"{where}: not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise PeftConfigError(f"{where}: expected a JSON object of LoraConfig keys, got {type(raw).__name__}")
    kind = str(raw.pop("peft_type", "LORA"))
    if kind.upper() != "LORA":
        raise PeftConfigError(f"{where}: peft_type = {kind!r}: this guide trains LoRA adapters only (peft_type LORA)")
    fields = {f.name for f in dataclasses.fields(LoraConfig)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise PeftConfigError(f"{where}: unknown key {unknown[0]!r}: LoraConfig takes r, lora_alpha, lora_dropout, "
                              "target_modules, bias, ... (peft's LoraConfig fields)")
    for key in UNTESTED:
        value = raw.get(key)
        if value not in (None, False, {}, []):
            raise PeftConfigError(f"{where}: {key} = {json.dumps(value)}: not trained by this guide (it trains r, "
                                  "lora_alpha, lora_dropout, target_modules, bias, use_rslora, rank_pattern, "
                                  "alpha_pattern); leave it out")
    init = raw.get("init_lora_weights", True)
    if init not in INITS:
        raise PeftConfigError(f"{where}: init_lora_weights = {json.dumps(init)}: this guide initialises with "
                              "true (PEFT's default), false or \"gaussian\" (the others read data or the full "
                              "weights before sharding)")
    for key in ("task_type", "auto_mapping", "base_model_name_or_path", "revision", "peft_version"):
        raw.pop(key, None)  # provenance PeftModel writes; nothing to apply
    try:
        return LoraConfig(**raw)
    except (TypeError, ValueError) as e:
        first = first_line(e)
        raise PeftConfigError(f"{where}: PEFT refuses it: {first}") from None


def linear_names(model: torch.nn.Module) -> list[str]:
    """The last path component of every Linear/Embedding module: what ``target_modules`` may name."""
    from transformers.pytorch_utils import Conv1D

    kinds = (torch.nn.Linear, torch.nn.Embedding, Conv1D)
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and isinstance(m, kinds)})


def check_applies(cfg, spec, job, path: str) -> None:
    """Inject the adapter into a meta copy of the model (no memory): PEFT's own refusal, in one line."""
    from peft import inject_adapter_in_model
    from peft.utils.error import NoMatchingPeftModuleError

    from helpers.job.loading import method_for
    from helpers.job.wrap import meta_model

    model = meta_model(spec)
    try:
        inject_adapter_in_model(copy.deepcopy(cfg), model)
    except NoMatchingPeftModuleError as e:
        first = first_line(e)
        raise PeftConfigError(f"--peft {path}: target_modules = {json.dumps(sorted(cfg.target_modules or []))}: "
                              f"{first} ({type(model).__name__}'s linear and embedding modules: "
                              f"{', '.join(linear_names(model))})") from None
    except (ValueError, TypeError, KeyError) as e:
        first = first_line(e)
        raise PeftConfigError(f"--peft {path}: PEFT refuses it for {type(model).__name__}: {first}") from None
    if spec.kind == "pretrained" and method_for(job) != "naive":
        key = "fsdp_cpu_ram_efficient_loading" if job.backend == "fsdp" else "zero3_init_flag"
        raise PeftConfigError(f"--peft {path} with {key}: true: this guide injects the adapter into a whole model "
                              f"before wrapping; with {key} a rank holds no whole model to inject into. Set it "
                              "to false (every rank loads the base), or train without --peft")


def check_args(args, job, spec, resume_meta):
    """--peft FILE (and --save-naive-adapter) before anything starts: the LoraConfig, or None without --peft."""
    if args.save_naive_adapter and not (args.peft and args.checkpoint_dir):
        raise PeftConfigError("--save-naive-adapter needs --peft FILE and --checkpoint-dir DIR (it writes next to "
                              "each checkpoint's adapter)")
    saved = (resume_meta or {}).get("peft")
    if resume_meta and bool(saved) != bool(args.peft):
        raise PeftConfigError(f"--resume {args.resume}: " + (
            "saved by a LoRA job (--peft); give the same --peft FILE" if saved else
            "saved by a job without --peft; resume it without --peft"))
    if not args.peft:
        return None
    cfg = read_config(args.peft)
    check_applies(cfg, spec, job, args.peft)
    return cfg


def attach(s) -> None:
    """The build phase with --peft: the adapter injected into ``s.model``; summary.json's ``peft``; a log line."""
    apply(s.model, s.peft, s.job.train.seed)
    s.summary["peft"] = {**counts(s.model), "config": config_dict(s.peft)}
    s.summary["peft"]["adapted"] = adapted(s.model)
    where = ", ".join(f"{k} x {v}" for k, v in s.summary["peft"]["adapted"].items())
    s.run.log(f"peft: LoRA r={s.peft.r} on {where}: {s.summary['peft']['trainable_params']:,} trainable, "
              f"{s.summary['peft']['frozen_params']:,} frozen parameters")


def adapted(model: torch.nn.Module) -> dict[str, int]:
    """The modules the adapter went into, by name, with how many of each (a target that matches nothing is absent)."""
    from collections import Counter

    return dict(sorted(Counter(n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")
                               and len(m.lora_A)).items()))


def apply(model: torch.nn.Module, cfg, seed: int) -> None:
    """Inject the adapter in place (the base frozen), in the adapted layers' dtype, seeded (module doc)."""
    from helpers.core.models import add_adapter

    add_adapter(model, cfg, seed)


def counts(model: torch.nn.Module) -> dict[str, int]:
    """Trainable and frozen parameter elements (before wrapping)."""
    out = {"trainable_params": 0, "frozen_params": 0}
    for p in model.parameters():
        out["trainable_params" if p.requires_grad else "frozen_params"] += p.numel()
    return out


def config_dict(cfg) -> dict:
    """The LoraConfig as PEFT writes it to adapter_config.json."""
    return json.loads(json.dumps(cfg.to_dict(), default=lambda o: sorted(o) if isinstance(o, set) else str(o)))


# --------------------------------------------------------------------------- the adapter, gathered and saved


def full_trainable(engine) -> dict[str, torch.Tensor]:
    """Every rank: each trainable parameter gathered whole, in fp32 (the optimizer's copy), on the CPU.

    FSDP: ``DTensor.full_tensor()`` of the shard the optimizer steps (fp32 under mixed precision). DeepSpeed:
    ``safe_get_full_fp32_param`` (the fp32 master, ZeRO 1-3; the module's weight where there is no master).
    Both are collectives: every rank calls them in the same order."""
    from helpers.core.models import clean_fqn

    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        if engine.backend == "fsdp":
            t = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        else:
            from deepspeed.utils import safe_get_full_fp32_param

            t = safe_get_full_fp32_param(p)
            t = p.detach() if t is None else t
        out[clean_fqn(name)] = t.detach().float().cpu().clone()
    return out


def peft_keys(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the names ``PeftModel.save_pretrained`` gives them (PEFT's own selection)."""
    from peft import get_peft_model_state_dict

    picked = get_peft_model_state_dict(module, state_dict=state, adapter_name=ADAPTER)
    return {PREFIX + k: v.contiguous() for k, v in picked.items()}


def write(out: Path, tensors: dict[str, torch.Tensor], cfg, model_name: str) -> None:
    """adapter_config.json + adapter_model.safetensors, as PeftModel.save_pretrained lays them out."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    saved = config_dict(cfg)
    saved.update(base_model_name_or_path=model_name, inference_mode=True)
    (out / "adapter_config.json").write_text(json.dumps(saved, indent=2, sort_keys=True))


def export(engine, cfg, out: Path, model_name: str, rank: int) -> dict:
    """Every rank: gather the adapter; rank 0 writes it to ``out``. Returns what was written."""
    tensors = peft_keys(engine.module, full_trainable(engine))
    if rank == 0:
        write(out, tensors, cfg, model_name)
    return {"tensors": len(tensors), "numel": sum(t.numel() for t in tensors.values()),
            "empty": sum(t.numel() == 0 for t in tensors.values())}


def naive_export(engine, cfg, out: Path, model_name: str, rank: int) -> dict:
    """What ``PeftModel.save_pretrained`` on rank 0 writes without gathering first: PEFT's state dict of the module
    as that rank holds it, handed to safetensors. Under ZeRO-3 every partitioned parameter is an empty placeholder
    (written as such); under FSDP2 the values are DTensors, which safetensors cannot write (the error is kept, no
    file is written). For ``--save-naive-adapter`` (the trap, shown); rank 0 only, like the save it imitates."""
    if rank != 0:
        return {}
    import warnings

    from peft import get_peft_model_state_dict

    with warnings.catch_warnings(record=True) as caught:  # PEFT's own warning about empty tensors: kept, not printed
        warnings.simplefilter("always")
        state = {PREFIX + k: v for k, v in get_peft_model_state_dict(engine.module, adapter_name=ADAPTER).items()}
    result = {"tensors": len(state), "numel": sum(_local_numel(t) for t in state.values()),
              "empty": sum(_local_numel(t) == 0 for t in state.values()), "error": None,
              "dtensors": sum(hasattr(t, "to_local") for t in state.values()),
              "peft_warned": any("not gathered" in str(w.message) for w in caught)}
    try:
        write(out, state, cfg, model_name)  # the weights first: a failed save writes no config
    except Exception as e:  # noqa: BLE001 - what the naive save meets is the point; kept as one line
        (out / "adapter_model.safetensors").unlink(missing_ok=True)
        result["error"] = f"{type(e).__name__}: {first_line(e)}"
    return result


def _local_numel(t) -> int:
    return (t.to_local() if hasattr(t, "to_local") else t).numel()
