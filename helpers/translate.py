"""Translate an Accelerate FSDP config into the DeepSpeed one that trains the same way, and back.

    python -m helpers.translate launch_configs/fsdp/full_shard.yaml --to deepspeed -o runs/ds.yaml
    python -m helpers.translate launch_configs/deepspeed/zero3.yaml --to fsdp

The mapping comes from ``helpers.core.mapping`` (``MODES``/``COUNTERPARTS`` for
sharding, ``SETTINGS`` for the rest: offload, loading, checkpoint format,
prefetch, mixed precision, accumulation, clipping). Every key of the input is
either translated or reported: a ``warning:`` line names the key, the value,
why there is no exact counterpart and the nearest choice that was written; a
``note:`` line reports keys that only matter to logging or the launcher.
Nothing is dropped silently. No warnings means the translation is exact.

A DeepSpeed translation is a YAML plus a DeepSpeed JSON (``OUT.json`` next to
``OUT.yaml``): the JSON carries what Accelerate's inline keys cannot
(``gradient_clipping: "auto"``, hpZ, prefetch buckets). Without ``-o`` both
are printed. The output is checked with ``helpers.config`` before it is
written; bad input exits 2 with one ``error:`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from helpers.core.compat import normalize_fsdp_config
from helpers.core.config import ConfigError, JobConfig, _read_yaml, load_job_config
from helpers.core.mapping import CATEGORIES, MODES, counterpart, mode_key

# Top-level keys that only tell `accelerate launch` where and how many: copied as they are.
_LAUNCH_KEYS = ["compute_environment", "debug", "downcast_bf16", "enable_cpu_affinity", "gpu_ids", "machine_rank",
                "main_process_ip", "main_process_port", "main_training_function", "num_machines", "num_processes",
                "rdzv_backend", "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "use_cpu",
                "dynamo_config"]
# DeepSpeed JSON keys that change logging only, not training.
_DS_LOGGING = {"steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer", "comms_logger",
               "flops_profiler", "tensorboard", "wandb", "csv_monitor", "memory_breakdown", "dump_state"}
_DS_LAUNCHER = {"deepspeed_multinode_launcher", "deepspeed_hostfile", "deepspeed_inclusion_filter",
                "deepspeed_exclusion_filter"}


@dataclass
class Translation:
    source: str
    to: str
    yaml: dict
    json: dict | None = None  # the DeepSpeed JSON (to deepspeed only)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not self.warnings

    def header(self) -> str:
        lines = [f"Translated from {self.source} by python -m helpers.translate --to {self.to}."]
        lines += ["Exact: no setting changed meaning."] if self.exact else [
            "Not exact - nearest choices were written for:", *[f"  warning: {w}" for w in self.warnings]]
        lines += [f"  note: {n}" for n in self.notes]
        return "".join(f"# {line}\n" for line in lines)

    def write(self, out: str) -> list[Path]:
        """Write OUT.yaml (and OUT.json for DeepSpeed); returns the paths written."""
        out_p = Path(out)
        out_p.parent.mkdir(parents=True, exist_ok=True)
        written = []
        data = dict(self.yaml)
        if self.json is not None:
            js = out_p.with_suffix(".json")
            js.write_text(json.dumps(self.json, indent=2) + "\n")
            written.append(js)
            data["deepspeed_config"] = {"deepspeed_config_file": _path_for_yaml(js), **data["deepspeed_config"]}
        out_p.write_text(self.header() + yaml.safe_dump(data, sort_keys=False))
        return [out_p, *written]


def _path_for_yaml(p: Path) -> str:
    """Relative to the working directory when under it (as the shipped configs are), else absolute."""
    p = p.resolve()
    try:
        return str(p.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


# --------------------------------------------------------------------------- FSDP -> DeepSpeed


def _fsdp_to_deepspeed(raw: dict, job: JobConfig, t: Translation) -> None:
    o = job.fsdp
    sec, _ = normalize_fsdp_config(raw.get("fsdp_config") or {})
    left = dict(sec)  # every key is popped by the rule that reads it; leftovers are reported
    left.pop("fsdp_version", None)  # FSDP1 vs FSDP2 spelling: no meaning for DeepSpeed
    t.notes += [n for n in job.notes if "fsdp_version" not in n]  # legacy spellings that were read
    if "fsdp_backward_prefetch_policy" in (raw.get("fsdp_config") or {}):
        t.warnings.append("fsdp_config.fsdp_backward_prefetch_policy: an old spelling that Accelerate and this guide "
                          "ignore, so it changed nothing in FSDP either. Nothing to do: DeepSpeed prefetches by "
                          "default")
    warn = t.warnings.append

    # sharding: through the mode table
    for k in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward"):
        left.pop(k, None)
    par = dict(raw.get("parallelism_config") or {})
    key = "shard_grad_op" if o.sharding == "HYBRID_SHARD_ZERO2" else mode_key(job)
    target, exact = counterpart(key)
    stage = int(target.key[4])
    zo: dict = {"stage": stage}
    if stage == 3:  # ZeRO-3 otherwise swaps torch's F.linear for one that adds the bias in a second rounding
        zo["memory_efficient_linear"] = False
    if o.sharding == "HYBRID_SHARD_ZERO2":
        warn("sharding HYBRID_SHARD_ZERO2: DeepSpeed has no hybrid ZeRO-2 (shard within a group, replicate "
             "across groups). Written: ZeRO-2 across all ranks, which shards over every rank instead")
    elif not exact:
        warn(f"sharding {o.sharding}: DeepSpeed has no exact counterpart. Written: the nearest, {target.zero} "
             f"(zero_optimization.stage {stage}{', zero_hpz_partition_size' if target.key == 'zero3_hpz' else ''})"
             f". What differs: {_gap(MODES[key], target)}. Nothing to do to train the same model; what each "
             "rank holds differs (notebook 01 measures it)")
    if target.key == "zero3_hpz":
        size = o.hybrid_shard_size or _ranks_per_node(raw)
        if size:
            zo["zero_hpz_partition_size"] = size
        else:
            warn("parallelism_config: the file gives no shard group size for hpZ. Written: plain ZeRO-3. To "
                 "get hpZ, set zero_optimization.zero_hpz_partition_size to the GPUs per node")
    for k in par:
        if target.key != "zero3_hpz" and k != "parallelism_config_dp_replicate_size":
            warn(f"parallelism_config.{k} = {par[k]}: DeepSpeed has no such setting here, so it was left out. "
                 "Nothing to do unless you relied on it")

    # offload: FSDP moves params, grads and optimizer states together
    if left.pop("fsdp_offload_params", False) is not False and o.offload_params:
        if stage == 3:
            zo["offload_param"] = {"device": "cpu"}
            zo["offload_optimizer"] = {"device": "cpu"}
        elif stage > 0:
            zo["offload_optimizer"] = {"device": "cpu"}
            warn(f"fsdp_offload_params = true under {o.sharding}: FSDP moves params, gradients and optimizer "
                 f"states to the host; ZeRO-{stage} can move only the optimizer (and its gradients). Written: "
                 "offload_optimizer cpu. To offload params too, use ZeRO-3 (fsdp_reshard_after_forward: true)")
        else:
            warn("fsdp_offload_params = true under NO_SHARD: ZeRO-0 cannot offload anything. Written: no "
                 "offload. To offload, shard: ZeRO-1 and up move the optimizer, ZeRO-3 the params too")

    # loading
    loading = left.pop("fsdp_cpu_ram_efficient_loading", None)
    init_flag = bool(o.cpu_ram_efficient_loading and stage == 3)
    if o.cpu_ram_efficient_loading and stage != 3:
        warn(f"fsdp_cpu_ram_efficient_loading = true: its DeepSpeed counterpart, zero3_init_flag, works only "
             f"under ZeRO-3, and this is ZeRO-{stage}. Written: false, so every rank loads the whole model. To "
             "load without that, use ZeRO-3")
    del loading
    sync = left.pop("fsdp_sync_module_states", None)
    if sync is not None and not o.sync_module_states:
        warn("fsdp_sync_module_states = false: DeepSpeed always broadcasts rank 0's weights when it starts, "
             "and has no setting to skip it. Nothing to do: the ranks start from the same weights either way")

    # checkpoint format
    sdt = left.pop("fsdp_state_dict_type", None)
    save16 = o.state_dict_type == "FULL_STATE_DICT"
    if save16 and sdt is not None:
        if stage < 3:
            warn(f"fsdp_state_dict_type = FULL_STATE_DICT under ZeRO-{stage}: DeepSpeed's one-file save, "
                 "zero3_save_16bit_model, is a ZeRO-3 setting. Written: false; ZeRO-0 to 2 keep the whole module "
                 "on every rank and save it in its own dtype (bf16). For one fp32 file, run "
                 "python -m helpers.convert CKPT OUT --to hf on the checkpoint")
            save16 = False
        elif job.mixed_precision == "bf16":
            warn("fsdp_state_dict_type = FULL_STATE_DICT: FSDP writes the whole model in fp32, DeepSpeed's "
                 "zero3_save_16bit_model in bf16. Written: zero3_save_16bit_model true. For fp32 weights, run "
                 "python -m helpers.convert CKPT OUT --to hf on the checkpoint")

    # prefetch hints
    fwd, bwd = left.pop("fsdp_forward_prefetch", None), left.pop("fsdp_backward_prefetch", None)
    if fwd is not None or bwd is not None:
        if o.backward_prefetch == "NO_PREFETCH" and not o.forward_prefetch and stage == 3:
            zo["stage3_prefetch_bucket_size"] = 0
            warn("fsdp_backward_prefetch = NO_PREFETCH: DeepSpeed cannot turn off backward prefetching alone. "
                 "Written: stage3_prefetch_bucket_size 0, which also stops forward prefetching. Losses do not "
                 "change; only when parameters are gathered does")
        else:
            what = ("prefetches a bucket of bytes ahead in forward and backward (stage3_prefetch_bucket_size)"
                    if stage == 3 else "has nothing to prefetch below ZeRO-3 (the params are whole)")
            warn(f"fsdp_forward_prefetch = {o.forward_prefetch}, fsdp_backward_prefetch = {o.backward_prefetch}: "
                 f"FSDP prefetches one module ahead; DeepSpeed {what}. Written: DeepSpeed's default. Losses do "
                 "not change; tune stage3_prefetch_bucket_size on a GPU if the all-gathers show in a trace")

    # wrapping and the rest
    policy = left.pop("fsdp_auto_wrap_policy", None)
    if policy is not None and o.auto_wrap_policy != "TRANSFORMER_BASED_WRAP":
        warn(f"fsdp_auto_wrap_policy = {o.auto_wrap_policy}: DeepSpeed has no wrap policy; ZeRO-3 gathers each "
             "module's params as it runs. Nothing written, nothing to do; the size of what ZeRO-3 gathers at once "
             "is set by stage3_prefetch_bucket_size")
    for k in ("fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params"):
        if k in left:
            warn(f"fsdp_config.{k} = {left.pop(k)!r}: DeepSpeed has no wrap policy, so this was left out. "
                 "Nothing to do")
    left.pop("fsdp_activation_checkpointing", None)
    left.pop("fsdp_activation_checkpointing_offload", None)
    ac = ({"cpu_checkpointing": True} if o.activation_checkpointing_offload else {}) \
        if o.activation_checkpointing else None
    if ac is not None:
        t.notes.append("fsdp_activation_checkpointing = true: written as the JSON's activation_checkpointing "
                       f"section{' (cpu_checkpointing: the offload)' if ac else ''}, which makes this guide's job "
                       "turn on the model's own checkpointing (helpers.job.recompute; same losses). Under accelerate "
                       "launch, your script calls model.activation_checkpointing_enable(): DeepSpeed does not")
    if "fsdp_use_orig_params" in left and not left.pop("fsdp_use_orig_params"):
        warn("fsdp_use_orig_params = false: FSDP1's flattened parameters; DeepSpeed (like FSDP2) always trains "
             "the original parameters. Nothing to do")
    left.pop("fsdp_use_orig_params", None)
    for k, v in left.items():
        warn(f"fsdp_config.{k} = {v!r}: the guide knows no DeepSpeed counterpart, so it was left out. Check "
             "DeepSpeed's documentation if you relied on it")

    # precision, accumulation, clipping
    if job.mixed_precision == "no":
        warn("mixed_precision = no: FSDP then trains in the dtype the model was loaded in (bf16 by default: "
             "bf16 params, gradients and Adam states); DeepSpeed with bf16 on always keeps an fp32 master. "
             "Written: bf16.enabled false (fp32 training). For the same run, train both with --model-dtype fp32")
    js = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",  # the job's --grad-accum, as with FSDP
        "gradient_clipping": "auto",  # the job's --grad-clip (FSDP default: off); missing would mean 1.0
        "bf16": {"enabled": job.mixed_precision == "bf16"},
        "zero_optimization": {**zo, **({"stage3_gather_16bit_weights_on_model_save": True} if save16 else {})},
        **({"activation_checkpointing": ac} if ac is not None else {}),
    }
    t.json = js
    t.yaml = {**_launch_keys(raw), "distributed_type": "DEEPSPEED",
              "deepspeed_config": {"zero3_init_flag": init_flag}}


def _gap(src, dst) -> str:
    """What differs between two modes, in sentences, from the mapping data: what one shards and the other
    keeps whole on every rank, then the modes' notes."""
    def name(m):
        return m.fsdp1 if m.backend == "fsdp" else m.zero

    parts = []
    for a, b in ((dst, src), (src, dst)):
        extra = [c.replace("_", " ") for c in CATEGORIES if c in a.sharded and c not in b.sharded]
        if extra:
            parts.append(f"{name(a)} shards the {' and '.join(extra)}, which {name(b)} keeps whole on every rank")
    return "; ".join(parts + [f"under {name(m)}, {m.note}" for m in (dst, src) if m.note])


def _ranks_per_node(raw: dict) -> int | None:
    n, m = raw.get("num_processes"), raw.get("num_machines") or 1
    return n // m if isinstance(n, int) and m > 1 and n % m == 0 else None


def _launch_keys(raw: dict) -> dict:
    return {k: raw[k] for k in _LAUNCH_KEYS if k in raw}


# --------------------------------------------------------------------------- DeepSpeed -> FSDP


def _deepspeed_to_fsdp(raw: dict, job: JobConfig, t: Translation) -> None:
    d = job.deepspeed
    warn = t.warnings.append
    sec = dict(raw.get("deepspeed_config") or {})
    js = {k: v for k, v in d.json.items()}  # the JSON, or the one built from inline keys
    zo = dict(js.pop("zero_optimization", {}) or {})
    for k in ("deepspeed_config_file", "zero_stage", "offload_optimizer_device", "offload_param_device",
              "gradient_accumulation_steps", "gradient_clipping", "zero3_save_16bit_model"):
        sec.pop(k, None)  # read again below through the JSON (inline keys were copied into it)

    # sharding
    key = mode_key(job)
    target, exact = counterpart(key)
    zo.pop("stage", None)
    hpz = zo.pop("zero_hpz_partition_size", None)
    fc: dict = {}
    if target.key == "no_shard":
        fc.update(fsdp_version=1, fsdp_sharding_strategy="NO_SHARD")  # FSDP2 has no NO_SHARD flag
    else:
        fc.update(fsdp_version=2, fsdp_reshard_after_forward=target.key != "shard_grad_op")
    par = None
    if not exact:
        warn(f"zero_optimization.stage {d.zero_stage}{f' + zero_hpz_partition_size {hpz}' if hpz else ''}: "
             f"FSDP has no exact counterpart. Written: the nearest, {target.fsdp1} ({target.fsdp2}). What "
             f"differs: {_gap(MODES[key], target)}. Nothing to do to train the same model; what each rank holds "
             "differs (notebook 01 measures it)")
    if target.key == "hybrid_shard":
        n = raw.get("num_processes")
        par = {"parallelism_config_dp_shard_size": hpz}
        if isinstance(n, int) and n % hpz == 0:
            par["parallelism_config_dp_replicate_size"] = n // hpz
    fc["fsdp_auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"

    # offload
    devs = {w: (zo.pop(f"offload_{w}", None) or {}) for w in ("param", "optimizer")}
    dev = {w: devs[w].get("device", "none") for w in devs}
    offload = any(v != "none" for v in dev.values())
    if offload and not (dev["param"] == dev["optimizer"] == "cpu"):
        what = ", ".join(f"offload_{w} {v}" for w, v in dev.items() if v != "none")
        warn(f"{what}: FSDP offloads params, gradients and optimizer states together, and to the host only "
             "(no NVMe, no param-only or optimizer-only offload). Written: fsdp_offload_params true, which moves "
             "all three to host memory")
    for w, sub in devs.items():
        extra = {k: v for k, v in sub.items() if k != "device"}
        if extra:
            warn(f"offload_{w} {extra}: FSDP's offload has no buffers, paths or such settings, so these were "
                 "left out. Nothing to do")
    fc["fsdp_offload_params"] = offload

    # checkpoint format and loading
    save16 = bool(zo.pop("stage3_gather_16bit_weights_on_model_save", False))
    if save16 and d.zero_stage < 3:
        warn(f"stage3_gather_16bit_weights_on_model_save under ZeRO-{d.zero_stage}: a ZeRO-3 setting, which "
             "does nothing here. Written: fsdp_state_dict_type FULL_STATE_DICT, FSDP's one-file save")
    elif save16 and job.mixed_precision == "bf16":
        warn("zero3_save_16bit_model: DeepSpeed writes the whole model in bf16, FSDP's FULL_STATE_DICT in fp32 "
             "(its shards are fp32 under bf16 mixed precision). Written: FULL_STATE_DICT; the file is twice "
             "the size")
    fc["fsdp_state_dict_type"] = "FULL_STATE_DICT" if save16 else "SHARDED_STATE_DICT"
    init = sec.pop("zero3_init_flag", None)
    if d.zero3_init_flag and d.zero_stage < 3:
        warn(f"zero3_init_flag = true under ZeRO-{d.zero_stage}: Accelerate ignores it below ZeRO-3, so it "
             "changed nothing. Written: fsdp_cpu_ram_efficient_loading false")
    fc["fsdp_cpu_ram_efficient_loading"] = bool(d.zero3_init_flag and d.zero_stage == 3)
    del init
    if fc["fsdp_cpu_ram_efficient_loading"]:
        fc["fsdp_sync_module_states"] = True  # Accelerate requires it with efficient loading

    # prefetch hints and the other ZeRO knobs
    bucket = zo.pop("stage3_prefetch_bucket_size", None)
    if bucket is not None:
        if bucket == 0:
            fc["fsdp_backward_prefetch"] = "NO_PREFETCH"
        warn(f"zero_optimization.stage3_prefetch_bucket_size = {bucket}: FSDP2 prefetches one module ahead, not "
             f"a number of bytes. Written: {'fsdp_backward_prefetch NO_PREFETCH' if bucket == 0 else 'its default'}."
             " Losses do not change; only when parameters are gathered does")
    mel = zo.pop("memory_efficient_linear", True)
    if d.zero_stage == 3 and mel is not False:
        warn(f"zero_optimization.memory_efficient_linear = {mel!r} (DeepSpeed's default): ZeRO-3 then replaces "
             "torch's F.linear with one that adds the bias in a second bf16 rounding, so models with biased layers "
             "(Qwen2, GPT-NeoX, ...) part from FSDP in the last bits from step 1. FSDP has no such switch; for "
             "identical runs set memory_efficient_linear to false on the DeepSpeed side")
    for k, v in zo.items():
        warn(f"zero_optimization.{k} = {v!r}: FSDP has no such setting, so it was left out. Nothing to do")

    # precision
    bf16 = (js.pop("bf16", None) or {}).get("enabled")
    js.pop("fp16", None)  # helpers.config refuses fp16 enabled
    if bf16 == "auto":
        warn("bf16.enabled = auto: the job decides at launch (on, unless --model-dtype fp32). Written: "
             "mixed_precision bf16, the same unless you train with --model-dtype fp32")
    if job.mixed_precision == "no":
        warn("bf16.enabled = false: DeepSpeed trains in fp32; FSDP's mixed_precision no trains in the dtype the "
             "model was loaded in (bf16 by default). Written: mixed_precision no. For the same run, pass "
             "--model-dtype fp32")
    dt = js.pop("data_types", None)
    comm = js.pop("communication_data_type", None)
    if dt or comm:
        warn(f"data_types {dt or {}} / communication_data_type {comm}: FSDP here reduces gradients in bf16 under "
             "bf16 mixed precision, and no fsdp_config key changes that. Nothing written; with other reduce "
             "dtypes the two backends round gradients differently")

    # activation checkpointing: the section turns it on (helpers.job.recompute); cpu_checkpointing is the offload
    ac = js.pop("activation_checkpointing", None)
    if isinstance(ac, dict):
        fc["fsdp_activation_checkpointing"] = True
        if ac.get("cpu_checkpointing") in (True, "true"):
            fc["fsdp_activation_checkpointing_offload"] = True
        for k, v in ac.items():
            if k != "cpu_checkpointing" and v not in (None, False, "false"):
                warn(f"activation_checkpointing.{k} = {v!r}: a setting of deepspeed.checkpointing, which the "
                     "model does not use (no effect in a DeepSpeed job here either); FSDP has no such setting, "
                     "so it was left out. Nothing to do")

    # batch, accumulation, clipping: script settings on the FSDP side
    for k, flag in (("train_micro_batch_size_per_gpu", "--micro-batch"), ("gradient_accumulation_steps",
                                                                         "--grad-accum")):
        v = js.pop(k, "auto")
        if v != "auto":
            warn(f"{k} = {v}: FSDP leaves this to the training script. What to do: pass {flag} {v} to the job")
    tbs = js.pop("train_batch_size", "auto")
    if tbs != "auto":
        warn(f"train_batch_size = {tbs}: FSDP leaves this to the training script; it is micro-batch x "
             "accumulation x ranks. What to do: pick --micro-batch and --grad-accum that multiply to it")
    clip = js.pop("gradient_clipping", None)
    if clip is None:
        warn("gradient_clipping is not set, so DeepSpeed clips at its default 1.0; FSDP clips only when the "
             "script does. What to do: pass --grad-clip 1.0 to the FSDP job for the same training")
    elif clip not in ("auto", 0, 0.0):
        warn(f"gradient_clipping = {clip}: FSDP leaves clipping to the training script. What to do: pass "
             f"--grad-clip {clip} to the job")

    # optimizer and scheduler from the JSON (DummyOptim pattern)
    for k in ("optimizer", "scheduler"):
        if k in js:
            v = js.pop(k)
            lr = v.get("params", {}).get("lr") if k == "optimizer" else None
            todo = f"pass --lr {lr}" if lr not in (None, "auto") else "pass --lr to set the learning rate"
            warn(f"{k} {v.get('type')} {v.get('params', {})}: with FSDP the training script builds the {k} (this "
                 f"guide's: AdamW at a constant --lr). What to do: {todo}")

    for k in sorted(js):
        if k in _DS_LOGGING:
            t.notes.append(f"{k}: changes only what DeepSpeed logs, not training; FSDP has no such setting, "
                           "nothing to do")
        else:
            warn(f"{k} = {js[k]!r}: the guide knows no FSDP counterpart, so it was left out. Check FSDP's "
                 "documentation if you relied on it")
    for k, v in sec.items():
        if k in _DS_LAUNCHER:
            t.notes.append(f"deepspeed_config.{k} = {v!r}: a setting of DeepSpeed's launcher; FSDP jobs start "
                           "with torchrun or accelerate launch, nothing to do")
        else:
            warn(f"deepspeed_config.{k} = {v!r}: FSDP has no such setting, so it was left out. Nothing to do "
                 "unless you relied on it")

    t.yaml = {**_launch_keys(raw), "distributed_type": "FSDP", "mixed_precision": job.mixed_precision,
              "fsdp_config": fc, **({"parallelism_config": par} if par else {})}


# --------------------------------------------------------------------------- entry points


def translate(path: str, to: str) -> Translation:
    """Translate one launch config; raises ConfigError (one line) on bad input."""
    if to not in ("deepspeed", "fsdp"):
        raise ConfigError(f"--to = {to!r}: allowed values are deepspeed, fsdp")
    job = load_job_config(path)
    if job.backend == to:
        raise ConfigError(f"{path}: already a {to} config (distributed_type "
                          f"{'FSDP' if to == 'fsdp' else 'DEEPSPEED'}); translate it --to "
                          f"{'deepspeed' if to == 'fsdp' else 'fsdp'}")
    raw = _read_yaml(path)
    t = Translation(path, to, {})
    (_fsdp_to_deepspeed if to == "deepspeed" else _deepspeed_to_fsdp)(raw, job, t)
    return t


def check(t: Translation, out: str | None = None) -> JobConfig:
    """Validate the translation with helpers.config (written to ``out``, or to a temporary directory)."""
    if out:
        t.write(out)
        return load_job_config(out)
    with tempfile.TemporaryDirectory() as tmp:
        p = t.write(os.path.join(tmp, Path(t.source).stem + f"_{t.to}.yaml"))[0]
        return load_job_config(str(p))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m helpers.translate", description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--to", required=True, choices=["deepspeed", "fsdp"])
    ap.add_argument("-o", "--out", help="write OUT.yaml (+ OUT.json for DeepSpeed); default: print them")
    args = ap.parse_args(argv)
    try:
        t = translate(args.config, args.to)
        if args.out and Path(args.out).suffix not in (".yaml", ".yml"):
            raise ConfigError(f"-o {args.out}: expected a .yaml or .yml file name")
        check(t, args.out)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for w in t.warnings:
        print(f"warning: {w}", file=sys.stderr)
    for n in t.notes:
        print(f"note: {n}", file=sys.stderr)
    if args.out:
        print(f"wrote {args.out}" + (f" and {Path(args.out).with_suffix('.json')}" if t.json else "")
              + (" (exact)" if t.exact else f" ({len(t.warnings)} warning{'s' if len(t.warnings) != 1 else ''})"))
    else:
        name = Path(args.config).stem + f"_{args.to}"
        data = dict(t.yaml)
        if t.json is not None:
            data["deepspeed_config"] = {"deepspeed_config_file": f"{name}.json", **data["deepspeed_config"]}
        sys.stdout.write(t.header() + yaml.safe_dump(data, sort_keys=False))
        if t.json is not None:
            sys.stdout.write(f"# ---- {name}.json\n" + json.dumps(t.json, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
