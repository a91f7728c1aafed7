"""Accelerate-format launch configs -> one validated, typed JobConfig.

The YAML files in ``launch_configs/`` use Accelerate's own keys, so a learner
can take them unchanged to ``accelerate launch --config_file``. This module
reads them, checks every key and value, and refuses bad input *before* any
rank starts, with one line naming the file, the key, the value and what is
allowed.

Check a file without launching anything::

    python -m helpers.config launch_configs/fsdp/full_shard.yaml --world-size 2

Exit status 0 and a summary when the file is good, 2 and one ``error:`` line
when it is not.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import importlib.util
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from helpers.core.compat import normalize_fsdp_config

Backend = Literal["fsdp", "deepspeed"]
Precision = Literal["no", "bf16"]
ModelDtype = Literal["auto", "bf16", "fp32"]
OptimizerImpl = Literal["for-loop", "foreach", "fused"]
Sharding = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]


class ConfigError(ValueError):
    """Bad launch config or override; ``str(err)`` is the one line to show."""


# --------------------------------------------------------------------------- settings


@dataclass
class TrainOptions:
    """Job settings that Accelerate leaves to the training script (CLI flags)."""

    model: str = "tiny"  # preset name, config.json path or pretrained directory
    steps: int = 20  # optimizer steps
    lr: float = 3e-3  # AdamW learning rate (constant)
    seed: int = 0  # model init and data
    micro_batch: int = 8  # sequences per rank per forward
    seq_len: int = 64  # tokens per sequence
    grad_accum: int = 1  # micro-batches per optimizer step
    grad_clip: float = 0.0  # max global grad norm; 0 = no clipping
    weight_decay: float = 0.0  # AdamW weight decay
    timeout: float = 600.0  # seconds without a finished step (start-up included) before the job is stopped
    # The dtype the script loads the model in; Accelerate's YAML has no key for it.
    # "auto" (resolved at load time, see resolve_model_dtype): bf16, as in the seeds'
    # `from_pretrained(..., dtype=bfloat16)`; fp32 for DeepSpeed with bf16 disabled.
    model_dtype: ModelDtype = "auto"
    compile: bool = False  # torch.compile each transformer block (FSDP2) / the engine (DeepSpeed)
    # How torch's AdamW steps, on both backends: "for-loop" (foreach=False) is the parity mode (FSDP and
    # ZeRO give the same bits); "foreach"/"fused" launch fewer kernels, for fair throughput runs on a GPU.
    optimizer_impl: OptimizerImpl = "for-loop"


@dataclass
class FSDPOptions:
    """``fsdp_config`` keys, mapped onto FSDP2 (``fully_shard``)."""

    sharding: Sharding = "FULL_SHARD"  # what each rank keeps a shard of (see helpers.core.mapping)
    reshard_after_forward: bool = True  # free gathered params after forward (FULL_SHARD)
    hybrid_shard_size: int | None = None  # ranks per shard group under HYBRID_*; None = ranks per node
    offload_params: bool = False  # params, grads and optimizer states on the host
    state_dict_type: Literal["FULL_STATE_DICT", "SHARDED_STATE_DICT"] = "SHARDED_STATE_DICT"
    cpu_ram_efficient_loading: bool = False  # meta init + rank-0 load + broadcast
    sync_module_states: bool = True
    auto_wrap_policy: Literal["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"] = (
        "TRANSFORMER_BASED_WRAP"
    )
    transformer_layer_cls_to_wrap: str | None = None  # None = found from the model
    min_num_params: int = 100_000_000  # SIZE_BASED_WRAP threshold
    forward_prefetch: bool = False
    backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"] = "BACKWARD_PRE"
    activation_checkpointing: bool = False  # checkpoint_wrapper per decoder block (helpers.job.recompute)
    activation_checkpointing_offload: bool = False  # its held inputs in pinned host memory (GPU)
    use_orig_params: bool = True  # FSDP1 only; FSDP2 always trains the original params


@dataclass
class DeepSpeedOptions:
    """``deepspeed_config`` keys plus the DeepSpeed JSON they resolve to."""

    zero_stage: Literal[0, 1, 2, 3] = 2  # Accelerate's default
    offload_optimizer_device: Literal["none", "cpu", "nvme"] = "none"
    offload_param_device: Literal["none", "cpu", "nvme"] = "none"
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool = False  # partition params as they are created
    zero3_save_16bit_model: bool = False  # consolidated 16-bit weights on save
    config_file: str | None = None  # deepspeed_config_file, resolved path
    json: dict = field(default_factory=dict)  # the DeepSpeed config ("auto" filled at launch)
    swap_links: dict = field(default_factory=dict)  # relative nvme_path -> its node-local home (job.observe.offload)


@dataclass
class JobConfig:
    """Everything a job needs, resolved from YAML + CLI overrides."""

    source: str
    backend: Backend
    mixed_precision: Precision
    train: TrainOptions
    fsdp: FSDPOptions | None = None
    deepspeed: DeepSpeedOptions | None = None
    notes: list[str] = field(default_factory=list)  # translation notes, shown in log.txt
    # Accelerate keys in the file that have no effect here: "section.key" -> (value, why); see unapplied_notes
    unapplied: dict[str, tuple[Any, str]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- key tables

# Which keys exist is Accelerate's to say (``accelerate_keys``: ClusterConfig's fields at the top level,
# ``accelerate launch``'s argument groups for each section). The tables below only say what this guide
# does with the keys it applies (the rule its value must follow), and why the others have no effect here.
_SHARDING = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
_FSDP_KEYS = {
    "fsdp_version": [1, 2],
    "fsdp_sharding_strategy": _SHARDING,
    "fsdp_reshard_after_forward": None,  # bool (v2) or a strategy name (v1)
    "fsdp_offload_params": bool,
    "fsdp_state_dict_type": ["FULL_STATE_DICT", "SHARDED_STATE_DICT"],
    "fsdp_cpu_ram_efficient_loading": bool,
    "fsdp_auto_wrap_policy": ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"],
    "fsdp_transformer_layer_cls_to_wrap": str,
    "fsdp_min_num_params": int,
    "fsdp_forward_prefetch": bool,
    "fsdp_backward_prefetch": ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"],
    "fsdp_activation_checkpointing": bool,
    "fsdp_activation_checkpointing_offload": bool,
    # checked and kept (helpers.translate reads them), but no effect on an FSDP2 job here: see _NO_EFFECT_KEY
    "fsdp_sync_module_states": bool,
    "fsdp_use_orig_params": bool,
}
_DS_KEYS = {
    "zero_stage": [0, 1, 2, 3],
    "offload_optimizer_device": ["none", "cpu", "nvme"],
    "offload_param_device": ["none", "cpu", "nvme"],
    "offload_optimizer_nvme_path": str,
    "offload_param_nvme_path": str,
    "zero3_init_flag": bool,
    "zero3_save_16bit_model": bool,
    "gradient_accumulation_steps": int,
    "gradient_clipping": float,
    "deepspeed_config_file": str,
    # checked, no effect here (see _NO_EFFECT_KEY)
    "deepspeed_multinode_launcher": ["standard", "pdsh", "openmpi", "mvapich", "mpich", "nossh", "slurm"],
    "deepspeed_hostfile": str,
    "deepspeed_inclusion_filter": str,
    "deepspeed_exclusion_filter": str,
    "deepspeed_moe_layer_cls_names": str,
}
# Accelerate refuses these next to deepspeed_config_file: the JSON must say them.
_DS_FILE_EXCLUSIVE = [
    "gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
    "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path",
    "zero3_save_16bit_model",
]
_PAR_KEYS = {
    "parallelism_config_dp_replicate_size": int,
    "parallelism_config_dp_shard_size": int,
    "parallelism_config_tp_size": int,  # must be 1: data parallelism only
    "parallelism_config_cp_size": int,  # must be 1
    "parallelism_config_sp_size": int,  # must be 1
}
_TOP_READ = {"distributed_type", "mixed_precision", "fsdp_config", "deepspeed_config", "parallelism_config"}

# Why a key Accelerate accepts has no effect here; the job logs one `note:` line per such key that asks for
# something (a value other than false / "no" / empty). By key, then by section, then by prefix.
LAUNCHER_ONLY = "read by accelerate launch to start the processes; here torchrun (or helpers.launch) starts them"
_TPU = "a TPU setting; this guide runs on CPUs (gloo) and CUDA GPUs (nccl)"
_NO_EFFECT_KEY = {
    **dict.fromkeys(["compute_environment", "num_processes", "num_machines", "machine_rank", "main_process_ip",
                     "main_process_port", "rdzv_backend", "same_network", "gpu_ids", "main_training_function",
                     "enable_cpu_affinity"], LAUNCHER_ONLY),
    **dict.fromkeys(["tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "tpu_vm", "tpu_env", "command_file",
                     "commands", "downcast_bf16"], _TPU),
    "debug": "accelerate launch's collective checks (ACCELERATE_DEBUG_MODE); this guide does not run them",
    "use_cpu": "the device follows the machine here: one GPU per rank when CUDA is present, else the CPU",
    "fsdp_use_orig_params": "an FSDP1 setting; FSDP2 (fully_shard) always trains the original parameters",
    "fsdp_sync_module_states": "every rank here starts from the same weights (same seed or file), and "
                               "fsdp_cpu_ram_efficient_loading always broadcasts rank 0's",
    "deepspeed_moe_layer_cls_names": "for mixture-of-experts models; the guide's models have no expert layers",
    **dict.fromkeys(["deepspeed_multinode_launcher", "deepspeed_hostfile", "deepspeed_inclusion_filter",
                     "deepspeed_exclusion_filter"], "a DeepSpeed launcher setting; here torchrun (or helpers.launch) "
                                                    "starts every rank"),
    "parallelism_config_cp_backend": "context parallelism; this guide runs data parallelism only (cp_size 1)",
    "parallelism_config_cp_comm_strategy": "context parallelism; this guide runs data parallelism only (cp_size 1)",
}
# The DeepSpeed JSON's activation_checkpointing section: its presence turns on the model's checkpointing
# (helpers.job.recompute). Sub-key -> (rule, DeepSpeed's default, why it has no effect here; None: applied).
_DSC = "DeepSpeed reads it only inside deepspeed.checkpointing.checkpoint, and the model checkpoints with torch's "
_DS_AC_KEYS = {
    "partition_activations": (bool, False, "splits each held activation across model-parallel ranks (Megatron's "
                                           "mpu); this guide runs data parallelism only, and " + _DSC + "checkpoint"),
    "cpu_checkpointing": (bool, False, None),  # the model's offload=True, on a GPU (helpers.job.recompute)
    "contiguous_memory_optimization": (bool, False, "copies partitioned activations into one buffer; "
                                       + _DSC + "checkpoint, which keeps no such buffer"),
    "number_checkpoints": (int, None, "sizes contiguous_memory_optimization's buffer; " + _DSC + "checkpoint"),
    "synchronize_checkpoint_boundary": (bool, False, "a device synchronize at each checkpoint boundary; " + _DSC
                                        + "checkpoint"),
    "profile": (bool, False, "times each checkpointed forward and backward; " + _DSC + "checkpoint (--profile "
                "traces the whole job)"),
}
_NO_EFFECT_SECTION = {
    "fp8_config": "FP8 training (TransformerEngine / torchao / MS-AMP on recent GPUs); this guide trains in bf16 "
                  "or fp32",
    "megatron_lm_config": "another backend (distributed_type MEGATRON_LM); this guide runs FSDP2 and DeepSpeed",
    "mpirun_config": "mpirun starts multi-CPU jobs for accelerate launch; here torchrun starts the ranks",
    "dynamo_config": "Accelerate's torch.compile plugin; here --compile compiles each block (FSDP2) or calls "
                     "engine.compile() (DeepSpeed)",
}
_NO_EFFECT_PREFIX = {
    "parallelism_config_sp_": "sequence parallelism; this guide runs data parallelism only (sp_size 1)",
}
# Each section of the YAML: the argument group of `accelerate launch` whose dests it holds, and the prefix
# accelerate launch adds to a key that lacks it (fsdp_config's is handled by helpers.core.compat, with a warning).
_SECTIONS = {
    "fsdp_config": ("FSDP Arguments", ""),
    "deepspeed_config": ("DeepSpeed Arguments", ""),
    "parallelism_config": ("ParallelismConfig Arguments", ""),
    "fp8_config": ("FP8 Arguments", "fp8_"),
    "megatron_lm_config": ("Megatron-LM Arguments", ""),
    "mpirun_config": ("MPI Arguments", ""),
    "dynamo_config": (None, "dynamo_"),  # dynamo_* options of any group
}


@functools.cache
def accelerate_keys() -> dict[str, frozenset[str]]:
    """The keys Accelerate accepts, read from its own source: ``""`` -> top-level keys, else section -> keys.

    Top level: the fields of ``accelerate.commands.config.config_args.ClusterConfig`` (and its base);
    each section: the ``--options`` of ``accelerate launch``'s argument group, which is what accelerate
    launch copies a section's keys onto. Read with ``ast`` rather than imported: importing accelerate
    imports torch, seconds that a config check need not wait. tests/test_config.py checks this reading
    against the imported dataclass and parser.
    """
    spec = importlib.util.find_spec("accelerate")  # locates the package without running it
    root = Path(spec.origin).parent
    classes = {n.name: n for n in ast.walk(ast.parse((root / "commands/config/config_args.py").read_text()))
               if isinstance(n, ast.ClassDef)}
    top: set[str] = set()
    todo = ["ClusterConfig"]
    while todo:
        cls = classes[todo.pop()]
        top |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        todo += [b.id for b in cls.bases if isinstance(b, ast.Name) and b.id in classes]
    titles: dict[str, str] = {}  # variable -> group title
    dests: dict[str, set[str]] = {}  # group title -> option dests
    for node in ast.walk(ast.parse((root / "commands/launch.py").read_text())):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                getattr(node.value.func, "attr", "") == "add_argument_group" and node.value.args:
            titles[node.targets[0].id] = node.value.args[0].value
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and \
                isinstance(node.func.value, ast.Name) and node.func.value.id in titles:
            opts = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
            dest = next((k.value.value for k in node.keywords if k.arg == "dest"), None)
            if opts or dest:
                dests.setdefault(titles[node.func.value.id], set()).add(dest or opts[0][2:].replace("-", "_"))
    out = {"": frozenset(top)}
    for section, (title, prefix) in _SECTIONS.items():
        keys = dests.get(title, set()) if title else {d for ds in dests.values() for d in ds if d.startswith(prefix)}
        out[section] = frozenset(keys)
    return out


def no_effect_reason(section: str, key: str) -> str | None:
    """Why an Accelerate key has no effect in this guide; None for a key the guide applies. Also for the
    DeepSpeed JSON's ``activation_checkpointing`` sub-keys (section ``"activation_checkpointing"``)."""
    if section == "activation_checkpointing":
        return _DS_AC_KEYS[key][2]
    if key in _NO_EFFECT_KEY:
        return _NO_EFFECT_KEY[key]
    if section in _NO_EFFECT_SECTION:
        return _NO_EFFECT_SECTION[section]
    if key in _PAR_KEYS:  # e.g. parallelism_config_sp_size: applied (anything but 1 is refused)
        return None
    return next((why for pre, why in _NO_EFFECT_PREFIX.items() if key.startswith(pre)), None)


def unapplied_notes(job: JobConfig) -> list[str]:
    """One `note:` line per key in the file that Accelerate accepts and this guide cannot apply (train.py logs
    them)."""
    return [f"{key} = {value!r}: no effect here: {why}" for key, (value, why) in job.unapplied.items()]


# --------------------------------------------------------------------------- checking


class _Checker:
    def __init__(self, source: str):
        self.source = source
        self.unapplied: dict[str, tuple[Any, str]] = {}

    def no_effect(self, section: str, key: str, value: Any) -> None:
        """Remember a key that has no effect here, unless its value asks for nothing (false, "no", empty)."""
        why = no_effect_reason(section, key)
        if why is None or value is None or value is False or value == {} or value == [] or \
                str(value).lower() in ("", "no", "false"):
            return
        self.unapplied[f"{section}.{key}" if section else key] = (value, why)

    def fail(self, msg: str):
        raise ConfigError(f"{self.source}: {msg}")

    def unknown(self, where: str, key: str, allowed):
        near = difflib.get_close_matches(str(key), list(allowed), n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        self.fail(f"unknown key {where}{key}{hint}; allowed: {', '.join(sorted(allowed))}")

    def value(self, key: str, value: Any, rule):
        """Check one value against a rule: a type or a list of choices."""
        if rule is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false"):
                return value.lower() == "true"
            self.fail(f"{key} = {value!r}: expected true or false")
        if rule is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            self.fail(f"{key} = {value!r}: expected an integer")
        if rule is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            self.fail(f"{key} = {value!r}: expected a number")
        if rule is str:
            if isinstance(value, str) and value:
                return value
            self.fail(f"{key} = {value!r}: expected a non-empty string")
        if isinstance(rule, list):
            for choice in rule:
                if value == choice or (isinstance(value, str) and str(choice).lower() == value.lower()):
                    return choice
            self.fail(f"{key} = {value!r}: allowed values are {', '.join(map(str, rule))}")
        return value

    def section(self, raw: dict, name: str, rules: dict) -> dict:
        """A section's keys: each one Accelerate knows (else refused), values checked where the guide has a rule."""
        sec = raw.get(name) or {}
        if not isinstance(sec, dict):
            self.fail(f"{name} = {sec!r}: expected a mapping of keys")
        allowed, prefix = accelerate_keys()[name], _SECTIONS[name][1]
        out = {}
        for k, v in sec.items():
            key = k if str(k).startswith(prefix) else f"{prefix}{k}"  # as accelerate launch reads it
            if key not in allowed:
                self.unknown(f"{name}.", k, allowed)
            out[key] = self.value(f"{name}.{key}", v, rules[key]) if rules.get(key) is not None else v
            self.no_effect(name, key, out[key])
        return out


def _read_yaml(path: str) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a YAML mapping of Accelerate config keys")
    return raw


def _find_file(name: str, yaml_path: str) -> Path | None:
    """A path in a config: as given (cwd), else next to the YAML or one of its parents."""
    p = Path(name)
    if p.is_absolute() or p.is_file():
        return p if p.is_file() else None
    for base in [Path(yaml_path).resolve().parent, *Path(yaml_path).resolve().parents]:
        if (base / p).is_file():
            return base / p
    return None


def _fsdp_options(c: _Checker, raw: dict, world_size: int | None) -> tuple[FSDPOptions, list[str]]:
    fsdp_sec, notes = normalize_fsdp_config(raw.get("fsdp_config") or {})  # legacy spellings, warned
    sec = c.section({**raw, "fsdp_config": fsdp_sec}, "fsdp_config", _FSDP_KEYS)
    par = c.section(raw, "parallelism_config", _PAR_KEYS)
    o = FSDPOptions()
    version = sec.get("fsdp_version", 1)
    raf = sec.get("fsdp_reshard_after_forward")
    strategy = sec.get("fsdp_sharding_strategy")
    if isinstance(raf, bool) or (isinstance(raf, str) and raf.lower() in ("true", "false")):
        raf = c.value("fsdp_config.fsdp_reshard_after_forward", raf, bool)
        if strategy is not None:
            c.fail(
                "fsdp_config: give either fsdp_sharding_strategy or a true/false "
                "fsdp_reshard_after_forward, not both"
            )
        strategy = "FULL_SHARD" if raf else "SHARD_GRAD_OP"
    elif raf is not None:  # FSDP1 spelling: the strategy name under reshard_after_forward
        strategy = c.value("fsdp_config.fsdp_reshard_after_forward", raf, _SHARDING)
    o.sharding = strategy or "FULL_SHARD"
    o.reshard_after_forward = o.sharding in ("FULL_SHARD", "HYBRID_SHARD")
    if version == 1:
        notes.append("fsdp_version 1: this guide runs these keys with FSDP2 (fully_shard); "
                     "accelerate launch would use FSDP1")
    for key, attr in [
        ("fsdp_offload_params", "offload_params"), ("fsdp_state_dict_type", "state_dict_type"),
        ("fsdp_cpu_ram_efficient_loading", "cpu_ram_efficient_loading"),
        ("fsdp_sync_module_states", "sync_module_states"), ("fsdp_auto_wrap_policy", "auto_wrap_policy"),
        ("fsdp_transformer_layer_cls_to_wrap", "transformer_layer_cls_to_wrap"),
        ("fsdp_min_num_params", "min_num_params"), ("fsdp_forward_prefetch", "forward_prefetch"),
        ("fsdp_backward_prefetch", "backward_prefetch"),
        ("fsdp_activation_checkpointing", "activation_checkpointing"),
        ("fsdp_activation_checkpointing_offload", "activation_checkpointing_offload"),
        ("fsdp_use_orig_params", "use_orig_params"),
    ]:
        if key in sec:
            setattr(o, attr, sec[key])
    if o.activation_checkpointing_offload and not o.activation_checkpointing:
        c.fail("fsdp_config.fsdp_activation_checkpointing_offload = true needs fsdp_activation_checkpointing: true "
               "(it offloads what checkpointing holds; Accelerate refuses it alone too)")
    if version == 2 and ("fsdp_forward_prefetch" in sec or "fsdp_backward_prefetch" in sec):
        notes.append("fsdp_forward_prefetch / fsdp_backward_prefetch: accelerate launch ignores them under "
                     "fsdp_version 2; this guide maps them onto FSDP2's explicit prefetch (helpers.job.backends.fsdp)")
    if o.min_num_params < 0:
        c.fail(f"fsdp_config.fsdp_min_num_params = {o.min_num_params}: must be >= 0")

    for key in ("parallelism_config_tp_size", "parallelism_config_cp_size", "parallelism_config_sp_size"):
        if par.get(key, 1) != 1:
            c.fail(f"parallelism_config.{key} = {par[key]}: this guide runs data parallelism only; allowed: 1")
    rep, shard = par.get("parallelism_config_dp_replicate_size"), par.get("parallelism_config_dp_shard_size")
    for key, v in (("dp_replicate_size", rep), ("dp_shard_size", shard)):
        if v is not None and v < 1:
            c.fail(f"parallelism_config.parallelism_config_{key} = {v}: must be >= 1")
    if rep and rep > 1 and o.sharding in ("FULL_SHARD", "SHARD_GRAD_OP"):
        o.sharding = "HYBRID_SHARD" if o.sharding == "FULL_SHARD" else "HYBRID_SHARD_ZERO2"
    if o.sharding.startswith("HYBRID"):
        o.hybrid_shard_size = shard
        if world_size is not None:
            size = shard or (world_size // rep if rep else None)
            if size is None:
                size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            if rep and shard and rep * shard != world_size:
                c.fail(
                    f"parallelism_config: dp_replicate_size ({rep}) x dp_shard_size ({shard}) = "
                    f"{rep * shard}, but the job has {world_size} ranks; run it on {rep * shard} ranks "
                    f"(--nproc_per_node {rep * shard}), or on {world_size} use fsdp/full_shard.yaml (one "
                    "shard group) or set the two sizes so that their product is the rank count"
                )
            if world_size % size or size == world_size:
                c.fail(
                    f"{o.sharding} needs a shard group that divides the world size into 2 or more "
                    f"replicas: shard group size {size}, world size {world_size} "
                    "(hybrid modes need 4 ranks here: 2 replicas x 2 shards)"
                )
            o.hybrid_shard_size = size
    return o, notes


def _deepspeed_options(c: _Checker, raw: dict) -> tuple[DeepSpeedOptions, Precision, list[str]]:
    sec = c.section(raw, "deepspeed_config", _DS_KEYS)
    notes: list[str] = []
    o = DeepSpeedOptions()
    for k in ("zero_stage", "offload_optimizer_device", "offload_param_device",
              "offload_optimizer_nvme_path", "offload_param_nvme_path",
              "zero3_init_flag", "zero3_save_16bit_model"):
        if k in sec:
            setattr(o, k, sec[k])
    if "deepspeed_config_file" in sec:
        clash = [k for k in _DS_FILE_EXCLUSIVE if k in sec] + (
            ["mixed_precision"] if raw.get("mixed_precision") is not None else [])
        if clash:
            c.fail(
                f"deepspeed_config.deepspeed_config_file is set, so {', '.join(clash)} must be "
                "in the DeepSpeed JSON instead (Accelerate refuses both)"
            )
        found = _find_file(sec["deepspeed_config_file"], c.source)
        if found is None:
            c.fail(f"deepspeed_config.deepspeed_config_file = {sec['deepspeed_config_file']!r}: no such file")
        o.config_file = str(found)
        try:
            o.json = json.loads(found.read_text())
        except json.JSONDecodeError as e:
            c.fail(f"{found}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}")
        if not isinstance(o.json, dict):
            c.fail(f"{found}: expected a JSON object")
        o, mp, notes = o, *_read_ds_json(c, o, str(found), notes)
        return o, mp, notes + _linear_note(o)

    # Inline keys: build the JSON the way Accelerate does.
    mp = c.value("mixed_precision", raw.get("mixed_precision") or "no", ["no", "bf16"])
    zo: dict[str, Any] = {"stage": o.zero_stage}
    for what in ("optimizer", "param"):
        dev = getattr(o, f"offload_{what}_device")
        if dev != "none":
            zo[f"offload_{what}"] = {"device": dev}
            if dev == "nvme":
                path = getattr(o, f"offload_{what}_nvme_path")
                if not path:
                    c.fail(f"deepspeed_config.offload_{what}_device = nvme needs offload_{what}_nvme_path")
                zo[f"offload_{what}"]["nvme_path"] = path
    if o.zero3_save_16bit_model:
        zo["stage3_gather_16bit_weights_on_model_save"] = True
    o.json = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": sec.get("gradient_accumulation_steps", "auto"),
        "zero_optimization": zo,
        "bf16": {"enabled": mp == "bf16"},
    }
    clip = sec.get("gradient_clipping")
    if clip:
        o.json["gradient_clipping"] = clip
    elif clip is not None:
        notes.append(
            "gradient_clipping: 0 in the YAML is dropped (Accelerate only passes a non-zero value), "
            "so DeepSpeed clips at its default 1.0; set it in a deepspeed_config_file to turn clipping off"
        )
    return o, mp, notes + _linear_note(o)


LINEAR_NOTE = ("zero_optimization.memory_efficient_linear is not false: ZeRO-3 replaces torch's F.linear with "
               "DeepSpeed's, which adds the bias in a second bf16 rounding, so layers with biases (Qwen2, "
               "GPT-NeoX, ...) part from FSDP in the last bits from step 1; set it to false for parity")


def _linear_note(o: DeepSpeedOptions) -> list[str]:
    zo = o.json.get("zero_optimization") or {}
    return [LINEAR_NOTE] if o.zero_stage == 3 and zo.get("memory_efficient_linear", True) is not False else []


def _read_ds_json(c: _Checker, o: DeepSpeedOptions, path: str, notes: list[str]):
    js = o.json
    zo = js.get("zero_optimization", {})
    if not isinstance(zo, dict):
        c.fail(f"{path}: zero_optimization = {zo!r}: expected an object")
    o.zero_stage = c.value(f"{path}: zero_optimization.stage", zo.get("stage", 0), [0, 1, 2, 3])
    for what in ("optimizer", "param"):
        dev = (zo.get(f"offload_{what}") or {}).get("device", "none")
        setattr(o, f"offload_{what}_device",
                c.value(f"{path}: zero_optimization.offload_{what}.device", dev, ["none", "cpu", "nvme"]))
    o.zero3_save_16bit_model = bool(zo.get("stage3_gather_16bit_weights_on_model_save", False))
    _read_ds_ac(c, js, path)
    bf16 = (js.get("bf16") or {}).get("enabled", False)
    fp16 = (js.get("fp16") or {}).get("enabled", False)
    if fp16 not in (False, "false"):
        c.fail(f"{path}: fp16.enabled = {fp16!r}: this guide trains in bf16 or fp32; allowed: false")
    if bf16 == "auto":  # filled at launch: on, unless --model-dtype fp32 (see load_job_config)
        return "bf16", notes
    mp: Precision = "bf16" if c.value(f"{path}: bf16.enabled", bf16, bool) else "no"
    return mp, notes


def _read_ds_ac(c: _Checker, js: dict, path: str) -> None:
    """The JSON's activation_checkpointing section: each sub-key checked; one that asks for something it cannot
    do here is remembered for a note (unapplied_notes)."""
    if "activation_checkpointing" not in js:
        return
    sec = js["activation_checkpointing"]
    if not isinstance(sec, dict):
        c.fail(f"{path}: activation_checkpointing = {sec!r}: expected an object (even empty: {{}} turns the "
               "model's activation checkpointing on)")
    for k, v in sec.items():
        if k not in _DS_AC_KEYS:
            near = difflib.get_close_matches(str(k), list(_DS_AC_KEYS), n=1)
            c.fail(f"{path}: unknown key activation_checkpointing.{k}{f' (did you mean {near[0]}?)' if near else ''}"
                   f"; allowed: {', '.join(sorted(_DS_AC_KEYS))}")
        rule, default, _ = _DS_AC_KEYS[k]
        if v is not None and v != default:
            c.value(f"{path}: activation_checkpointing.{k}", v, rule)
            c.no_effect("activation_checkpointing", k, v)


def load_job_config(path: str, overrides: dict | None = None, world_size: int | None = None) -> JobConfig:
    """Read and validate a launch config, then apply CLI overrides.

    ``world_size`` (when known) lets the check refuse layouts that cannot run.
    Raises ConfigError with a one-line message.
    """
    c = _Checker(path)
    raw = _read_yaml(path)
    top = accelerate_keys()[""]
    for k, v in raw.items():
        if k not in top:
            c.unknown("", k, top)
        if k in _SECTIONS and k not in _TOP_READ:
            c.section(raw, k, {})  # fp8_config, megatron_lm_config, ...: keys checked, each noted
        elif k not in _TOP_READ:
            c.no_effect("", k, v)
    dt = c.value("distributed_type", raw.get("distributed_type"), ["FSDP", "DEEPSPEED"])
    for other in ("fsdp_config", "deepspeed_config"):
        if raw.get(other) and other != {"FSDP": "fsdp_config", "DEEPSPEED": "deepspeed_config"}[dt]:
            c.fail(f"{other} is given but distributed_type is {dt}")
    train = _train_options(c, overrides or {})
    if dt == "FSDP":
        fsdp, notes = _fsdp_options(c, raw, world_size)
        mp = c.value("mixed_precision", raw.get("mixed_precision") or "no", ["no", "bf16"])
        job = JobConfig(path, "fsdp", mp, train, fsdp=fsdp, notes=notes)
    else:
        if raw.get("parallelism_config"):
            c.fail("parallelism_config is an FSDP2 setting; for DeepSpeed hybrid sharding "
                   "set zero_optimization.zero_hpz_partition_size in the JSON")
        ds, mp, notes = _deepspeed_options(c, raw)
        job = JobConfig(path, "deepspeed", mp, train, deepspeed=ds, notes=notes)
        _merge_ds_training(c, job, overrides or {})
        if (ds.json.get("bf16") or {}).get("enabled") == "auto" and job.train.model_dtype == "fp32":
            job.mixed_precision = "no"  # bf16.enabled "auto": an fp32 model trains in fp32
        hpz = ds.json.get("zero_optimization", {}).get("zero_hpz_partition_size", 1)
        if not isinstance(hpz, int) or hpz < 1:
            c.fail(f"zero_optimization.zero_hpz_partition_size = {hpz!r}: expected an integer >= 1")
        if hpz > 1 and world_size is not None and (world_size % hpz or hpz == world_size):
            c.fail(f"zero_optimization.zero_hpz_partition_size = {hpz}: must divide the world size "
                   f"({world_size}) into 2 or more groups (hpZ needs {2 * hpz} ranks here); run it on "
                   f"{2 * hpz} ranks (--nproc_per_node {2 * hpz}), or on {world_size} use deepspeed/zero3.yaml "
                   "(no secondary groups)")
    if world_size is not None and world_size < 1:
        c.fail(f"world size {world_size}: must be >= 1")
    job.train.model_dtype = resolve_model_dtype(c, job)
    job.notes += optimizer_impl_notes(job)
    job.unapplied = c.unapplied
    return job


def adamw_kwargs(t: TrainOptions) -> dict:
    """The torch AdamW both backends step: lr, weight decay and --optimizer-impl (for-loop, foreach, fused)."""
    return dict(lr=t.lr, weight_decay=t.weight_decay, foreach=t.optimizer_impl == "foreach",
                fused=t.optimizer_impl == "fused")


def optimizer_impl_notes(job: JobConfig) -> list[str]:
    """What --optimizer-impl does here, when it is not the parity mode (for-loop)."""
    impl = job.train.optimizer_impl
    if job.backend == "deepspeed" and "optimizer" in job.deepspeed.json:
        if impl == "for-loop":
            return []
        return [f"--optimizer-impl {impl}: no effect, the DeepSpeed config's optimizer section builds the "
                "optimizer (torch's own foreach/fused default then applies)"]
    if impl == "for-loop":
        return []
    return [f"--optimizer-impl {impl}: AdamW steps with {impl}=True, for throughput; FSDP and DeepSpeed then "
            "group the update differently (per parameter tensor vs flat partitions), so bit-identical losses "
            "across backends are not promised (the parity mode is for-loop, the default)"]


def resolve_model_dtype(c: _Checker, job: JobConfig) -> Literal["bf16", "fp32"]:
    """The dtype the model is loaded in ("auto" resolved); the backend then decides what to upcast.

    ``auto`` is bf16 - the seeds' setup, a checkpoint loaded in bf16 - so the FSDP
    config's ``mixed_precision`` alone picks the mode: ``bf16`` upcasts to fp32 shards
    (aligned with DeepSpeed), ``no`` trains in bf16 end to end (memory-constrained).
    DeepSpeed with bf16 disabled trains in fp32, so there ``auto`` is fp32 and bf16 is refused.
    """
    want = job.train.model_dtype
    ds_fp32 = job.backend == "deepspeed" and job.mixed_precision == "no"
    if want == "auto":
        return "fp32" if ds_fp32 else "bf16"
    if want == "bf16" and ds_fp32:
        c.fail("--model-dtype = 'bf16' needs bf16.enabled = true in the DeepSpeed config (with it off, "
               "DeepSpeed expects an fp32 model); allowed here: fp32, auto")
    return want


def _train_options(c: _Checker, overrides: dict) -> TrainOptions:
    t = TrainOptions()
    rules = {"model": str, "steps": int, "lr": float, "seed": int, "micro_batch": int,
             "seq_len": int, "grad_accum": int, "grad_clip": float, "weight_decay": float, "timeout": float,
             "model_dtype": ["auto", "bf16", "fp32"], "compile": bool,
             "optimizer_impl": ["for-loop", "foreach", "fused"]}
    for k, v in overrides.items():
        if v is None:
            continue
        if k not in rules:
            c.unknown("override ", k, rules)
        setattr(t, k, c.value(f"--{k.replace('_', '-')}", v, rules[k]))
    for k in ("steps", "micro_batch", "seq_len", "grad_accum"):
        if getattr(t, k) < 1:
            c.fail(f"--{k.replace('_', '-')} = {getattr(t, k)}: must be >= 1")
    for k in ("lr", "grad_clip", "weight_decay"):
        if getattr(t, k) < 0:
            c.fail(f"--{k.replace('_', '-')} = {getattr(t, k)}: must be >= 0")
    if not 0 < t.timeout < float("inf"):
        c.fail(f"--timeout = {t.timeout}: must be a number of seconds > 0 (default 600)")
    if t.seq_len < 2:
        c.fail(f"--seq-len = {t.seq_len}: must be >= 2 (a causal LM predicts the next token)")
    return t


def _merge_ds_training(c: _Checker, job: JobConfig, overrides: dict) -> None:
    """Accumulation and clipping: one value, from the CLI or the DeepSpeed config, never two."""
    js = job.deepspeed.json
    for ds_key, attr, rule in (("gradient_accumulation_steps", "grad_accum", int),
                               ("gradient_clipping", "grad_clip", float)):
        v = js.get(ds_key, "auto")
        if v == "auto":
            continue
        v = c.value(ds_key, v, rule)
        cli = overrides.get(attr)
        if cli is not None and cli != v:
            c.fail(f"--{attr.replace('_', '-')} {cli} conflicts with {ds_key} = {v} in the DeepSpeed "
                   "config; change one of them or write \"auto\" there")
        setattr(job.train, attr, v)
    if "gradient_clipping" not in js:
        job.train.grad_clip = 1.0  # DeepSpeed's own default
        if overrides.get("grad_clip") is not None and overrides["grad_clip"] != 1.0:
            c.fail(f"--grad-clip {overrides['grad_clip']}: the DeepSpeed config does not set "
                   "gradient_clipping, so DeepSpeed clips at 1.0; set it there")


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m helpers.config", description="Validate a launch config.")
    ap.add_argument("config")
    ap.add_argument("--world-size", type=int, default=None, help="check the layout against N ranks")
    args = ap.parse_args(argv)
    try:
        job = load_job_config(args.config, world_size=args.world_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = job.backend.upper()
    if job.fsdp:
        what += f" {job.fsdp.sharding} (reshard_after_forward={job.fsdp.reshard_after_forward})"
    if job.deepspeed:
        what += f" ZeRO-{job.deepspeed.zero_stage}"
    print(f"ok: {args.config}: {what}, mixed_precision={job.mixed_precision}")
    for n in job.notes + unapplied_notes(job):
        print(f"note: {n}")
    return 0
