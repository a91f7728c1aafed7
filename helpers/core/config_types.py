"""The typed result of reading a launch config: JobConfig and its option dataclasses.

``helpers.core.config`` fills these from an Accelerate-format YAML (and the CLI's overrides); every other
part of the guide reads a job's settings from them. ConfigError is the one exception a bad config raises.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

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
