"""The byte arithmetic behind ``python -m helpers.estimate``: a job's per-rank bytes, category by category.

From a job's config (``helpers.core.config``) and its model's parameter shapes (built on the meta device):
where offloaded state goes, the state at rest on each rank (params, grads, optimizer states, master params),
the activations of one micro-batch, what ZeRO-3 keeps gathered into backward, the optimizer step's
temporaries and the cuBLAS workspaces. ``helpers.estimate`` adds them up into the peak of each moment of a
step; its module doc says what each category holds and what was measured.

Activations, per token, with c the compute dtype's bytes (2 under bf16, else the model dtype's), h
the hidden size, q = heads x head_dim, k = kv_heads x head_dim, i the MLP width, V the vocabulary, a
Llama-style block (RMSNorm computed in fp32, gated MLP; other families are counted the same way, an
approximation): per block ``2 x (4h + c h + 4)`` (two norms: the fp32 input, the normed input, the
rsqrt) ``+ c (2h + 2q + 2k)`` (the q/k/v and o_proj inputs, q and k before and after RoPE's rotation)
``+ 4 x heads`` (attention's log-sum-exp) ``+ 4 c i`` (gate, activation, up, their product); after the
blocks ``4h + c h + 4`` (final norm) ``+ 4 V`` (the fp32 log-probs the loss keeps); per sequence the
RoPE cos/sin (``2 c head_dim`` a token) and the token ids. Checkpointed: ``c h`` per token per block
(its input), plus one block as above, plus the part after the blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from helpers.core import mapping

STATE = mapping.CATEGORIES


class EstimateError(ValueError):
    """Bad input; the message names the key, the value and what is allowed."""


# --------------------------------------------------------------------------- state at rest (shared with the widget)


def offloaded(key: str, job=None, offload: bool | None = None) -> dict[str, str]:
    """Which state categories leave the device, and to where ("host" | "disk").

    From a job's config, or (the notebook widget) from one ``offload`` switch: FSDP and ZeRO-3 move
    everything to the host, ZeRO-1/2 the optimizer side, ZeRO-0 nothing.
    """
    if job is None:
        if not offload:
            return {}
        if mapping.MODES[key].backend == "fsdp" or key.startswith("zero3"):
            return dict.fromkeys(STATE, "host")
        return {} if key == "zero0" else dict.fromkeys(("optimizer_states", "master_params", "grads"), "host")
    if job.backend == "fsdp":
        return dict.fromkeys(STATE, "host") if job.fsdp.offload_params else {}
    zo = job.deepspeed.json.get("zero_optimization", {})
    where = {"cpu": "host", "nvme": "disk"}
    out = {}
    opt = (zo.get("offload_optimizer") or {}).get("device", job.deepspeed.offload_optimizer_device)
    if opt in where:  # DeepSpeed also keeps the fp32 gradient partition next to the optimizer, on the host
        out.update({"optimizer_states": where[opt], "master_params": where[opt], "grads": "host"})
    par = (zo.get("offload_param") or {}).get("device", job.deepspeed.offload_param_device)
    if par in where:
        out["params"] = where[par]
    return out


def split_state(state: dict[str, float], moved: dict[str, str]) -> tuple[dict, dict, dict]:
    """(device, host, disk) bytes per category, given where the moved categories go."""
    device, host, disk = dict(state), dict.fromkeys(state, 0.0), dict.fromkeys(state, 0.0)
    for cat, where in moved.items():
        (host if where == "host" else disk)[cat], device[cat] = device[cat], 0.0
    return device, host, disk


# --------------------------------------------------------------------------- the model, from its config


@dataclass
class Shapes:
    params: list[tuple[int, ...]]  # every parameter's shape
    units: list[int]  # elements per FSDP unit (each block, then the rest)
    cfg: object  # the transformers config
    trainable: list[bool] | None = None  # per parameter (--peft: the adapter's); None: every one trains
    units_trainable: list[int] | None = None  # trainable elements per unit, as ``units``
    peft: object = None  # the LoraConfig, or None
    tail: int = 0  # elements of FSDP's tail unit (final norm, output embedding, and the input one when tied)
    _ratio: dict = None  # (micro_batch, seq_len) -> activation_ratio, computed once each

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.params)

    def trains(self, i: int) -> bool:
        return self.trainable is None or self.trainable[i]

    @property
    def trainable_numel(self) -> int:
        return sum(math.prod(s) for i, s in enumerate(self.params) if self.trains(i))

    def unit_trainable(self, i: int) -> int:
        return self.units[i] if self.units_trainable is None else self.units_trainable[i]


def _meta_model(cfg, peft=None):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    if peft is not None:
        from helpers.core.models import add_adapter

        add_adapter(m, peft, seed=0)
    return m


def model_shapes(model: str, wrap: str = "TRANSFORMER_BASED_WRAP", peft=None) -> Shapes:
    """Parameter shapes and FSDP units of ``--model``, built on the meta device; ``peft`` (a LoraConfig): with
    the adapter injected, and which parameters train."""
    from helpers.core.models import ModelSpecError, decoder_layers, model_config, resolve_model

    try:
        cfg = model_config(resolve_model(model))
    except ModelSpecError as e:
        raise EstimateError(str(e)) from None
    m = _meta_model(cfg, peft)
    shapes = [tuple(p.shape) for p in m.parameters()]
    trainable = [p.requires_grad for p in m.parameters()]
    blocks = [sum(p.numel() for p in b.parameters()) for b in decoder_layers(m)]
    blocks_t = [sum(p.numel() for p in b.parameters() if p.requires_grad) for b in decoder_layers(m)]
    total = sum(math.prod(s) for s in shapes)
    total_t = sum(math.prod(s) for s, t in zip(shapes, trainable, strict=True) if t)
    units = [total] if wrap == "NO_WRAP" else [*blocks, total - sum(blocks)]
    units_t = [total_t] if wrap == "NO_WRAP" else [*blocks_t, total_t - sum(blocks_t)]
    from helpers.core.internals import final_norm

    tail_mods = [final_norm(m), m.get_output_embeddings()]
    if getattr(tail_mods[1], "weight", None) is getattr(m.get_input_embeddings(), "weight", 0):
        tail_mods.append(m.get_input_embeddings())
    tail = sum(p.numel() for p in {id(p): p for t in tail_mods if t is not None for p in t.parameters()}.values())
    if peft is None:
        return Shapes(shapes, units, cfg, tail=tail)
    return Shapes(shapes, units, cfg, trainable, units_t, peft, tail=tail, _ratio={})


def saved_bytes(cfg, peft, micro_batch: int, seq_len: int, dtype=None) -> int:
    """Bytes autograd saves in one forward of the model (with ``peft``'s adapter, its base frozen), traced with
    fake tensors: every op runs its CPU kernel's shape logic, nothing is computed or allocated, each storage
    counted once. (On the meta device transformers' mask code would ask for a value; under FakeTensorMode it
    skips that check, as it does when compiled.)"""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    m = _meta_model(cfg, peft)
    m.config.use_cache = False
    dtype = dtype or torch.bfloat16
    seen, total = set(), 0
    with FakeTensorMode(allow_non_fake_inputs=True):
        for mod in m.modules():
            for k, p in list(mod._parameters.items()):
                if p is not None:
                    mod._parameters[k] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype), p.requires_grad)
            for k, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[k] = torch.empty(b.shape, dtype=b.dtype)
        held = {p.untyped_storage()._cdata for p in m.parameters()}

        def pack(t):
            nonlocal total
            key = t.untyped_storage()._cdata
            if key not in seen and key not in held:
                seen.add(key)
                total += t.untyped_storage().nbytes()
            return t

        ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(input_ids=ids, labels=ids)
    return total


def activation_ratio(shapes: Shapes, micro_batch: int, seq_len: int, c: int = 2) -> float:
    """What a frozen base saves of the activations a full fine-tune saves (1.0 without --peft): a frozen layer's
    input is not kept for a weight gradient, and nothing before the first adapter needs a gradient at all.
    Traced (``saved_bytes``) for both, in the compute dtype (``c`` bytes); the activation formula is scaled by it."""
    if shapes.peft is None:
        return 1.0
    import torch

    key, dtype = (micro_batch, seq_len, c), torch.bfloat16 if c == 2 else torch.float32
    if key not in shapes._ratio:
        full = saved_bytes(shapes.cfg, None, micro_batch, seq_len, dtype)
        shapes._ratio[key] = saved_bytes(shapes.cfg, shapes.peft, micro_batch, seq_len, dtype) / full
    return shapes._ratio[key]


def _dims(cfg) -> tuple[int, int, int, int, int, int, int]:
    h = cfg.hidden_size
    heads = cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or h // heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    inter = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * h
    return h, heads, d, kv, inter, cfg.num_hidden_layers, cfg.vocab_size


def activation_bytes(cfg, micro_batch: int, seq_len: int, c: int, checkpointed: bool = False) -> int:
    """Bytes autograd keeps after one forward of ``micro_batch`` x ``seq_len`` (formula: module doc)."""
    h, heads, d, kv, inter, layers, vocab = _dims(cfg)
    block = block_per_token(cfg, c)
    head = head_per_token(cfg, c)
    tokens = micro_batch * seq_len
    per_seq = 2 * c * d * seq_len + 16 * seq_len  # RoPE cos/sin (shared by the batch), token ids and labels
    blocks = (c * h * layers + block) * tokens if checkpointed else block * layers * tokens
    return blocks + head * tokens + per_seq


def block_per_token(cfg, c: int) -> int:
    """Activation bytes per token of one decoder block (formula: module doc)."""
    h, heads, d, kv, inter, _, _ = _dims(cfg)
    return 2 * (4 * h + c * h + 4) + c * (2 * h + 2 * heads * d + 2 * kv * d) + 4 * heads + 4 * c * inter


def head_per_token(cfg, c: int) -> int:
    """Activation bytes per token after the blocks: the final norm and the fp32 log-probs."""
    h, vocab = cfg.hidden_size, cfg.vocab_size
    return 4 * h + c * h + 4 + 4 * vocab


# --------------------------------------------------------------------------- state per rank and what adds to it


def _zero(job) -> dict:
    return job.deepspeed.json.get("zero_optimization", {}) if job.backend == "deepspeed" else {}


PERSISTENCE_DEFAULT = 100_000  # DeepSpeed's stage3_param_persistence_threshold default (tests/test_estimate.py checks)


def persistence_threshold(zero: dict) -> int:
    """ZeRO-3 keeps parameters of at most this many elements whole on every rank: the ``zero_optimization``
    section's ``stage3_param_persistence_threshold``, or DeepSpeed's default."""
    return int(float(zero.get("stage3_param_persistence_threshold", PERSISTENCE_DEFAULT)))


def is_persistent(numel: int, threshold: int) -> bool:
    """DeepSpeed's rule (``mark_persistent_parameters``): a parameter of at most ``threshold`` elements."""
    return numel <= threshold


def _shard_group(job, key: str, world_size: int) -> int:
    """How many ranks an FSDP parameter is sharded over: 1 under NO_SHARD, the shard group under HSDP."""
    return 1 if key == "no_shard" else (job.fsdp.hybrid_shard_size or world_size)


def state_per_rank(job, shapes: Shapes, world_size: int) -> list[dict[str, float]]:
    """params, grads, optimizer_states, master_params of each rank (see helpers.estimate's module doc)."""
    theory = mapping.job_theory_bytes(job, shapes.numel, world_size, shapes.trainable_numel)
    n_tensors = sum(shapes.trains(i) for i in range(len(shapes.params)))  # Adam's step counters: trained ones
    key = mapping.mode_key(job)
    if job.backend == "deepspeed":
        out = dict(theory)
        out["optimizer_states"] += 4  # one step counter per flat group
        if key.startswith("zero3"):
            threshold = persistence_threshold(_zero(job))
            whole = sum(math.prod(s) for s in shapes.params if is_persistent(math.prod(s), threshold))
            per = 2 if job.mixed_precision == "bf16" else 4
            # a persistent parameter is whole in the module on every rank; its partition is also kept apart (measured
            # with LoRA on small, 2 and 4 ranks: state exact only when both are counted), which this count leaves out
            # (0.31 MiB on tiny at 2 ranks; notebook 08 compares ZeRO-3's state with FULL_SHARD's from its runs)
            out["params"] += per * whole * (1 - 1 / world_size)
        return [out] * world_size
    group = _shard_group(job, key, world_size)
    per = mapping.bytes_per_param("fsdp", job.mixed_precision, 4 if job.train.model_dtype == "fp32" else 2)
    frozen_per = mapping.frozen_param_bytes(job)
    ranks = []
    for r in range(world_size):
        g = r % group
        stored = local = frozen = 0
        for i, s in enumerate(shapes.params):
            rows, rest = (s[0], math.prod(s[1:])) if s else (1, 1)
            chunk = -(-rows // group)
            if not shapes.trains(i):
                frozen += chunk * rest
                continue
            stored += chunk * rest
            local += max(0, min(chunk, rows - g * chunk)) * rest
        ranks.append({"params": per["params"] * stored + frozen_per * frozen, "grads": per["grads"] * stored,
                      "optimizer_states": per["optimizer_states"] * local + 4 * n_tensors, "master_params": 0})
    return ranks


def zero3_kept_gathered(job, shapes: Shapes, world_size: int) -> int:
    """Elements ZeRO-3 keeps gathered from forward into backward (see ``gathered_at_backward`` in helpers.estimate):
    walking the parameters from the last one forward, one is kept while the step's trace reaches its use in backward
    within the reuse distance (about twice the elements after it: their forward and their backward)."""
    zo = _zero(job)
    if world_size == 1 or int(zo.get("stage", 0)) != 3:
        return 0
    threshold = persistence_threshold(zo)
    reuse = int(float(zo.get("stage3_max_reuse_distance", 1e9)))
    kept = after = 0
    for n in reversed([math.prod(s) for s in shapes.params]):
        if is_persistent(n, threshold):
            continue  # persistent: whole on every rank, in the state already
        if 2 * after <= reuse:
            kept += n
        after += n
    return kept


def optimizer_temporary(job, shapes: Shapes, world_size: int) -> int:
    """Bytes the optimizer step allocates for a moment. AdamW (``foreach=False``) computes its denominator as
    ``exp_avg_sq.sqrt() / bias_correction``: two temporaries the size of the tensor it steps, alive
    together. FSDP steps each parameter's shard and ZeRO-0 each fp32 master param: two of the largest.
    ZeRO-1/2 step one flat fp32 partition: one partition is counted, an approximation (on one rank
    ``benchmarks/estimate_grid.py`` measures between none, on ``small``, where backward with the bucket
    is the larger moment, and 1.35 partitions, on ``medium``, above the state and the bucket). ZeRO-3
    also makes the fp32 copy of its gradient partition at the step: three partitions (measured exactly
    on one rank, same benchmark)."""
    key = mapping.mode_key(job)
    fp32 = 4 if job.mixed_precision == "bf16" or job.train.model_dtype == "fp32" else 2
    trained = [s for i, s in enumerate(shapes.params) if shapes.trains(i)]
    largest = max(math.prod(s) for s in trained)
    if job.backend == "fsdp":
        group = _shard_group(job, key, world_size)
        return 2 * fp32 * max(-(-s[0] // group) * math.prod(s[1:]) if s else 1 for s in trained)
    stage = int(_zero(job).get("stage", 0))
    if stage == 0:
        return 2 * 4 * largest
    return (3 if stage == 3 else 1) * 4 * -(-shapes.trainable_numel // world_size)


def compute_bytes(job) -> int:
    return 2 if job.mixed_precision == "bf16" or job.train.model_dtype == "bf16" else 4


# torch's cuBLAS workspace when CUBLAS_WORKSPACE_CONFIG is unset, read from aten/src/ATen/cuda/CublasHandlePool.cpp
# (parseChosenWorkspaceSize, pytorch/pytorch 26a39059ec58; the CPU wheel has no CUDA source to read):
# ":4096:2:16:8 default, 32MiB for Hopper", i.e. 4096 KiB x 2 + 16 KiB x 8 = 8,519,680 bytes, and 4096 KiB x 8 on
# sm90 (H100/H200, the guide's GPUs). The variable, when set, is ":SIZE_KiB:COUNT" pairs summed (--deterministic
# sets ":4096:8"). cuBLASLt shares that allocation: torch 2.13's torch/backends/cuda/__init__.py
# (blas_workspace_size): "When TORCH_CUBLASLT_UNIFIED_WORKSPACE is enabled (the default on open-source CUDA
# builds), the cuBLASLt workspace is capped at the cuBLAS workspace size and physically reuses the same allocation."
CUBLAS_DEFAULT = {"sm90": 4096 * 1024 * 8, "other": 4096 * 1024 * 2 + 16 * 1024 * 8}
# Workspaces are kept per (handle, stream) and handles per thread (CublasHandlePool.cpp's thread-local pool
# window): the training thread (forward, optimizer step) and autograd's device thread (backward) each get one.
# Read, not measured here.
CUBLAS_WORKSPACES = 2


def cublas_workspace_bytes(env: str | None = None, sm90: bool = True) -> int:
    """Bytes of one cuBLAS workspace: ``CUBLAS_WORKSPACE_CONFIG`` (``env``) parsed as torch does, else torch's
    default for the GPU (``sm90``: Hopper; the estimator assumes it unless the visible GPU says otherwise)."""
    import re

    pairs = re.findall(r":([0-9]+):([0-9]+)", env or "")
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return CUBLAS_DEFAULT["sm90" if sm90 else "other"]


def _cublas_workspaces() -> int:
    """What a job on this machine's GPU would hold (CUBLAS_WORKSPACE_CONFIG, the GPU's generation; Hopper when
    no GPU is visible)."""
    import os

    import torch

    sm90 = not torch.cuda.is_available() or torch.cuda.get_device_capability() == (9, 0)
    return CUBLAS_WORKSPACES * cublas_workspace_bytes(os.environ.get("CUBLAS_WORKSPACE_CONFIG"), sm90)
