"""DeepSpeed ZeRO behind the guide's engine interface.

``apply_deepspeed(model, job, device)`` fills the DeepSpeed config's
``"auto"`` values from the job, calls ``deepspeed.initialize`` with a torch
AdamW (the optimizer an Accelerate script would pass), and returns an engine
with ``train_step(batches) -> loss`` (this rank's), ``step_sums()`` and
``grad_norm(sums)`` - the same shape as ``helpers.job.backends.fsdp.apply_fsdp``
(DeepSpeed reduces the gradient norm itself: it adds nothing to the sums).

With ``bf16.enabled`` DeepSpeed keeps the module in bf16 and builds fp32
master partitions for the optimizer (``_create_fp32_partitions``), whatever
dtype the model was loaded in.

An ``activation_checkpointing`` object in the JSON turns on the model's own
(transformers) checkpointing before ``deepspeed.initialize`` (helpers.job.recompute).
"""

from __future__ import annotations

import copy
import json
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from helpers import set_ds_accelerator
from helpers.core.cli import first_line
from helpers.core.config import JobConfig, adamw_kwargs
from helpers.core.internals import MUON_MODULE, import_without_compile
from helpers.job import recompute
from helpers.job.backends.fsdp import trainable


def resolved_ds_config(job: JobConfig, world_size: int, hidden_size: int | None = None,
                       device_type: str = "cpu") -> tuple[dict, list[str]]:
    """The DeepSpeed config dict with every "auto" filled; also the list of what was filled.

    Filled as Accelerate fills its templates, from the job's settings: batch sizes, accumulation,
    clipping (``--grad-clip``; DeepSpeed's own default is 1.0 when the key is missing), ``bf16.enabled``
    (on unless ``--model-dtype fp32``), the ZeRO bucket sizes from the model's ``hidden_size``, and an
    ``optimizer``/``scheduler`` defined in the JSON (Accelerate's DummyOptim/DummyScheduler pattern:
    DeepSpeed builds them; lr and weight decay come from the job). On CPU an Adam/AdamW there gets
    ``torch_adam: true`` unless the JSON says otherwise (DeepSpeed's fused Adam is a C++ op build).
    """
    js = copy.deepcopy(job.deepspeed.json)
    t = job.train
    filled: list[str] = []

    def fill(where: dict, key: str, value, name: str | None = None, only_auto: bool = True):
        if (key in where and where[key] == "auto") or (not only_auto and key not in where):
            where[key] = value
            filled.append(f"{name or key}={value}")

    fill(js, "train_micro_batch_size_per_gpu", t.micro_batch, only_auto=False)
    fill(js, "gradient_accumulation_steps", t.grad_accum, only_auto=False)
    fill(js, "train_batch_size", t.micro_batch * t.grad_accum * world_size, only_auto=False)
    fill(js, "gradient_clipping", t.grad_clip)  # missing: DeepSpeed's default 1.0 (see config)
    want = t.micro_batch * t.grad_accum * world_size
    if js["train_batch_size"] != want:
        raise ValueError(
            f"train_batch_size = {js['train_batch_size']} in the DeepSpeed config, but micro-batch "
            f"{t.micro_batch} x accumulation {t.grad_accum} x {world_size} ranks = {want}"
        )
    if isinstance(js.get("bf16"), dict):
        fill(js["bf16"], "enabled", job.mixed_precision == "bf16", "bf16.enabled")
    zo = js.get("zero_optimization")
    if isinstance(zo, dict) and hidden_size:
        h = hidden_size
        for key, value in (("reduce_bucket_size", h * h), ("stage3_prefetch_bucket_size", int(0.9 * h * h)),
                           ("stage3_param_persistence_threshold", 10 * h)):
            fill(zo, key, value, f"zero_optimization.{key}")
    opt = js.get("optimizer")
    if isinstance(opt, dict):
        params = opt.setdefault("params", {})
        for key, value in (("lr", t.lr), ("weight_decay", t.weight_decay), ("betas", [0.9, 0.999]),
                           ("eps", 1e-8)):
            fill(params, key, value, f"optimizer.params.{key}")
        if device_type == "cpu" and str(opt.get("type", "")).lower() in ("adam", "adamw"):
            fill(params, "torch_adam", True, "optimizer.params.torch_adam", only_auto=False)
    sched = js.get("scheduler")
    if isinstance(sched, dict):
        params = sched.setdefault("params", {})
        lr = (opt or {}).get("params", {}).get("lr", t.lr) if isinstance(opt, dict) else t.lr
        for key, value in (("warmup_min_lr", 0), ("warmup_max_lr", lr),
                           ("warmup_num_steps", max(1, t.steps // 10)), ("total_num_steps", t.steps)):
            fill(params, key, value, f"scheduler.params.{key}")
    left = _autos(js)
    if left:
        raise ValueError(f"{', '.join(left)} = \"auto\": this guide has nothing to fill it from; write a value")
    js.setdefault("zero_allow_untested_optimizer", True)  # a torch optimizer, as Accelerate passes
    offloaded = js.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    if "optimizer" not in js and offloaded in ("cpu", "nvme"):
        js.setdefault("zero_force_ds_cpu_optimizer", False)  # that torch AdamW steps on the host; no cpu_adam build
    js.setdefault("steps_per_print", 10**12)
    js.setdefault("wall_clock_breakdown", False)
    return js, filled


_SECTION = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedBF16Config": "bf16", "DeepSpeedFP16Config": "fp16",
            "DeepSpeedActivationCheckpointingConfig": "activation_checkpointing"}


def check_with_deepspeed(js: dict, device_type: str = "cpu") -> None:
    """DeepSpeed's own parser on the resolved config, before any process group: what ``deepspeed.initialize``
    would refuse deep inside DeepSpeed is refused here, in one line (ValueError) naming the key, the value and
    DeepSpeed's rule. (Its batch-size check is the job's own, above: here it parses at the world size DeepSpeed
    sees, 1 before any process group.)"""
    import pydantic

    set_ds_accelerator()  # before DeepSpeed's first import, as the job's start does
    from deepspeed import comm as ds_comm
    from deepspeed.runtime.config import DeepSpeedConfig

    try:  # DeepSpeedConfig reads the world size of a live group (a sweep's second job), else takes 1
        ws = ds_comm.get_world_size()
    except (RuntimeError, AssertionError, AttributeError):
        ws = 1
    one = copy.deepcopy(js)
    one["train_batch_size"] = one["train_micro_batch_size_per_gpu"] * one["gradient_accumulation_steps"] * ws
    try:
        DeepSpeedConfig(one)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        where = ".".join([_SECTION.get(e.title, e.title), *map(str, err["loc"])])
        msg = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:  # a rule across keys: the section's own check
            raise ValueError(f"DeepSpeed refuses {where}: {msg}") from None
        raise ValueError(f"DeepSpeed refuses {where} = {err.get('input')!r}: {msg}") from None
    except (AssertionError, ValueError, KeyError, TypeError) as e:
        why = first_line(e)
        raise ValueError(f"DeepSpeed refuses this config: {why}") from None
    _check_scheduler(js.get("scheduler"))
    for path, bad, why, where in _CANNOT_RUN:
        value = _get(js, path)
        if value is not None and bad(value) and device_type in where:
            raise ValueError(f"{path} = {json.dumps(value)}: {why}")


def _check_scheduler(sched) -> None:
    """A ``scheduler`` section against the class DeepSpeed builds from it (DeepSpeed's own TypeError otherwise)."""
    import inspect

    from deepspeed.runtime import lr_schedules

    if not isinstance(sched, dict):
        return
    kind, params = sched.get("type"), sched.get("params") or {}
    if kind not in lr_schedules.VALID_LR_SCHEDULES:
        raise ValueError(f"scheduler.type = {kind!r}: allowed {', '.join(lr_schedules.VALID_LR_SCHEDULES)}")
    args = inspect.signature(getattr(lr_schedules, kind).__init__).parameters
    missing = [n for n, a in args.items() if n not in ("self", "optimizer") and a.default is a.empty
               and n not in params]
    if missing:
        raise ValueError(f"scheduler {kind} needs params.{missing[0]} (a number, or \"auto\" for the job to fill "
                         "it where it can: total_num_steps, warmup_num_steps, warmup_min_lr, warmup_max_lr)")
    unknown = [k for k in params if k not in args]
    if unknown:
        raise ValueError(f"scheduler.params.{unknown[0]}: {kind} takes "
                         f"{', '.join(n for n in args if n not in ('self', 'optimizer'))}")


def _get(d: dict, path: str):
    for k in path.split("."):
        d = d.get(k) if isinstance(d, dict) else None
    return d


# Values DeepSpeed's parser accepts and its engine then cannot run (found by tests/test_config_sweep.py):
# (dotted key, the bad values, why, on which devices).
_ANY, _CPU = ("cpu", "cuda"), ("cpu",)
_CANNOT_RUN = [
    ("zero_optimization.legacy_stage1", lambda v: v is True,
     "DeepSpeed 0.19 parses it but stops at initialize (the old ZeRO-1 was removed in 0.5.9); leave it out", _ANY),
    ("zero_optimization.offload_optimizer.ratio", lambda v: v < 1,
     "a partial optimizer offload needs DeepSpeed's CPU Adam (DeepSpeedCPUAdam), which DeepSpeed asserts at "
     "initialize; the guide steps a torch AdamW, so it offloads all of it (ratio 1) or none", _ANY),
    ("zero_optimization.offload_optimizer.super_offload", lambda v: v is True,
     "SuperOffload runs on NVIDIA CUDA GPUs only (DeepSpeed asserts it at initialize); this job runs on the CPU",
     _CPU),
    ("zero_optimization.zenflow", lambda v: bool(v),
     "ZenFlow's optimizer runs on CUDA (DeepSpeed calls CUDA at initialize); this job runs on the CPU", _CPU),
    *((f"zero_optimization.zero_quantized_{what}", lambda v: v is True,
       "DeepSpeed's quantizer is a CUDA op (\"not implemented on CPU backend\" at the first step); this job "
       "runs on the CPU", _CPU) for what in ("gradients", "nontrainable_weights", "weights")),
]


def _autos(d, prefix: str = "") -> list[str]:
    """Dotted paths of the values still "auto"."""
    out = []
    for k, v in d.items():
        if v == "auto":
            out.append(prefix + k)
        elif isinstance(v, dict):
            out += _autos(v, f"{prefix}{k}.")
    return out


def apply_deepspeed(model: torch.nn.Module, job: JobConfig, device: torch.device) -> DeepSpeedEngine:
    """DeepSpeed engine; the optimizer is a torch AdamW, or the one the JSON defines (DummyOptim pattern)."""
    import deepspeed

    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    ds_config, _ = resolved_ds_config(job, dist.get_world_size(), hidden, device.type)
    model.to(device)
    checkpointing = recompute.apply(model, job, device)  # the JSON's activation_checkpointing section
    _import_muon_eagerly(ds_config)
    if "optimizer" in ds_config:  # DeepSpeed builds optimizer (and scheduler) from the JSON
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=trainable(model),
                                                       config=ds_config)
    else:
        optimizer = torch.optim.AdamW(trainable(model), **adamw_kwargs(job.train))  # --optimizer-impl
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    if job.train.compile:
        engine.compile()  # torch.compile of the wrapped module (ZeRO-3's gathers stay out of dynamo; its other
        # per-module hooks are traced, and recompile: notebook 14)
    out = DeepSpeedEngine(engine, optimizer)
    out.activation_checkpointing = checkpointing
    return out


MUON = MUON_MODULE


def _import_muon_eagerly(ds_config: dict) -> None:
    """Import DeepSpeed's Muon module with its functions left uncompiled, unless the JSON asks for Muon.

    ZeRO's optimizer check (and ZeRO-3's constructor) import that module to ask whether the optimizer
    is a Muon; at import it wraps its update functions in ``torch.compile``, which loads
    ``torch._inductor``'s compiler: about 1 s of every DeepSpeed job's start-up, for an optimizer the
    job does not run. Imported once here through DeepSpeed's own fallback for a torch without
    ``torch.compile`` (``compiler.dummy_decorator``), the module and its class are the real ones, and
    the later imports find it loaded.
    """
    if MUON in sys.modules or str(ds_config.get("optimizer", {}).get("type", "")).lower() == "muon":
        return
    import_without_compile(MUON)


class DeepSpeedEngine:
    """One optimizer step over a list of micro-batches, DeepSpeed style."""

    backend = "deepspeed"
    activation_checkpointing: str | None = None  # what recomputes activations (helpers.job.recompute), or None

    def __init__(self, engine, optimizer):
        self.engine, self.optimizer = engine, optimizer

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def current_lr(self) -> float:
        """The learning rate the next step uses (a JSON scheduler moves it)."""
        return float(self.engine.get_lr()[0])

    def train_step(self, batches: list[torch.Tensor], probe=None) -> torch.Tensor:
        """Forward/backward every micro-batch, then one optimizer step; this rank's mean loss (not reduced).
        ``probe``: see helpers.job.observe.memory."""
        total = torch.zeros((), dtype=torch.float32, device=batches[0].device)
        for i, ids in enumerate(batches):
            with probe.forward(i) if probe else nullcontext(), record_function("guide::forward"):
                loss = self.engine(input_ids=ids, labels=ids).loss
            with record_function("guide::backward"):
                self.engine.backward(loss)  # scales by 1/gradient_accumulation_steps
            if probe and i == len(batches) - 1:
                probe.after_backward(self)  # gradients reduced, optimizer not yet stepped
            with record_function("guide::optimizer_step"):
                self.engine.step()  # steps the optimizer on the last micro-batch only
            total += loss.detach().float()
        return total / len(batches)

    def step_sums(self) -> dict:
        return {}  # DeepSpeed's step already reduced the gradient norm

    def grad_norm(self, sums: dict[str, float]) -> float:
        norm = self.engine.get_global_grad_norm()
        return float(norm if norm is not None else float("nan"))
