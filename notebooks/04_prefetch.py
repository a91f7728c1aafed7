# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Prefetch, units and compile: when the bytes move, seen on per-rank timelines
#
# **The question.** A sharded model must gather its parameters before it can compute with them.
# FSDP lets you say *when* (explicit forward/backward prefetch, resharding after forward) and
# *in what pieces* (the wrap policy: which modules are units). <!-- fact: torch.fsdp2_explicit_prefetch_api -->
# DeepSpeed ZeRO-3 gathers each module's own parameters when that module runs; thresholds
# (`stage3_prefetch_bucket_size`, `stage3_max_live_parameters`, ...) decide how much more it
# prefetches and when it releases. <!-- fact: deepspeed.zero3_gathers_per_module --> What does each setting change in the order, number and size of collectives, and
# what does it cost in memory?
#
# **What we run.** Short jobs with `--profile`: every rank records a `torch.profiler` trace of
# two steps after warm-up (`notebooks/runs/04_*/trace_rank{r}.json`). We read the traces
# (`helpers.nb.traces`) and draw, per rank, what the training thread computed and what went over
# the wire (`helpers.nb.plots.timeline`).
#
# | setting | config |
# |---|---|
# | FSDP, no prefetch | `launch_configs/fsdp/full_shard_no_prefetch.yaml` |
# | FSDP, forward + backward prefetch | `launch_configs/fsdp/full_shard_prefetch.yaml` |
# | ZeRO-3, no prefetch, release after use | `launch_configs/deepspeed/zero3_no_prefetch.yaml` |
# | ZeRO-3, prefetch by thresholds | `launch_configs/deepspeed/zero3_prefetch.yaml` |
# | FSDP units: size-based, none, no reshard | `fsdp/full_shard_size_wrap.yaml`, `fsdp/full_shard_no_wrap.yaml`, `fsdp/shard_grad_op.yaml` |
#
# **An honest word about this machine.** On a GPU (not checked here), collectives run on their own
# CUDA streams, so a prefetched all-gather travels while the previous layer computes. <!-- fact: torch.gpu_collectives_own_stream --> On a CPU there are no streams.
# Gloo runs collectives on its own worker threads, <!-- fact: torch.gloo_worker_threads --> so an
# all-gather issued asynchronously (DeepSpeed's) can proceed while the training thread computes,
# on the same few cores (the overlap cell of section 3 measures how much of that happens here); <!-- fact: deepspeed.zero3_async_all_gather --> FSDP2 issues its gathers
# synchronously, so the training thread waits for each. <!-- fact: torch.fsdp2_gathers_synchronous -->
# Here FSDP's prefetch *reorders* the collectives and ZeRO-3's prefetch bucket *merges* them (one
# gather instead of one per module); <!-- fact: deepspeed.zero3_bucket_gathers_once --> the traces show both exactly.
# Step times are printed with their spreads; one run each calls no verdict. On a GPU the same cells would show
# the overlap itself (written for, not yet run on, GPUs).

# %%
import os
import re
from pathlib import Path

from helpers import facts, nb
from helpers.core.config import load_job_config
from helpers.core.models import resolve_model
from helpers.job import wrap
from helpers.nb import plots, results, traces
from helpers.nb.claims import claim, step_times, timing

SIZE = nb.setup()  # "quick" under `make test`: the same cells, smaller batches, no compile section
facts.show("torch.fsdp2_gathers_synchronous", "deepspeed.zero3_async_all_gather")  # who waits for a gather on gloo
GPUS = nb.gpu_count()
NPROC = GPUS if GPUS else 2
MODEL = "small" if GPUS and SIZE == "full" else "tiny"  # profiled small-model steps take minutes on a CPU
BATCH = "--micro-batch 4 --seq-len 32" if SIZE == "quick" else "--micro-batch 8 --seq-len 64"
ARGS = f"--model {MODEL} --steps 4 {BATCH} --profile"  # --profile records steps 2 and 3
os.environ.update(NPROC=str(NPROC), ARGS=ARGS, SIZE=SIZE)
print(f"size={SIZE}: model {MODEL} on {NPROC} ranks ({'GPU' if GPUS else 'CPU, gloo'}); {ARGS}")

# %% [markdown]
# ## 1 · Prefetch on and off, both backends
#
# The FSDP pair differs only in `fsdp_forward_prefetch` / `fsdp_backward_prefetch`, which
# `helpers.train` maps onto FSDP2's explicit prefetch; `accelerate launch` ignores both under
# `fsdp_version: 2`, <!-- fact: accelerate.fsdp2_ignores_prefetch_keys --> where FSDP2 still prefetches
# in backward by default. <!-- fact: torch.fsdp2_default_backward_prefetch --> The ZeRO-3 pair differs in
# its `stage3_*` thresholds and `overlap_comm`. Both ZeRO-3
# configs set `stage3_param_persistence_threshold: 0`, so every parameter is sharded, as in
# FSDP. <!-- fact: deepspeed.zero3_persistence_threshold_zero -->

# %% language="bash"
# for cfg in fsdp/full_shard_no_prefetch fsdp/full_shard_prefetch deepspeed/zero3_no_prefetch deepspeed/zero3_prefetch; do
#     torchrun --standalone --nproc_per_node $NPROC -m helpers.train --config launch_configs/$cfg.yaml \
#         --out notebooks/runs/04_$(basename $cfg) $ARGS | tail -n 1
# done

# %%
PF = {"FSDP no prefetch": "04_full_shard_no_prefetch", "FSDP prefetch": "04_full_shard_prefetch",
      "ZeRO-3 no prefetch": "04_zero3_no_prefetch", "ZeRO-3 prefetch": "04_zero3_prefetch"}
pf = {k: results.load_run(f"notebooks/runs/{v}") for k, v in PF.items()}
facts.show("accelerate.fsdp2_ignores_prefetch_keys")  # why the FSDP pair needs helpers.train, not accelerate launch
plots.timeline(list(pf.values()), labels=list(pf));

# %% [markdown]
# **Reading it.** Each panel is one step; per rank, the upper lane is compute (the training
# thread's operators, including autograd nodes that call a collective and wait in it), the
# lower lane communication (gloo's transfers); shaded: forward,
# backward, optimizer step. Each FSDP gather brings one unit (the input embedding, a decoder
# block, or the final norm + head: the units `accelerate launch` makes from these files,
# section 4); <!-- fact: accelerate.fsdp2_embedding_and_tail_units --> with prefetch, a unit's pre-forward
# also issues the next unit's gather before its own compute. <!-- fact: torch.fsdp2_forward_prefetch_order -->
# ZeRO-3 without prefetch gathers each module's own parameters when it runs (here one tensor per
# module), in forward and again in backward: many small transfers. <!-- fact: deepspeed.zero3_gathers_per_module -->
# ZeRO-3 with its default-sized prefetch bucket (5e7 elements, bigger than this whole model)
# fetches everything in the first gather and keeps each parameter until its last use in
# backward: one all-gather per step. <!-- fact: deepspeed.zero3_bucket_gathers_once --> Its
# `stage3_max_reuse_distance` (printed below) decides that; `stage3_max_live_parameters` only caps
# the prefetch. <!-- fact: deepspeed.zero3_release_not_by_max_live -->
#
# None of this changes the numbers: all four runs train identically.

# %%
losses = {k: r.summary["losses"] for k, r in pf.items()}
facts.show("deepspeed.zero3_bucket_gathers_once", "deepspeed.zero3_release_not_by_max_live")
print("stage3_max_reuse_distance in zero3_prefetch.json:",
      pf["ZeRO-3 prefetch"].config["deepspeed"]["json"]["zero_optimization"].get("stage3_max_reuse_distance",
                                                                                  "unset (DeepSpeed's default 1e9)"))
claim("all four runs train identically (prefetch moves bytes earlier, not values)",
      len({tuple(v) for v in losses.values()}) == 1, losses=[round(x, 4) for x in losses["FSDP prefetch"]])

# %% [markdown]
# ### What FSDP's prefetch reorders
#
# FSDP2 marks its work in the trace (`FSDP::all_gather (model.layers.1)`,
# `FSDP::post_forward (model.layers.0)`, ...). <!-- fact: torch.fsdp2_trace_labels --> Without forward
# prefetch, block 1 is gathered when its own forward starts, after block 0 has finished; with it,
# block 0's forward first issues block 1's all-gather (`set_modules_to_forward_prefetch`), before
# block 0 computes (on gloo FSDP2 waits for it; on a GPU it travels during that compute). <!-- fact: torch.fsdp2_forward_prefetch_order -->

# %%
def gather_vs_compute(run):
    """ms: when block 1's all-gather starts, when block 0's forward ends (rank 0, first profiled step)."""
    return (traces.annotation_start(run, "FSDP::all_gather (model.layers.1)"),
            traces.annotation_start(run, "FSDP::post_forward (model.layers.0)"))


facts.show("torch.fsdp2_forward_prefetch_order")  # the same order on one rank, two Linear units
ag0, done0 = gather_vs_compute(pf["FSDP no prefetch"])
claim("without prefetch, block 1 is gathered after block 0's forward is done", ag0 > done0,
      gather_ms=ag0, block0_done_ms=done0)
ag1, done1 = gather_vs_compute(pf["FSDP prefetch"])
claim("with forward prefetch, block 1's gather starts before block 0's forward is done", ag1 < done1,
      gather_ms=ag1, block0_done_ms=done1)

# %% [markdown]
# ## 2 · Collectives per step, checked against the units
#
# FSDP's count follows from its units: forward gathers each unit once; backward gathers again
# every unit that resharded after forward (the embedding and the blocks; the final norm + head
# unit stays gathered, needed again at once, and the root holds no parameters here); <!-- fact: accelerate.fsdp2_keeps_root_tail_gathered -->
# gradients are reduce-scattered once per unit that holds parameters. Prefetch changes *when*,
# not *how many*. <!-- fact: torch.fsdp2_collective_counts -->
# `helpers.job.wrap.expected_collectives` writes that down; the table is what the traces counted
# (rank 0, one step; MB = unsharded bytes moved, bf16 for gathers).

# %%
tab = traces.collective_table(list(pf.values()), labels=list(pf))
tab["step_time_ms"] = [r.summary["step_time_s"] * 1e3 for r in pf.values()]
tab.round(2)

# %%
units_tf = wrap.check_wrap_policy(load_job_config("launch_configs/fsdp/full_shard_prefetch.yaml"),
                                  resolve_model(MODEL))
want = wrap.expected_collectives(units_tf, reshard_after_forward=True)
n_tensors = len(list(wrap.meta_model(resolve_model(MODEL)).parameters()))
fsdp_rows = tab.loc[["FSDP no prefetch", "FSDP prefetch"]]
claim(f"FSDP's {len(units_tf)} units predict its collectives exactly, with and without prefetch",
      (fsdp_rows.all_gathers == want["all_gathers"]).all()
      and (fsdp_rows.reduce_scatters == want["reduce_scatters"]).all()
      and ((fsdp_rows.all_gather_MB * 1e6 - want["all_gather_bytes"]).abs() < 1e3).all(),
      expected=want, counted=fsdp_rows[["all_gathers", "reduce_scatters"]].to_dict("index"))
claim(f"ZeRO-3 without prefetch gathers each of the {n_tensors} parameter tensors on its own, in forward and "
      "again in backward", tab.loc["ZeRO-3 no prefetch", "all_gathers"] == 2 * n_tensors,
      all_gathers=int(tab.loc["ZeRO-3 no prefetch", "all_gathers"]))
claim("ZeRO-3 with a prefetch bucket larger than the model gathers once per step",
      tab.loc["ZeRO-3 prefetch", "all_gathers"] == 1, all_gathers=int(tab.loc["ZeRO-3 prefetch", "all_gathers"]))

# %% [markdown]
# ## 3 · What prefetch holds: the size of one gather
#
# A prefetched unit is gathered earlier, so it is held longer, next to the one computing. <!-- fact: torch.fsdp2_forward_prefetch_order -->
# ZeRO-3's big prefetch bucket brings the whole model in with its first gather; <!-- fact: deepspeed.zero3_bucket_gathers_once -->
# without prefetch it gathers one module's parameters at a time (here one tensor). <!-- fact: deepspeed.zero3_gathers_per_module -->
# FSDP's forward prefetch issues the next unit's gather before the current unit computes (on a
# GPU it travels during that compute; on gloo FSDP2 waits for it), so by design it can hold
# one more unit at a time (not measured here: the traces show when a gather starts, not
# how long its bytes stay). `largest_all_gather_MB` (from the traces) is what one gather puts in
# memory at once.
#
# `peak_allocated_MB` is the most the allocator held during the profiled steps (the CPU stand-in
# for `torch.cuda.max_memory_allocated`). We show it and claim nothing from it: one profiled job
# per setting, and identical jobs' peaks differ (notebook 08 prints by how much).

# %%
model_mb = sum(u.num_params for u in units_tf) * 2 / 1e6  # the whole model in bf16
block_mb = max(u.num_params for u in units_tf if u.cls.endswith("DecoderLayer")) * 2 / 1e6  # one block in bf16
big = tab["largest_all_gather_MB"]
claim("ZeRO-3's prefetch bucket gathers the whole model at once", abs(big["ZeRO-3 prefetch"] - model_mb) < 1e-3,
      largest_gather_MB=big["ZeRO-3 prefetch"], model_MB=model_mb)
tensor_mb = max(q.numel() for q in wrap.meta_model(resolve_model(MODEL)).parameters()) * 2 / 1e6  # bf16
claim("without prefetch ZeRO-3's largest gather is the largest single tensor, well under the model (the count "
      "above shows one gather per tensor)",
      abs(big["ZeRO-3 no prefetch"] - tensor_mb) < 1e-3, largest_gather_MB=big["ZeRO-3 no prefetch"],
      largest_tensor_MB=tensor_mb)
claim("FSDP's largest single gather is one unit, prefetch or not, and that unit is a decoder block",
      big["FSDP prefetch"] == big["FSDP no prefetch"] and abs(big["FSDP prefetch"] - block_mb) < 1e-3
      and block_mb == max(u.num_params for u in units_tf) * 2 / 1e6,
      largest_gather_MB=big["FSDP prefetch"], block_MB=block_mb)

# %% [markdown]
# **Step time.** Each job's profiled steps, prefetch against no prefetch: medians and quartiles
# (two steps each, one run each: a rough look; one run each on a shared machine calls no
# verdict, notebook 07 says why). ZeRO-3 without prefetch makes one gloo call per
# module (here per tensor), in forward and again in backward, where the bucket makes one; <!-- fact: deepspeed.zero3_gathers_per_module -->
# fewer calls need not mean less time (one large gather moves the whole model at once; the
# ratio below is one run each).
# FSDP's prefetch moves gathers earlier, but on gloo FSDP2 waits for each one (the intro), so
# by design it reorders them here and cannot hide them behind compute; <!-- fact: torch.fsdp2_gathers_synchronous --> what the
# ratio below and the overlap cell show beyond that, one run each cannot say. The next table shows where the
# time went. The compute lane also moves with communication: it counts the autograd nodes that
# wait on a collective (next section); with two steps a job, part may also be noise:

# %%
for a, b in (("FSDP prefetch", "FSDP no prefetch"), ("ZeRO-3 prefetch", "ZeRO-3 no prefetch")):
    print(f"{timing(a, step_times(pf[a]), b, step_times(pf[b])).measured()}, one run each")

# %% [markdown]
# ### Compute and communication at the same time
#
# The time a rank was both computing and communicating (`traces.overlap_ms`), and the compute
# operator it fell in (`traces.overlap_by_op`). On gloo, do not read it as overlap: FSDP2
# reduces gradients from the backward of an autograd node, `RegisterPostBackwardFunction`, <!-- fact: torch.fsdp2_post_backward_in_autograd_node -->
# and ZeRO-3 gathers for backward from another, `PreBackwardFunctionForModule`; <!-- fact: deepspeed.zero3_backward_gather_in_autograd_node -->
# the compute lane counts such a node for as long as the training thread waits in it, and
# the cell shows how much of "both at once" is that waiting.
# (ZeRO-3's gathers are asynchronous, FSDP2's synchronous.) <!-- fact: deepspeed.zero3_async_all_gather -->
# On a GPU (not checked here) it is the overlap prefetch buys. <!-- fact: torch.gpu_collectives_own_stream -->

# %%
facts.show("torch.fsdp2_post_backward_in_autograd_node", "deepspeed.zero3_backward_gather_in_autograd_node")
HOOKS = ("RegisterPostBackwardFunctionBackward", "PreBackwardFunctionForModuleBackward")  # the two nodes' names
hook_share = {}
for name, r in pf.items():
    busy, by_op = traces.busy_ms(r), traces.overlap_by_op(r)
    hooks = by_op[[any(h in op for h in HOOKS) for op in by_op.index]].sum()
    if by_op.sum() > 1:
        hook_share[name] = round(hooks / by_op.sum(), 2)
    print(f"{name:20s} comm {busy['comm']:7.1f} ms, compute {busy['compute']:7.1f} ms, both at once "
          f"{by_op.sum():7.1f} ms (rank 0, {len(r.summary['profiled_steps'])} steps), of it in the backward nodes "
          f"above {hooks:6.1f} ms")
claim("wherever a rank both computed and communicated for over 1 ms, a good part of that time (over a quarter) "
      "fell inside an autograd node that waits on the collective", all(v > 0.25 for v in hook_share.values()),
      share_in_those_nodes=hook_share)

# %% [markdown]
# ## 4 · The unit choice: what FSDP asks you and DeepSpeed does not
#
# `fsdp_auto_wrap_policy` decides which modules become units, as `accelerate launch` decides with
# `fsdp_version: 2` (`helpers.job.wrap` calls Accelerate's own policy function):
# `TRANSFORMER_BASED_WRAP` one per decoder block (the class comes from the model's
# `_no_split_modules` unless `fsdp_transformer_layer_cls_to_wrap` names it), <!-- fact: accelerate.fsdp2_transformer_policy_units -->
# `SIZE_BASED_WRAP` every module holding *more than* `fsdp_min_num_params` parameters in total,
# children included (so a block and `model.model` become units too, around the smaller units
# inside them), <!-- fact: accelerate.fsdp2_size_policy_counts_children --> `NO_WRAP` no policy units.
# Whatever the policy, Accelerate then gives the input embedding a unit (with tied embeddings it
# joins the tail) and the final norm + head one more, which stays gathered from forward to
# backward, unless the policy has already made them units (`SIZE_BASED_WRAP` here makes
# `lm_head` a unit that reshards like any other); the root takes what is left. <!-- fact: accelerate.fsdp2_embedding_and_tail_units -->
# `fsdp_reshard_after_forward: false` (`shard_grad_op.yaml`) keeps gathered blocks from forward
# to backward. <!-- fact: torch.fsdp2_reshard_after_forward --> DeepSpeed asks for no units: it gathers
# each module's parameters as it runs (`set_z3_leaf_modules` can merge a subtree); thresholds
# decide the rest. <!-- fact: deepspeed.zero3_leaf_modules -->
#
# The "transformer blocks" row is section 1's prefetch run (`full_shard_prefetch.yaml`); the
# other three configs do not set forward prefetch, so their step times and peaks are not a
# like-for-like comparison with it (their counts are, as prefetch changes no count).
#
# Where the guide differs from `accelerate launch`, on purpose, the job log says so in a `note:`
# line: with `SIZE_BASED_WRAP` the policy also picks `model.layers` (a `ModuleList`), which
# torch's `fully_shard` refuses (there `accelerate launch` stops with an error), <!-- fact: torch.fsdp2_refuses_modulelist -->
# and the final norm sits inside the `model.model` unit, where a unit of its own fails at
# forward; <!-- fact: torch.fsdp2_unit_inside_unit_fails --> the guide
# leaves both to the unit around them.

# %% language="bash"
# for cfg in full_shard_size_wrap full_shard_no_wrap shard_grad_op; do
#     torchrun --standalone --nproc_per_node $NPROC -m helpers.train --config launch_configs/fsdp/$cfg.yaml \
#         --out notebooks/runs/04_$cfg $ARGS | tail -n 1
# done

# %%
WRAP = {"transformer blocks": ("fsdp/full_shard_prefetch", "04_full_shard_prefetch"),
        "size-based": ("fsdp/full_shard_size_wrap", "04_full_shard_size_wrap"),
        "no wrap": ("fsdp/full_shard_no_wrap", "04_full_shard_no_wrap"),
        "blocks, no reshard": ("fsdp/shard_grad_op", "04_shard_grad_op")}
wr = {k: results.load_run(f"notebooks/runs/{d}") for k, (_, d) in WRAP.items()}
units = {k: wrap.check_wrap_policy(load_job_config(f"launch_configs/{c}.yaml"), resolve_model(MODEL))
         for k, (c, _) in WRAP.items()}
utab = traces.collective_table([*wr.values(), pf["ZeRO-3 prefetch"], pf["ZeRO-3 no prefetch"]],
                               labels=[*wr, "ZeRO-3 prefetch", "ZeRO-3 no prefetch"])
utab.insert(1, "units", [len(u) for u in units.values()] + [None, None])
utab.insert(2, "expected_all_gathers", [wrap.expected_collectives(
    u, wr[k].config["fsdp"]["reshard_after_forward"])["all_gathers"] for k, u in units.items()] + [None, None])
utab.insert(3, "expected_reduce_scatters", [wrap.expected_collectives(u, True)["reduce_scatters"]
                                           for u in units.values()] + [None, None])
utab = utab.astype({c: "Int64" for c in ("units", "expected_all_gathers", "expected_reduce_scatters")})  # counts
utab["MB_per_all_gather"] = utab.all_gather_MB / utab.all_gathers
print("\n".join(ln for ln in (wr["size-based"].path / "log.txt").read_text().splitlines()
                if ln.startswith("note: fsdp_auto_wrap_policy")))  # where the guide differs, the job said so
utab.round(3)

# %%
fig, (left, right) = plots.plt.subplots(1, 2)
plots.collective_bars(utab, ax=left)
plots.backend_bars(right, list(utab.index), list(utab.peak_allocated_MB), ["fsdp"] * len(wr) + ["deepspeed"] * 2,
                   zero=False)
right.tick_params(axis="x", rotation=20, labelsize=8)
right.set(ylabel="MB", title="peak allocated, rank 0 (profiled steps)")
fig.tight_layout()

# %% [markdown]
# **Reading it.** Smaller units mean more, smaller all-gathers; without policy units the root
# gathers every decoder block at once (`largest_all_gather_MB`) and, during forward and
# backward, every rank holds all of them. <!-- fact: torch.fsdp2_root_takes_the_rest --> Not resharding
# after forward saves the backward gathers and keeps the blocks gathered in between. <!-- fact: torch.fsdp2_reshard_after_forward --> We claim nothing from the allocator's peak between unit choices (one job each, and
# identical jobs' peaks differ). The counts and sizes are exactly what the units predict:

# %%
rows = utab.loc[list(wr)]
want_mb = {k: wrap.expected_collectives(u, wr[k].config["fsdp"]["reshard_after_forward"])["all_gather_bytes"] / 1e6
           for k, u in units.items()}
claim("every unit choice's collectives are exactly what its units predict, in count and in bytes gathered",
      (rows.all_gathers == rows.expected_all_gathers).all()
      and (rows.reduce_scatters == rows.expected_reduce_scatters).all()
      and all(abs(rows.all_gather_MB[k] - want_mb[k]) < 1e-3 for k in rows.index),
      all_gathers=rows.all_gathers.astype(int).to_dict(), expected=rows.expected_all_gathers.astype(int).to_dict(),
      all_gather_MB=rows.all_gather_MB.round(3).to_dict(), expected_MB={k: round(v, 3) for k, v in want_mb.items()})
claim("smaller units mean more, smaller all-gathers (size-based against transformer blocks)",
      utab.loc["size-based", "units"] > utab.loc["transformer blocks", "units"]
      and utab.loc["size-based", "MB_per_all_gather"] < utab.loc["transformer blocks", "MB_per_all_gather"],
      units=utab.units[:2].to_dict(), MB_per_gather=utab.MB_per_all_gather[:2].round(4).to_dict())
blocks_mb = units["no wrap"][-1].num_params * 2 / 1e6  # the root: all decoder blocks
claim("without policy units there are 3 units (embedding, norm + head, the root) and the root gathers every "
      "decoder block at once", utab.loc["no wrap", "units"] == 3
      and abs(utab.loc["no wrap", "largest_all_gather_MB"] - blocks_mb) < 1e-3 and blocks_mb > 0.5 * model_mb,
      largest_gather_MB=utab.loc["no wrap", "largest_all_gather_MB"], blocks_MB=blocks_mb)
claim("not resharding after forward saves the backward gathers",
      utab.loc["blocks, no reshard", "all_gathers"] < utab.loc["transformer blocks", "all_gathers"],
      no_reshard=int(utab.loc["blocks, no reshard", "all_gathers"]),
      reshard=int(utab.loc["transformer blocks", "all_gathers"]))
log = (wr["size-based"].path / "log.txt").read_text()
claim("the size-based job's log says where the guide differs from accelerate launch",
      "model.layers (ModuleList) passes Accelerate's policy" in log and "model.norm is inside a unit" in log)

# %% [markdown]
# ## 5 · `--compile`
#
# `helpers.train --compile` compiles each decoder block in place *before* `fully_shard` (FSDP2);
# FSDP's hooks (gather before, reshard after) then run inside the compiled call, but torch marks
# them dynamo-disabled, so they stay out of the graph. <!-- fact: torch.fsdp2_hooks_not_compiled --> On
# DeepSpeed it calls the engine's `compile()`, which compiles the wrapped module. <!-- fact: deepspeed.engine_compile_module -->
# ZeRO-3 keeps two per-module hooks out of dynamo (the pre-forward gather and the post-backward
# release); its other hooks, the backward gather's setup among them, are traced: <!-- fact: deepspeed.zero3_hooks_and_dynamo -->
# they change from call to call, so dynamo recompiles until its recompile limit (the fact
# printed below) and then leaves them eager, <!-- fact: torch.dynamo_recompile_limit --> with a warning the cells count.
#
# Why FSDP1 needed `fsdp_use_orig_params: true` for this: FSDP1 flattened a unit's parameters
# into one `FlatParameter`; `use_orig_params=True` kept the original `nn.Parameter`s visible,
# and torch requires it to use `torch.compile` with FSDP1. <!-- fact: torch.fsdp1_use_orig_params_for_compile -->
# FSDP2 never flattens: every parameter stays itself (a `DTensor` shard), so there is nothing to
# ask for, <!-- fact: torch.fsdp2_params_stay_dtensors --> and Accelerate ignores the key under
# `fsdp_version: 2`. <!-- fact: accelerate.fsdp2_ignores_use_orig_params -->
#
# Compiling costs a long first step (dynamo traces and inductor generates code for every graph: <!-- fact: torch.compile_on_first_call -->
# the first step's time is printed below), so this section runs at full size only (`GUIDE_SIZE=quick` skips it; the
# committed notebook shows the full run, on the tiny model). On this CPU we check that
# compiled training trains, that the two backends stay close, that the first step carries the
# compile time, and which functions dynamo gave up on.

# %% language="bash"
# if [ "$SIZE" = full ]; then
#   for cfg in fsdp/full_shard deepspeed/zero3; do
#     out=notebooks/runs/04_compile_$(basename $cfg)
#     torchrun --standalone --nproc_per_node $NPROC -m helpers.train --config launch_configs/$cfg.yaml \
#         --out $out --model tiny --steps 6 --compile 2> $out.stderr | tail -n 1
#     grep '^error' $out.stderr  # a failed job says why here
#     echo "  dynamo recompile-limit warnings (all ranks): $(grep -c 'recompile_limit' $out.stderr)"
#   done
# else
#   echo "GUIDE_SIZE=quick: compile section skipped (minutes of inductor builds on a CPU)"
# fi

# %%
if SIZE == "full":
    comp = {k: results.load_run(f"notebooks/runs/04_compile_{k}") for k in ("full_shard", "zero3")}
    for k, r in comp.items():
        t = r.metrics.step_time_s
        print(f"{k:10s} compiled: first step {t.iloc[0]:6.1f} s (compiling), then median {t.iloc[1:].median():.2f} s; "
              f"final loss {r.summary['final_loss']:.4f}")
    f, d = (comp[k].summary["losses"] for k in ("full_shard", "zero3"))
    claim("compiled FSDP and DeepSpeed train alike (within 0.02 per step; uncompiled they are bit-identical, "
          "notebook 02; compiled, each side runs its own graphs: per block vs the whole engine)",
          all(abs(a - b) < 2e-2 for a, b in zip(f, d)), max_gap=max(abs(a - b) for a, b in zip(f, d)))
    claim("the compiled runs learn", f[-1] < f[0] - 0.5, first=f[0], last=f[-1])
    claim("the first step carries the compile time (over 3x the median of the rest)",
          all(r.metrics.step_time_s.iloc[0] > 3 * r.metrics.step_time_s.iloc[1:].median() for r in comp.values()),
          first_over_median={k: round(r.metrics.step_time_s.iloc[0] / r.metrics.step_time_s.iloc[1:].median(), 1)
                             for k, r in comp.items()})
    facts.show("torch.dynamo_recompile_limit")
    # each warning names the function dynamo gave up on on its next line: "function: 'NAME' (FILE:LINE)"
    gave_up = {k: re.findall(r"recompile_limit.*\n.*function: '(\w+)' \(([^:]+)",
                             Path(f"notebooks/runs/04_compile_{k}.stderr").read_text()) for k in comp}
    print({k: sorted({f"{name} ({Path(f).parent.name}/{Path(f).name})" for name, f in v}) for k, v in gave_up.items()})
    claim("ZeRO-3's per-module hooks (DeepSpeed's zero/ code) hit dynamo's recompile limit, and nothing else did; "
          "FSDP's run never hit it", gave_up["zero3"] and all("deepspeed/runtime/zero/" in f for _, f in gave_up["zero3"])
          and not gave_up["full_shard"], warnings={k: len(v) for k, v in gave_up.items()})
else:
    print("skipped at GUIDE_SIZE=quick")

# %% [markdown]
# ## Recap: measured on this machine

# %%
print(f"model {MODEL}, {NPROC} ranks, {'GPU' if GPUS else 'CPU (gloo)'}")
print(f"FSDP, transformer-block units ({len(units_tf)}): {want['all_gathers']} all-gathers and "
      f"{want['reduce_scatters']} reduce-scatters per step, with or without prefetch; prefetch issues block 1's "
      "gather before block 0's forward is done")  # fact: torch.fsdp2_forward_prefetch_order
print(f"ZeRO-3: {int(tab.loc['ZeRO-3 no prefetch', 'all_gathers'])} all-gathers per step without prefetch, "
      f"1 with a bucket larger than the model (the whole model, {model_mb:.2f} MB, gathered at once)")
print("units: " + ", ".join(f"{k} {len(units[k])} units -> {int(utab.loc[k, 'all_gathers'])} gathers, peak "
                            f"{utab.loc[k, 'peak_allocated_MB']:.1f} MB" for k in wr))

# %% [markdown]
# ## Optional: try other settings
#
# Nothing below is part of the story above, and nothing runs until you click **Run**. The
# panel's defaults are this notebook's own command (`$ARGS`, profiled); it launches the selected configs
# into its own run directories (`notebooks/runs/panel_04_*`) and redraws what rank 0 holds next to the losses. Try 4 ranks or the `small` model and compare the memory bars.

# %%
from helpers.nb import widgets

widgets.ControlPanel("04", {"FSDP no prefetch": "launch_configs/fsdp/full_shard_no_prefetch.yaml",
                            "FSDP prefetch": "launch_configs/fsdp/full_shard_prefetch.yaml",
                            "ZeRO-3 no prefetch": "launch_configs/deepspeed/zero3_no_prefetch.yaml",
                            "ZeRO-3 prefetch": "launch_configs/deepspeed/zero3_prefetch.yaml",
                            "FSDP size-based wrap": "launch_configs/fsdp/full_shard_size_wrap.yaml",
                            "FSDP no wrap": "launch_configs/fsdp/full_shard_no_wrap.yaml"},
                     args="$ARGS", plot=widgets.plot_memory,
                     selected=["FSDP no prefetch", "FSDP prefetch"])
