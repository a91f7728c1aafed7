"""Models and data for the guide's jobs: built from configs, never downloaded.

``--model`` accepts
  * a preset name: ``tiny`` (~0.6M params), ``small`` (~21M), ``medium`` (~220M);
  * a path to a transformers ``config.json`` (any causal-LM family:
    Llama, Mistral, Qwen2, GPT-2, ...), built with random weights;
  * a local pretrained directory (``config.json`` + safetensors weights),
    loaded with ``from_pretrained`` (GPU users with a real checkpoint).

The data is a deterministic, learnable token stream: each sequence is an
arithmetic progression ``x_i = (s + i*d) mod P`` (P = 97) with a random start
``s`` and a random stride ``d`` in 1..8. From one token of context the next is
one of 8 (loss floor ln 8 = 2.08); from two it is certain, so the loss of a
causal LM really goes down, first fast (the bigram table), then below 2.08 as
attention learns to read the stride. The batch of a step is a pure function
of (seed, step); rank ``r`` takes its own slice of the global batch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from helpers.core.internals import CHECKPOINT_PREFIX, default_attn_implementation
from helpers.core.safeload import UnreadableFile, scan_file

# Presets: Llama-style decoders, sized to fit 2-core laptops (tiny, small)
# and to show memory effects (medium). Extra keys go to LlamaConfig as is.
PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=1000, hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
    ),
    "small": dict(
        vocab_size=8000, hidden_size=512, intermediate_size=1376,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
    ),
    "medium": dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=2752,
        num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16,
    ),
}
_COMMON = dict(max_position_embeddings=2048, tie_word_embeddings=False, attn_implementation="sdpa")


class ModelSpecError(ValueError):
    """``--model`` names nothing we can build; the message says what is allowed."""


@dataclass(frozen=True)
class ModelSpec:
    """What ``--model`` resolved to."""

    name: str  # preset name, or the path as given
    kind: str  # "preset" | "config" | "pretrained"
    path: str | None = None  # config.json file or pretrained directory


def resolve_model(spec: str) -> ModelSpec:
    """Turn a ``--model`` value into a ModelSpec, or raise ModelSpecError."""
    if spec in PRESETS:
        return ModelSpec(spec, "preset")
    p = Path(spec)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelSpecError(f"--model {spec!r}: directory has no config.json")
        has_weights = any(p.glob("*.safetensors")) or any(p.glob("*.bin"))
        if has_weights:
            _scan_pickled_weights(spec, p)
            return ModelSpec(spec, "pretrained", str(p))
        return ModelSpec(spec, "config", str(p / "config.json"))
    if p.is_file() and p.suffix == ".json":
        return ModelSpec(spec, "config", str(p))
    raise ModelSpecError(
        f"--model {spec!r}: not a preset ({', '.join(PRESETS)}), "
        "not a config.json file and not a directory holding one"
    )


def _scan_pickled_weights(spec: str, p: Path) -> None:
    """A ``*.bin`` (torch pickle) that would run code is refused before any rank starts (transformers
    reads it with weights_only=True too, but only inside the job, as a failure of rank 0)."""

    for f in sorted(p.glob("*.bin")):
        try:
            scan_file(f, "weights")
        except UnreadableFile as e:
            raise ModelSpecError(f"--model {spec!r}: {e}") from None


def model_config(spec: ModelSpec):
    """The transformers config for a spec (no weights)."""
    from transformers import AutoConfig, LlamaConfig

    if spec.kind == "preset":
        return LlamaConfig(**PRESETS[spec.name], **_COMMON)
    path = spec.path if spec.kind == "config" else os.path.join(spec.path, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
        cfg = AutoConfig.for_model(**raw)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        raise ModelSpecError(f"--model {spec.name!r}: cannot read {path}: {e}") from None
    default_attn_implementation(cfg)  # sdpa where the family supports it, else eager; the job logs which
    return cfg


def from_pretrained(path, dtype):
    """``AutoModelForCausalLM.from_pretrained`` without its per-rank "Loading weights" progress bar (every rank
    drawing one interleaves into unreadable fragments in a job's output)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def build_model(spec: ModelSpec, dtype: torch.dtype, seed: int, device: str | torch.device = "cpu"):
    """Build the causal LM in ``dtype`` ("loaded as"), identical on every rank.

    Random weights come from the seed alone (created in fp32 on the CPU, then
    cast), so the same seed gives the same model on any world size and for
    either backend.
    """
    from transformers import AutoModelForCausalLM

    if spec.kind == "pretrained":
        model = from_pretrained(spec.path, dtype)
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(model_config(spec), dtype=torch.float32)
        model.to(dtype)  # "loaded in dtype": params and buffers, like a bf16 checkpoint
    model.config.use_cache = False
    if getattr(model, "loss_type", "") is None:  # GPT-2's class names no loss: the causal-LM loss transformers
        model.loss_type = "ForCausalLM"  # falls back to anyway, said here instead of warned about in every job
    return model.to(device)


def add_adapter(model, peft, seed: int):
    """Inject ``peft``'s LoRA adapter in place (PEFT's ``inject_adapter_in_model``: the base frozen, the adapter in
    the dtype of the layer it adapts), its initialisation seeded from ``seed`` (helpers.job.lora's module doc)."""
    import copy

    from peft import inject_adapter_in_model

    torch.manual_seed(seed + 1)  # the adapter's init: the same on every rank, for both backends
    inject_adapter_in_model(copy.deepcopy(peft), model)
    return model


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated transformer blocks (the unit FSDP shards and gathers)."""
    for path in ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers"):
        obj = model
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList):
            return list(obj)
    raise ModelSpecError(f"cannot find the transformer blocks of {type(model).__name__}")


def clean_fqn(name: str) -> str:
    """A parameter's name as the model names it: checkpoint_wrapper's inner-module step left out (torch's
    state_dict helpers leave it out too), so names match with and without activation checkpointing."""
    return name.replace(CHECKPOINT_PREFIX, "")


def count_params(model) -> int:
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 init: p is empty


def synthetic_batch(
    step: int, *, seed: int, rank: int, world_size: int, micro_batch: int, seq_len: int,
    vocab_size: int, micro_step: int = 0, grad_accum: int = 1,
) -> torch.Tensor:
    """Token ids [micro_batch, seq_len] for this rank's slice of one step.

    The global batch of a step has ``world_size * grad_accum * micro_batch``
    sequences and depends only on (seed, step); rank ``r`` at micro-step ``m``
    takes rows ``((m * world_size) + r) * micro_batch`` onwards.
    """
    period = min(vocab_size, 97)  # token ids stay below the smallest vocab we build
    first = ((micro_step * world_size) + rank) * micro_batch
    rows = []
    for row in range(first, first + micro_batch):  # row i of the step's global batch
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 65_537 + row)
        start, stride = torch.randint(0, period, (1,), generator=g), torch.randint(1, 9, (1,), generator=g)
        rows.append((start + stride * torch.arange(seq_len)) % period)
    return torch.stack(rows)
