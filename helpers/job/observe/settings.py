"""The settings a job ran with: ``summary.json``'s ``effective`` and ``attn_implementation`` keys.
``python -m helpers.switch`` puts two runs' side by side.

Where the running model, engine or optimizer says it, it is read from them: the attention implementation
transformers settled on, the optimizer's own hyperparameters, the units FSDP made, and DeepSpeed's clipping,
accumulation, micro-batch and prefetch after its defaults and "auto" had their say. The rest comes from the job's
resolved config (the one in ``config.json``, after Accelerate's rules, not the YAML as written), and two rows
follow from the code path the job took: the norm's dtype (the guide's FSDP engine computes it in fp64; DeepSpeed's
own code, fact deepspeed.zero12_grad_norm_fp32) and whether a unit's inputs are cast.
"""

from __future__ import annotations

from helpers.job.observe.base import Observer


def _optimizer(engine) -> dict:
    from helpers.core.internals import torch_optimizer

    inner = torch_optimizer(engine.optimizer if engine.backend == "fsdp" else engine.engine.optimizer)
    g = inner.param_groups[0]
    return {"optimizer": type(inner).__name__, "lr": g.get("lr"), "betas": list(g.get("betas") or []) or None,
            "eps": g.get("eps"), "weight_decay": g.get("weight_decay")}


def _fsdp(s) -> dict:
    from helpers.core.internals import fsdp_unit_count

    f = s.job.fsdp
    return {"units": f"{fsdp_unit_count(s.engine.module)} FSDP units ({f.auto_wrap_policy})",
            "reshard_after_forward": f.reshard_after_forward, "prefetch": f"forward_prefetch {f.forward_prefetch}, "
            f"backward_prefetch {f.backward_prefetch}", "max_norm": s.engine.grad_clip or None,
            "norm_dtype": "fp64", "grad_accum": s.job.train.grad_accum, "micro_batch": s.job.train.micro_batch,
            "checkpoint_format": f.state_dict_type, "offload": "params+grads+optimizer (host)"
            if f.offload_params else "none"}


def _deepspeed(s) -> dict:
    from deepspeed.runtime.zero.utils import get_norm_dtype

    from helpers.core.dtypes import short

    e = s.engine.engine
    stage = e.zero_optimization_stage()
    zo = s.resolved["deepspeed"]["json"].get("zero_optimization", {})
    out = {"units": "every module (ZeRO-3's hooks gather each module's parameters)" if stage == 3
           else f"none (ZeRO-{stage}: parameters whole on every rank)",
           "reshard_after_forward": stage == 3,
           "prefetch": f"prefetch_bucket_size {e.zero_prefetch_bucket_size()}, overlap_comm {e.zero_overlap_comm()}"
           if stage == 3 else f"overlap_comm {e.zero_overlap_comm()}",
           "max_norm": e.gradient_clipping() or None,
           # ZeRO-1/2 sum the squares of fp64 norms in fp32 (fact deepspeed.zero12_grad_norm_fp32); ZeRO-3 keeps fp64
           "norm_dtype": short(get_norm_dtype()) if stage == 3 else "fp32" if stage in (1, 2) else "not read (ZeRO-0)",
           "grad_accum": e.gradient_accumulation_steps(), "micro_batch": e.train_micro_batch_size_per_gpu(),
           "checkpoint_format": "DeepSpeed ZeRO partitions"
           + (" + 16-bit model" if s.job.deepspeed.zero3_save_16bit_model else ""),
           "offload": ", ".join(f"{k.split('_')[1]} -> {zo[k].get('device')}" for k in ("offload_param",
                                "offload_optimizer") if zo.get(k, {}).get("device") not in (None, "none")) or "none"}
    if stage == 3:
        out["memory_efficient_linear"] = zo.get("memory_efficient_linear", True)
    return out


class Settings(Observer):
    """``attn_implementation`` (logged once the model is built) and ``effective`` (once the engine is ready)."""

    def __init__(self):
        self.keys: dict = {}

    def on_model_built(self, s):
        from helpers.core.internals import attn_implementation

        impl = attn_implementation(s.model)
        self.keys["attn_implementation"] = impl
        s.run.log(f"attention: {impl} (the config's choice, else sdpa where the model supports it, else eager)",
                  echo=False)

    def on_train_begin(self, s):
        eff = {"attn_implementation": self.keys["attn_implementation"], **_optimizer(s.engine),
               **(_fsdp(s) if s.engine.backend == "fsdp" else _deepspeed(s))}
        # FSDP2's MixedPrecisionPolicy (cast_forward_inputs=True, Accelerate keeps it) casts every unit's
        # floating-point inputs to param_dtype; DeepSpeed casts none (fact torch.fsdp2_casts_unit_inputs)
        eff["unit_inputs_cast_to"] = "bf16" if s.engine.backend == "fsdp" and s.job.mixed_precision == "bf16" else None
        self.keys["effective"] = eff

    def summary(self, s):
        return self.keys
