"""Which keys a launch config may hold, what this guide does with each, and the checker that applies that.

Which keys exist is read from Accelerate's own source (``accelerate_keys``); the tables say the rule a
value must follow for the keys the guide applies, and why each other key has no effect here
(``no_effect_reason``). ``_Checker`` holds one file to those rules: a bad key or value raises ConfigError
with one line naming the file, the key, the value and what is allowed. Used by ``helpers.core.config``
and its per-backend readers (``config_fsdp``, ``config_deepspeed``).
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
from pathlib import Path
from typing import Any

from helpers.core.config_types import ConfigError

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
