"""The rules that translate a DeepSpeed launch config (and its JSON) into the FSDP one that trains the same way.

Sharding goes through ``helpers.core.mapping``'s mode table; offload, checkpoint format, loading,
prefetch and the other ZeRO knobs, precision, checkpointing, batch, accumulation, clipping and the JSON's
optimizer each have a rule below. Every key of the JSON and of the ``deepspeed_config`` section is popped
by the rule that reads it; one left over is reported, never dropped. Driven by ``helpers.translate``.
"""

from __future__ import annotations

from helpers.core.config import JobConfig
from helpers.core.mapping import MODES, counterpart, mode_key
from helpers.core.translation import Translation, _gap, _launch_keys

# DeepSpeed JSON keys that change logging only, not training.
_DS_LOGGING = {"steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer", "comms_logger",
               "flops_profiler", "tensorboard", "wandb", "csv_monitor", "memory_breakdown", "dump_state"}
_DS_LAUNCHER = {"deepspeed_multinode_launcher", "deepspeed_hostfile", "deepspeed_inclusion_filter",
                "deepspeed_exclusion_filter"}


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
