"""The rules that translate an Accelerate FSDP config into the DeepSpeed one that trains the same way.

Sharding goes through ``helpers.core.mapping``'s mode table; offload, loading, checkpoint format, prefetch,
wrapping, checkpointing, precision, accumulation and clipping each have a rule below. Every key of the
``fsdp_config`` section is popped by the rule that reads it; one left over is reported, never dropped.
Driven by ``helpers.translate``.
"""

from __future__ import annotations

from helpers.core.compat import normalize_fsdp_config
from helpers.core.config import JobConfig
from helpers.core.mapping import MODES, counterpart, mode_key
from helpers.core.translation import Translation, _gap, _launch_keys

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


def _ranks_per_node(raw: dict) -> int | None:
    n, m = raw.get("num_processes"), raw.get("num_machines") or 1
    return n // m if isinstance(n, int) and m > 1 and n % m == 0 else None
