"""torch (2.13.0) facts the guide states about launching (notebook 00) and sharding (01).

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

import inspect

from .. import fact, gpu_fact
from .._tools import fsdp2, linear_stack, source_has

V = "2.13.0"


def _after_forward(reshard_after_forward) -> dict[str, str]:
    """The FSDP2 state (sharded / unsharded) of each unit's params after one forward, children then root."""
    import torch

    model = fsdp2(linear_stack(3, bias=False), reshard_after_forward=reshard_after_forward)
    model(torch.ones(1, 16)).sum()  # forward only: backward would reshard everything
    units = [*model.children(), model]
    names = [*(f"layer{i}" for i in range(len(units) - 1)), "root"]
    out = {}
    for name, unit in zip(names, units, strict=True):
        group = unit._get_fsdp_state()._fsdp_param_group
        out[name] = group.fsdp_params[0].sharded_state.name.lower() if group else "no params"
    return out


@fact("torch.fsdp2_reshard_after_forward",
      "FSDP2's fully_shard(reshard_after_forward=False) (SHARD_GRAD_OP) keeps each unit's gathered params from "
      "forward until its backward; True (FULL_SHARD) frees them after forward and gathers again in backward.",
      "torch", V, "distributed/fsdp/_fully_shard/_fully_shard.py: fully_shard; _fsdp_param_group.py: post_forward",
      runs=True)
def _reshard():
    keep, free = _after_forward(False), _after_forward(True)
    ok = keep["layer0"] == "unsharded" and free["layer0"] == "sharded"
    return ok, {"False: layer0 after forward": keep["layer0"], "True: layer0 after forward": free["layer0"]}


@fact("torch.fsdp2_root_reshard",
      "With reshard_after_forward=True on every unit, FSDP2 frees each layer's gathered params after forward; "
      "only reshard_after_forward=None (the default) keeps the root's gathered.",
      "torch", V, "distributed/fsdp/_fully_shard/_fully_shard.py: fully_shard (reshard_after_forward=None)",
      runs=True)
def _root():
    import torch

    explicit = _after_forward(True)
    model = fsdp2(linear_stack(2), units=False, reshard_after_forward=None)  # the root alone
    model(torch.ones(1, 16)).sum()
    default_root = model._get_fsdp_state()._fsdp_param_group.fsdp_params[0].sharded_state.name.lower()
    ok = explicit["layer0"] == explicit["layer1"] == "sharded" and default_root == "unsharded"
    return ok, {"True: layers": explicit["layer0"], "None: root": default_root}


@fact("torch.fsdp1_sharding_strategies",
      "FSDP1's sharding strategies are FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD and a private "
      "_HYBRID_SHARD_ZERO2; none shards only the optimizer state (ZeRO-1).",
      "torch", V, "distributed/fsdp/api.py: ShardingStrategy")
def _strategies():
    from torch.distributed.fsdp import ShardingStrategy

    names = [s.name for s in ShardingStrategy]
    return names == ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"], {
        "ShardingStrategy": ", ".join(names)}


@fact("torch.hybrid_shard_replicates",
      "HYBRID_SHARD shards within a node (a group) and replicates across nodes; FSDP2 spells it as a 2-D "
      "(replicate, shard) mesh.",
      "torch", V, "distributed/fsdp/api.py: ShardingStrategy; _fully_shard/_fully_shard.py: fully_shard (mesh)")
def _hybrid():
    from torch.distributed.fsdp import ShardingStrategy, fully_shard

    doc = " ".join(inspect.getdoc(ShardingStrategy).split())
    fdoc = " ".join(inspect.getdoc(fully_shard).split())
    a = "``HYBRID_SHARD``: Apply ``FULL_SHARD`` within a node, and replicate parameters across nodes" in doc
    b = "replicated across the 0th dim (HSDP) with ``(Replicate(), Shard(0))``" in fdoc
    return a and b, {"ShardingStrategy doc": "FULL_SHARD within a node, replicate across nodes" if a else "changed",
                     "fully_shard doc": "2-D mesh: (Replicate(), Shard(0))" if b else "changed"}


@fact("torch.fsdp2_cpu_offload_all",
      "FSDP2's CPUOffloadPolicy moves parameters, gradients and optimizer states to the CPU together; it has no "
      "param-only, optimizer-only or NVMe option.",
      "torch", V, "distributed/fsdp/_fully_shard/_fsdp_api.py: CPUOffloadPolicy")
def _offload():
    import dataclasses

    from torch.distributed.fsdp import CPUOffloadPolicy

    doc = " ".join(inspect.getdoc(CPUOffloadPolicy).split())
    fields = [f.name for f in dataclasses.fields(CPUOffloadPolicy)]
    ok = "offloads parameters, gradients, and optimizer states to CPU" in doc and fields == ["pin_memory"]
    return ok, {"fields": ", ".join(fields), "doc": "offloads parameters, gradients, and optimizer states"}


@fact("torch.adam_state",
      "torch's Adam/AdamW keeps, per parameter, two moments in the parameter's dtype and a step counter (a 0-d "
      "float32 tensor, 4 bytes).",
      "torch", V, "optim/adam.py: Adam._init_group")
def _adam():
    import torch

    m = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    st = opt.state[m.weight]
    ev = {"exp_avg": str(st["exp_avg"].dtype), "exp_avg_sq": str(st["exp_avg_sq"].dtype),
          "step": f"{st['step'].dtype}, shape {tuple(st['step'].shape)}"}
    return ev == {"exp_avg": "torch.float32", "exp_avg_sq": "torch.float32", "step": "torch.float32, shape ()"}, ev


@fact("torch.meta_no_storage",
      "A tensor on the meta device has a shape and dtype but no data: building a model there allocates no memory.",
      "torch", V, "torch/_meta_registrations.py (the meta device)")
def _meta():
    import torch

    t = torch.empty(10**12, device="meta")  # 4 TB if it were allocated
    return t.is_meta and t.shape[0] == 10**12, {"shape": tuple(t.shape), "is_meta": t.is_meta}


@fact("torch.torchrun_sets_rank_env",
      "torchrun's agent puts RANK and WORLD_SIZE (and MASTER_ADDR, MASTER_PORT) into each worker's environment.",
      "torch", V, "distributed/elastic/agent/server/local_elastic_agent.py: LocalElasticAgent._start_workers")
def _rank_env():
    return source_has("torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent._start_workers",
                      '"RANK": str(worker.global_rank)', '"WORLD_SIZE": str(worker.world_size)',
                      '"MASTER_ADDR": worker_group.master_addr', '"MASTER_PORT": str(worker_group.master_port)')


@fact("torch.standalone_free_port",
      "torchrun --standalone starts its own rendezvous on localhost port 0 (a free port the OS picks) with a fresh "
      "id, so two standalone jobs on one machine do not collide.",
      "torch", V, "distributed/run.py: run")
def _standalone():
    return source_has("torch.distributed.run.run", 'if args.standalone: args.rdzv_backend = "c10d" '
                      'args.rdzv_endpoint = "localhost:0" args.rdzv_id = str(uuid.uuid4())')


@fact("torch.multinode_static_rdzv",
      "On several machines torchrun takes --nnodes, --node_rank and a rendezvous address (--master_addr, "
      "--master_port; the default rendezvous is 'static').",
      "torch", V, "distributed/run.py: get_args_parser")
def _multinode():
    from torch.distributed.run import get_args_parser

    a = get_args_parser().parse_args(["--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1", "x.py"])
    ev = {"nnodes": a.nnodes, "node_rank": a.node_rank, "master_addr": a.master_addr, "rdzv_backend": a.rdzv_backend}
    return ev == {"nnodes": "2", "node_rank": 1, "master_addr": "10.0.0.1", "rdzv_backend": "static"}, ev


@fact("torch.torchrun_failure_report",
      "When a worker exits with an error, torchrun raises ChildFailedError, whose report names the root cause "
      "(first observed failure).",
      "torch", V, "distributed/elastic/multiprocessing/errors/__init__.py: ChildFailedError.format_msg")
def _failure():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    err = ChildFailedError("helpers.train", {0: ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file="")})
    msg = err.format_msg()
    return "Root Cause (first observed failure)" in msg, {"report has": "Root Cause (first observed failure)"
                                                          if "Root Cause" in msg else msg[:80]}


@fact("torch.import_rss",
      "A process that only imports torch already holds over 100 MiB of anonymous memory (RssAnon) on a CPU.",
      "torch", V, "torch/__init__.py (the libraries it loads)")
def _rss():
    import subprocess
    import sys

    code = ("import torch; print([l for l in open('/proc/self/status') if l.startswith('RssAnon')][0].split()[1])")
    kib = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             timeout=60).stdout.strip())
    return kib > 100 * 1024, {"RssAnon after import torch (MiB)": round(kib / 1024)}


gpu_fact("torch.nccl_one_gpu_per_rank",
         "NCCL needs one GPU per rank: two ranks of one communicator cannot share a GPU (not checked here).",
         "torch", V, "distributed/run.py (module docstring: nproc_per_node <= GPUs); ProcessGroupNCCL",
         "a CPU has no NCCL: two nccl ranks on one GPU fail with 'Duplicate GPU detected'")
gpu_fact("torch.nccl_sum_order",
         "Under nccl with more than 2 ranks, an all-reduce and a reduce-scatter may add the ranks' gradients in "
         "another order, so bf16 sums can differ in the last bit (not checked here).",
         "torch", V, "ProcessGroupNCCL (NCCL's ring/tree algorithms)", "needs 4 GPUs and nccl")
gpu_fact("torch.shard_sizes_device_independent",
         "How much each rank holds depends on the number of ranks, not on the device: FSDP2 and DeepSpeed pad and "
         "split shards the same way on a GPU (not run on GPUs here).",
         "torch", V, "distributed/fsdp/_fully_shard/_fsdp_param.py: FSDPParam._init_sharded_param",
         "comparing with a 4-GPU job's rank needs 4 GPUs")
