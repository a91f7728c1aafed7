"""torch (2.13.0) facts the guide states about precision (02) and offload (03).

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

from .. import fact, gpu_fact
from .._tools import fsdp2, linear_stack, source_has

V = "2.13.0"
FSDP = "torch/distributed/fsdp/_fully_shard/"


def _fsdp_params(module):
    return module._get_fsdp_state()._fsdp_param_group.fsdp_params


@fact("torch.fsdp2_bf16_model_bf16_optimizer",
      "FSDP2's fully_shard keeps a bf16 model's shards in bf16 (a bf16 MixedPrecisionPolicy casts nothing), so "
      "torch's AdamW steps bf16 weights and keeps its two moments in bf16.",
      "torch", V, FSDP + "_fsdp_param.py: FSDPParam.init_dtype_attrs; torch/optim/adam.py: Adam._init_group",
      runs=True)
def _bf16_model():
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = torch.bfloat16
    m = fsdp2(linear_stack(dtype=bf16), mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.ones(2, 16, dtype=bf16)).float().sum().backward()
    opt.step()
    p = next(m.parameters())
    states = {k: str(v.dtype).removeprefix("torch.") for k, v in opt.state[p].items() if k != "step"}
    ev = {"shard": str(p.dtype).removeprefix("torch."), **states}
    return set(ev.values()) == {"bfloat16"}, ev


@fact("torch.bf16_small_update_rounds_away",
      "In bf16 a weight moves only if its update is at least half a bf16 rounding step (|w| / 256 or less): a "
      "smaller update rounds back to the same weight, a larger one survives.",
      "torch", V, "torch.bfloat16 (8 significant bits, round to nearest even)")
def _bf16_rounding():
    import torch

    one = torch.tensor([1.0], dtype=torch.bfloat16)
    small, large = (one + 2**-9).item(), (one + 2**-7).item()  # half a step at 1.0 is 2**-8 = 1/256
    eps = torch.finfo(torch.bfloat16).eps
    return small == 1.0 and large != 1.0 and eps == 2**-7, {
        "bf16 step at 1.0": eps, "1 + 2**-9 in bf16": small, "1 + 2**-7 in bf16": large}


@fact("torch.fsdp2_reduced_grad_in_shard_dtype",
      "With MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) on fp32 shards, FSDP2 computes and reduces "
      "gradients in bf16, then keeps the reduced gradient shard in the shard's dtype, fp32.",
      "torch", V, FSDP + "_fsdp_collectives.py: foreach_reduce", runs=True)
def _reduced_grad():
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = torch.bfloat16
    m = fsdp2(linear_stack(), mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16))
    m(torch.ones(2, 16)).float().sum().backward()
    p = next(m.parameters())
    ok, src = source_has("torch.distributed.fsdp._fully_shard._fsdp_collectives.foreach_reduce",
                         "reduce_output = _to_dtype_if_needed(reduce_output, orig_dtype)")
    fp = _fsdp_params(m[0])[0]
    ev = {"compute dtype": str(fp.param_dtype), "shard": str(p.dtype), "reduced grad": str(p.grad.dtype), **src}
    return ok and p.dtype == p.grad.dtype == torch.float32 and fp.param_dtype == bf16, ev


@fact("torch.embedding_unused_rows_unchanged",
      "Embedding rows of tokens a batch does not use get a zero gradient, and AdamW with weight decay 0 (the "
      "guide's; torch's default is 0.01) leaves them unchanged.",
      "torch", V, "torch/nn/modules/sparse.py: Embedding; torch/optim/adamw.py: AdamW")
def _embedding():
    import inspect

    import torch

    torch.manual_seed(0)
    e = torch.nn.Embedding(10, 4)
    before = e.weight.detach().clone()
    opt = torch.optim.AdamW(e.parameters(), lr=0.1, weight_decay=0.0)
    e(torch.tensor([1, 2])).sum().backward()
    grad_row = float(e.weight.grad[5].abs().sum())
    opt.step()
    unchanged = torch.equal(e.weight[5], before[5])
    wd = inspect.signature(torch.optim.AdamW).parameters["weight_decay"].default
    return grad_row == 0.0 and unchanged and not torch.equal(e.weight[1], before[1]), {
        "unused row grad": grad_row, "unused row unchanged": unchanged, "AdamW default weight_decay": wd}


@fact("torch.linear_bias_inside_matmul",
      "torch's linear adds the bias inside the matmul (addmm: one rounding), for 3-D inputs too.",
      "torch", V, "aten/src/ATen/native/Linear.cpp: linear (_flatten_nd_linear)")
def _linear():
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 64, generator=g).bfloat16()
    w, b = torch.randn(32, 64, generator=g).bfloat16() / 8, torch.randn(32, generator=g).bfloat16()
    fused = torch.addmm(b, x.reshape(-1, 64), w.t()).view(2, 16, 32)
    twice = x.matmul(w.t()) + b
    same = torch.equal(torch.nn.functional.linear(x, w, b), fused)
    differ = int((torch.nn.functional.linear(x, w, b) != twice).sum())
    return same and differ > 0, {"F.linear == addmm": same, "outputs differing from matmul + bias": differ}


@fact("torch.adam_divides_out_grad_scale",
      "Adam divides out a uniform scaling of the gradient, all but its eps: halving every gradient barely changes "
      "the update.",
      "torch", V, "torch/optim/adam.py: _single_tensor_adam")
def _adam_scale():
    import torch

    def update(scale):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64))
        start, opt = p.detach().clone(), torch.optim.AdamW([p], lr=1e-3, weight_decay=0.0, foreach=False)
        g = torch.randn(64, generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            p.grad = g * scale
            opt.step()
        return p.detach() - start

    a, b = update(1.0), update(0.5)
    rel = float((a - b).abs().max() / a.abs().max())
    return rel < 1e-3, {"relative update change, gradient halved": rel}


@fact("torch.fsdp2_no_sync_accumulates_unreduced",
      "With set_requires_gradient_sync(False), FSDP2 skips the gradient reduction and keeps each rank's unsharded "
      "gradients to sum locally, in bf16 when reduce_dtype equals param_dtype (bf16): it reduces once, when sync "
      "is back on.",
      "torch", V, FSDP + "_fully_shard.py: FSDPModule.set_requires_gradient_sync; _fsdp_param.py: "
      "FSDPParam.init_dtype_attrs, to_accumulated_grad_if_needed", runs=True)
def _no_sync():
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = torch.bfloat16
    m = fsdp2(linear_stack(), mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16))
    m.set_requires_gradient_sync(False)
    m(torch.ones(2, 16)).float().sum().backward()
    fp = _fsdp_params(m[0])[0]
    kept = fp._unsharded_param.grad
    ev = {"reduce_grads": _group_reduce(m[0]), "clamped reduce_dtype": fp.reduce_dtype,
          "kept unsharded grad": None if kept is None else str(kept.dtype),
          "sharded grad": next(m.parameters()).grad}
    ok = ev["reduce_grads"] is False and fp.reduce_dtype is None and kept is not None and kept.dtype == bf16 \
        and ev["sharded grad"] is None
    return ok, ev


def _group_reduce(module):
    return module._get_fsdp_state()._fsdp_param_group.reduce_grads


@fact("torch.fsdp2_offload_policy_per_module",
      "fully_shard takes offload_policy per call: one module can be offloaded and another not, but a "
      "CPUOffloadPolicy always moves the module's parameter shards, their gradients and so the optimizer states "
      "together; there is no policy for one kind of state alone.",
      "torch", V, FSDP + "_fsdp_api.py: CPUOffloadPolicy; _fsdp_param.py: FSDPParam.__init__ (offload_to_cpu)",
      runs=True)
def _per_module():
    import dataclasses

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh("cpu", (1,))
    m = linear_stack()
    fully_shard(m[0], mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(m, mesh=mesh)
    m(torch.ones(2, 16)).sum().backward()
    first, root = ([fp.offload_to_cpu for fp in _fsdp_params(x)] for x in (m[0], m))
    fields = [f.name for cls in (CPUOffloadPolicy, OffloadPolicy) for f in dataclasses.fields(cls)]
    return first == [True, True] and root == [False, False] and fields == ["pin_memory"], {
        "offloaded module": first, "other module": root, "CPUOffloadPolicy fields": fields}




gpu_fact("torch.fsdp2_offload_copies_to_gpu",
         "On a GPU, FSDP2 with CPU offload copies each unit's host shards to the GPU for every all-gather "
         "(forward, and again for backward after resharding) and reduced gradients back to the host.",
         "torch", V, FSDP + "_fsdp_param.py: FSDPParam.all_gather_inputs; _fsdp_collectives.py: foreach_reduce",
         "host-to-device copies exist only with an accelerator")


@fact("torch.fsdp2_casts_unit_inputs",
      "FSDP2's MixedPrecisionPolicy casts the floating-point positional and keyword inputs of every fully_shard "
      "unit to param_dtype before its forward (cast_forward_inputs defaults to True, and Accelerate does not set "
      "it): an fp32 tensor passed to a bf16 unit arrives in bf16.",
      "torch", V, FSDP + "_fsdp_api.py: MixedPrecisionPolicy; _fsdp_state.py: FSDPState._pre_forward",
      runs=True)
def _casts_unit_inputs():
    import dataclasses

    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    seen = {}

    class Unit(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, scale=None):
            seen["x"], seen["scale"] = x.dtype, scale.dtype
            return self.lin(x)

    class Root(torch.nn.Module):  # makes an fp32 tensor outside the unit, as a model's rotary embedding does
        def __init__(self):
            super().__init__()
            self.unit = Unit()

        def forward(self, x):
            return self.unit(x, scale=torch.ones(4))

    bf16 = torch.bfloat16
    root = fsdp2(Root(), mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16))
    root(torch.ones(2, 4))
    default = {f.name: f.default for f in dataclasses.fields(MixedPrecisionPolicy)}["cast_forward_inputs"]
    ev = {k: str(v).removeprefix("torch.") for k, v in seen.items()} | {"cast_forward_inputs default": default}
    return seen == {"x": bf16, "scale": bf16} and default is True, ev
