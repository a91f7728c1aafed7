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
# # 01 · Sharding: what each rank really holds
#
# **The question.** Which FSDP setting is which ZeRO stage, and what does each one save
# per rank? Docs answer with a table; here we answer with the bytes that live jobs hold.
#
# **What we run.** The main sharding modes of both backends — FSDP `NO_SHARD`,
# `SHARD_GRAD_OP`, `FULL_SHARD`, `HYBRID_SHARD`; DeepSpeed ZeRO-0, 1, 2, 3 and ZeRO++
# hpZ <!-- fact: torch.fsdp1_sharding_strategies --> — on one model (`small`, 21M parameters): every mode at 2 ranks, the hybrids at 4 (they
# need it), and a few modes also at 1 and 4 ranks to see how the bytes scale. Each job counts,
# on every rank, the bytes of the parameters, gradients, optimizer states and fp32
# master weights it holds right before its optimizer step, straight from the live
# tensors (`helpers.job.observe.memory`), and writes them next to what the ZeRO model predicts.
#
# **What we look at.** Measured bytes per rank next to the theory, how they fall with
# the number of ranks, and where the two backends keep different things.

# %%
import os
from pathlib import Path

import pandas as pd
import torch

from helpers import facts, nb
from helpers.core import mapping, models
from helpers.nb import plots, results
from helpers.nb.claims import claim

SIZE = nb.setup()
# every mode at 2 ranks, the hybrids at 4; the fully sharded pair also at 1 and 4 ranks (how sharded state
# scales); full size adds no_shard and ZeRO-2 at 1 rank (what they do not divide). Memory is exact after 2 steps.
# The quick size (CI's smoke test) stops at 2 ranks, as a 2-GPU node does: its 4-rank jobs were its longest.
SWEEP = {"full_shard": [1, 2, 4], "zero3": [1, 2, 4]}
if SIZE == "full":
    SWEEP.update(no_shard=[1, 2], zero2=[1, 2])
WORLDS = nb.world_sizes([1, 2, 4] if SIZE == "full" else [1, 2])  # GPU node: up to its GPUs (one per nccl rank)
assert 2 in WORLDS, f"this notebook needs 2 ranks; this node has {nb.gpu_count()} GPU(s)"
JOB = "--model small --steps 2 --micro-batch 1 --seq-len 32"  # memory needs no long run
os.environ["JOB"] = JOB
print(f"size={SIZE}, ranks {WORLDS}")

# %% [markdown]
# ## The mapping, as data
#
# The table below is rendered from `helpers.core.mapping.MODES` — the same data the jobs
# use for their theory numbers and that later drives config translation.

# %%
# NBVAL_CHECK_OUTPUT
# fact: torch.fsdp_sharding_strategies
# fact: torch.fsdp2_reshard_after_forward
# fact: torch.hybrid_shard_replicates
# fact: deepspeed.zero0_replicates
# fact: deepspeed.zero_stage_partitions
# fact: deepspeed.zero1_reduces_at_boundary
# fact: deepspeed.hpz_secondary_shard
pd.DataFrame(mapping.mapping_rows()).set_index("mode")

# %% [markdown]
# The memory model (ZeRO paper) for Adam in bf16 mixed precision: per parameter, **2**
# bytes of bf16 weights + **2** of bf16 gradients + **12** of optimizer state (an fp32
# master copy, and fp32 momentum and variance) = 16 bytes. <!-- fact: deepspeed.bf16_default_dtypes --> Each stage shards more of it over
# the ranks: ZeRO-1 the optimizer states, ZeRO-2 the gradients too, ZeRO-3 the weights too <!-- fact: deepspeed.zero_stage_partitions -->
# (measured just before the step, as below, ZeRO-1 and ZeRO-2 hold the same: see why further
# down). <!-- fact: deepspeed.zero1_reduces_at_boundary --> That is DeepSpeed's split; FSDP's aligned mode (Accelerate's) holds
# the same 16 bytes as 4 of fp32 weights, 4 of fp32 gradients and 8 of moments, with no
# separate master. <!-- fact: accelerate.fsdp2_bf16_fp32_shards --> <!-- fact: torch.fsdp2_mixed_16_bytes --> The `theory` column below follows each backend's own split.
#
# ## Run every mode
#
# The plan: which config at how many ranks. Hybrid modes need 4 ranks (2 replicas x 2
# shards); with fewer they are refused before they start.

# %%
plan = []
for key, mode in mapping.MODES.items():
    for ws in SWEEP.get(key, [2]) if mode.min_world_size <= 2 else [mode.min_world_size]:
        if ws in WORLDS:
            plan.append((ws, mode.config, f"notebooks/runs/01_{key}_{ws}"))
Path("notebooks/runs").mkdir(parents=True, exist_ok=True)
Path("notebooks/runs/01_plan.txt").write_text("".join(f"{ws} {cfg} {out}\n" for ws, cfg, out in plan))
print(f"{len(plan)} jobs")

# %% [markdown]
# Each line below is one real `torchrun` job (its last printed line). With 4 ranks on a
# CPU machine with fewer cores they share cores: slow, but each rank holds what a 4-GPU
# job's rank would (the sharding arithmetic is the same; not run on GPUs here). <!-- fact: torch.shard_sizes_device_independent -->

# %% language="bash"
# set -o pipefail
# while read ws cfg out; do
#     printf 'ranks=%d  %-42s ' "$ws" "$cfg"
#     torchrun --standalone --nproc_per_node "$ws" -m helpers.train --config "$cfg" --out "$out" $JOB | tail -n 1
# done < notebooks/runs/01_plan.txt

# %%
runs = results.load_runs(*[out for _, _, out in plan])
mem = results.memory_table(runs)
mem.head()

# %% [markdown]
# ## Measured bytes per rank, next to the theory
#
# Stacked bars: what rank 0 holds, by category. The black tick is the ZeRO model's total.

# %%
shown = [w for w in (2, 4) if w in WORLDS]
fig, axes = plots.plt.subplots(len(shown), 2, sharey=True, figsize=(11, 3.75 * len(shown)), squeeze=False)
for row, ws in zip(axes, shown, strict=True):
    plots.memory_bars(mem, world_size=ws, axes=row)
fig.tight_layout()

# %% [markdown]
# The bars meet their ticks. The check: each category, on each rank, of each run, within
# 1% of the model (the small differences: Adam's per-parameter step counters <!-- fact: torch.adam_state -->,
# and the small parameters ZeRO-3 keeps whole on every rank next to its shards <!-- fact: deepspeed.zero3_persistent_keep_partition -->), except ZeRO-1/2's gradients, which follow another rule, counted exactly further
# below.

# %%
mem["ratio"] = mem.measured / mem.theory.where(mem.theory > 0)
boundary = mem["mode"].isin(["zero1", "zero2"]) & (mem.category == "grads")
off = mem[~boundary & (((mem.theory == 0) & (mem.measured != 0)) | ((mem.ratio - 1).abs() > 0.01))]
claim("every (run, rank, category) but ZeRO-1/2's gradients is within 1% of the ZeRO model", off.empty,
      values=int((~boundary).sum()), largest_deviation=float((mem.ratio[~boundary] - 1).abs().max()),
      outside=len(off))

# %% [markdown]
# **ZeRO-1/2 gradients.** DeepSpeed's stage-1/2 optimizer flattens each optimizer param group
# (here one: all parameters) into one buffer and gives each rank a contiguous slice of it. <!-- fact: deepspeed.zero12_flat_buffer_per_group -->
# A parameter that straddles a slice edge
# belongs to each rank it touches, and (with the default bf16 gradient buffer) each keeps that
# parameter's *whole* gradient until the step. <!-- fact: deepspeed.zero12_straddler_whole_grad --> So a rank holds its 1/N of the gradients plus the rest of the (at most two)
# parameters that straddle its slice's edges: more when parameters are few and large. The
# cell below walks the parameters in order, finds those edges, and checks each rank's bytes
# against that count exactly. ZeRO-3 partitions each parameter separately and has no such
# overhang. <!-- fact: deepspeed.zero3_per_param_partitions -->

# %%
facts.show("deepspeed.zero12_flat_buffer_per_group", "deepspeed.zero12_straddler_whole_grad")
with torch.device("meta"):  # shapes only, no memory  # fact: torch.meta_no_storage
    model = models.build_model(models.resolve_model("small"), torch.bfloat16, seed=0, device="meta")
named = [(n, p.numel()) for n, p in model.named_parameters()]  # the flat buffer's order
# fact: deepspeed.zero12_flat_buffer_per_group
total = sum(n for _, n in named)


def overhang(world_size, rank):
    """(bf16 bytes of the straddling parameters outside this rank's slice, their names)."""
    lo, hi = total * rank // world_size, total * (rank + 1) // world_size
    out, names, start = 0, [], 0
    for name, n in named:
        end = start + n
        if start < hi and end > lo and (start < lo or end > hi):
            out, names = out + max(lo - start, 0) + max(end - hi, 0), names + [name]
        start = end
    return 2 * out, names


over = mem[boundary].assign(excess=lambda d: d.measured - d.theory,
                            counted=lambda d: [overhang(w, r)[0] for w, r in zip(d.world_size, d["rank"])])
print(over[["mode", "world_size", "rank", "theory", "measured", "excess", "counted"]].to_string(index=False))
print("straddling at 2 ranks:", {r: overhang(2, r)[1] for r in range(2)})
claim("ZeRO-1/2 gradients: each rank holds its 1/N slice plus exactly the rest of the parameters straddling its "
      "slice's edges", (over.excess == over.counted).all(),
      max_ratio=over.groupby(["mode", "world_size"]).ratio.max().round(3).to_dict())

# %% [markdown]
# ## More ranks, less per rank — for the sharded parts
#
# The fully sharded modes (`full_shard`, `zero3`) divide (nearly) everything by the number of
# ranks (ZeRO-3 keeps its smallest parameters whole <!-- fact: deepspeed.zero3_persistent_small_params -->);
# ZeRO-2 keeps whole parameters <!-- fact: deepspeed.zero2_whole_params -->; `no_shard` divides nothing (those two are run at 1
# rank at full size only; the quick size plots the fully sharded pair).

# %%
facts.show("deepspeed.zero3_persistent_small_params")
sweep_modes = [m for m in ("no_shard", "full_shard", "zero0", "zero2", "zero3")
               if mem[mem["mode"] == m].world_size.nunique() > 1]
plots.memory_vs_world(mem, sweep_modes);

# %%
per_rank = mem.groupby(["mode", "world_size", "rank", "category"]).measured.sum()  # every rank, not only rank 0
totals = per_rank.groupby(["mode", "world_size", "rank"]).sum()


def ratios(m, ws, category=None):
    """Each rank's bytes at ws ranks over the 1-rank run's (one category, or the total)."""
    held = per_rank.xs(category, level="category") if category else totals
    return (held[m, ws] / held[m, 1, 0]).tolist()  # unrounded: "exactly" compares them with 1


for m in ("full_shard", "zero3") if 4 in WORLDS else ():  # a node with fewer than 4 GPUs: not run
    claim(f"{m}: each of 4 ranks holds a quarter of what 1 rank holds (0.24-0.26)",
          all(0.24 <= q <= 0.26 for q in ratios(m, 4)), ratios=ratios(m, 4))
if "no_shard" in sweep_modes:
    claim("no_shard: 2 ranks each hold exactly what 1 rank holds", ratios("no_shard", 2) == [1, 1],
          ratios=ratios("no_shard", 2))
if "zero2" in sweep_modes:  # the model at 2 ranks: (2 + 2/2 + 12/2) / 16 = 9/16; with whole gradients 10/16
    claim("zero2: each of 2 ranks keeps whole params, and under 0.6 of 1 rank's total (the model: 9/16 = 0.5625, "
          "grads and optimizer states halved; 10/16 if it kept whole gradients)",
          ratios("zero2", 2, "params") == [1, 1] and max(ratios("zero2", 2)) < 0.6,
          params_ratios=ratios("zero2", 2, "params"), total_ratios=ratios("zero2", 2))

# %% [markdown]
# ## Same total, different split: FSDP and DeepSpeed do not keep the same things
#
# At the same world size FULL_SHARD and ZeRO-3 hold the same 16 bytes per parameter in
# total, split differently:
#
# * **FSDP** (aligned mixed precision, as Accelerate sets it up) upcasts the model to
#   fp32 and shards *that*. The fp32 shard is what the optimizer updates, so there is no
#   separate master copy; the bf16 weights exist only while a unit is gathered. <!-- fact: accelerate.fsdp2_bf16_fp32_shards --> <!-- fact: torch.fsdp2_reshard_after_forward -->
# * **DeepSpeed** keeps the model in bf16 and shards the bf16 weights and gradients, and
#   keeps a separate **fp32 master** partition for the optimizer. <!-- fact: deepspeed.zero3_bf16_dtypes -->
#
# Both pay the upcast (up to 2x for parameters and optimizer, in the Hugging Face write-up on aligning the two backends' precision): FSDP in its fp32 params and
# gradients, DeepSpeed in its fp32 master copy (its params and gradients stay bf16). <!-- fact: deepspeed.zero3_bf16_dtypes -->
# At rest the totals are equal.

# %%
ws = 2
pair = mem[(mem.world_size == ws) & (mem["rank"] == 0) & mem["mode"].isin(["full_shard", "zero3"])]
split = pair.pivot_table(index="category", columns="mode", values="measured") / 2**20
split.loc["total"] = split.sum()
split.round(1)

# %%
claim("FULL_SHARD and ZeRO-3 hold the same total (within 1%)",
      abs(split.loc["total", "full_shard"] / split.loc["total", "zero3"] - 1) < 0.01,
      full_shard_MiB=split.loc["total", "full_shard"], zero3_MiB=split.loc["total", "zero3"])
claim("FSDP keeps no separate master and twice DeepSpeed's param and gradient bytes (fp32 shards vs bf16 shards "
      "+ fp32 master)", split.loc["master_params", "full_shard"] == 0 and split.loc["master_params", "zero3"] > 0
      and abs(split.loc["params", "full_shard"] / split.loc["params", "zero3"] - 2) < 0.01
      and abs(split.loc["grads", "full_shard"] / split.loc["grads", "zero3"] - 2) < 0.01,
      params_ratio=split.loc["params", "full_shard"] / split.loc["params", "zero3"],
      grads_ratio=split.loc["grads", "full_shard"] / split.loc["grads", "zero3"])

# %% [markdown]
# Two more differences, both transient, which the bars (measured before the step) do not show:
#
# * **ZeRO-1 vs ZeRO-2.** DeepSpeed's ZeRO-1 reduces gradients into per-rank partitions
#   once backward is over (at the accumulation boundary), so just before the step it holds
#   the same as ZeRO-2. During backward (and across accumulation micro-batches) ZeRO-1 holds
#   the *full* gradient; ZeRO-2 reduces bucket by bucket as backward runs. <!-- fact: deepspeed.zero1_reduces_at_boundary -->
# * **SHARD_GRAD_OP vs FULL_SHARD.** Identical at rest. The difference is in between:
#   SHARD_GRAD_OP keeps each unit's gathered weights from forward until its backward
#   (no second all-gather), FULL_SHARD frees them and gathers again; notebook 08 counts it <!-- fact: torch.fsdp2_reshard_after_forward -->
#   per rank (`peak_tensor_bytes`), with the batch it costs. (The process peaks at the end of
#   this notebook do not isolate it: they hold everything a process holds.)
#
# The identity from notebook 00 holds at every world size we ran on the CPU (gloo). On a GPU
# these jobs run without `--deterministic`, so the cell checks that the losses agree within
# 1e-2 instead; bit for bit there would need `--deterministic` on at most 2 GPUs (beyond 2,
# nccl may sum in another order <!-- fact: torch.nccl_sum_order -->;
# `nb.bitwise_parity_expected`, written for, not yet run on, GPUs).

# %%
for ws in sorted(set(mem.world_size)):
    names = {r.summary["mode_key"]: r for r in runs if r.summary["world_size"] == ws}
    if {"full_shard", "zero3"} <= set(names):
        a, b = names["full_shard"].summary["losses"], names["zero3"].summary["losses"]
        gap = max(abs(x - y) for x, y in zip(a, b, strict=True))
        if nb.bitwise_parity_expected(ws):
            claim(f"{ws} rank(s): FSDP full_shard and ZeRO-3 losses identical", a == b, max_gap=gap)
        else:
            claim(f"{ws} rank(s): FSDP full_shard and ZeRO-3 losses within 1e-2 (nccl)", gap < 1e-2, max_gap=gap)

# %% [markdown]
# The mapping's "=" is about what is sharded, not about the arithmetic. `NO_SHARD` and ZeRO-0
# shard the same thing (nothing) <!-- fact: deepspeed.zero0_replicates -->, but here they do not train bit-identically: DeepSpeed runs
# ZeRO-0 in bf16 through a separate optimizer wrapper (`FP16_UnfusedOptimizer`) instead of its ZeRO
# code <!-- fact: deepspeed.zero0_bf16_optimizer -->, and its gradient norm already differs at step 0 (both printed below). We have not traced
# which stage differs (`--trace-tensors` reads ZeRO-3 partitions only); `python -m
# helpers.compare RUN_A RUN_B` names the first step (notebook 12 shows it). ZeRO-1 and ZeRO-2
# (one ZeRO optimizer class; ZeRO-3 runs another) do match FSDP: <!-- fact: deepspeed.zero_optimizer_classes -->

# %%
facts.show("deepspeed.zero0_bf16_optimizer", "deepspeed.zero_optimizer_classes")
at2 = {r.summary["mode_key"]: r.summary for r in runs if r.summary["world_size"] == 2}
norm0 = {r.summary["mode_key"]: float(r.metrics.grad_norm.iloc[0]) for r in runs if r.summary["world_size"] == 2}
claim(f"at 2 ranks ZeRO-1, ZeRO-2 and NO_SHARD train exactly as FULL_SHARD does (the {len(at2['full_shard']['losses'])} "
      "steps of these runs)",
      all(at2[k]["losses"] == at2["full_shard"]["losses"] for k in ("zero1", "zero2", "no_shard")),
      final={k: at2[k]["final_loss"] for k in ("full_shard", "no_shard", "zero1", "zero2")})
claim("ZeRO-0 does not: its losses differ from NO_SHARD's", at2["zero0"]["losses"] != at2["no_shard"]["losses"],
      final_zero0=at2["zero0"]["final_loss"], final_no_shard=at2["no_shard"]["final_loss"],
      grad_norm_step0=f'{norm0["zero0"]:.9g} vs {norm0["no_shard"]:.9g}')

# %% [markdown]
# ## What it buys: the largest micro-batch in a memory budget, from state and activations alone
#
# Hugging Face's write-up on DeepSpeed in Accelerate (its tables are in notebook 08) reports
# DDP fitting batch 8 and ZeRO-2 batch 40 on 24 GB cards. The same question, for our model,
# in its simplest form: per rank, the state above plus activations per sequence must fit the
# budget. This leaves out everything transient (gathered units, buckets, the optimizer step)
# and the process itself (the process peaks further down are above this budget even at
# micro-batch 1); notebook 08 adds what it leaves out and confirms its answers with runs. Activations per sequence are measured too (bytes autograd saves for
# backward in one forward, `activation_bytes_per_sample`). On this CPU we **compute** the
# answer from those measurements; on a GPU you would also find it by trying until OOM.

# %%
BUDGET = 512 * 2**20  # bytes per rank; try your own card's size
ws = 2
rows = []
for key in ("no_shard", "zero0", "zero2", "zero3", "full_shard"):
    r = next(r for r in runs if r.summary["mode_key"] == key and r.summary["world_size"] == ws)
    state = max(sum(m.values()) for m in r.summary["memory_bytes"])
    act = r.summary["activation_bytes_per_sample"]
    rows.append({"mode": key, "state MiB": state / 2**20, "activations MiB/seq": act / 2**20,
                 "max micro-batch": int((BUDGET - state) // act) if BUDGET > state else 0})
fit = pd.DataFrame(rows).set_index("mode").round(2)
fit

# %%
# fact: deepspeed.zero0_replicates
claim(f"at {ws} ranks and {BUDGET / 2**20:.0f} MiB, ZeRO-3 fits more sequences than ZeRO-2, and ZeRO-2 more than "
      "ZeRO-0 (DDP-like)", fit.loc["zero3", "max micro-batch"] > fit.loc["zero2", "max micro-batch"]
      > fit.loc["zero0", "max micro-batch"], max_micro_batch=fit["max micro-batch"].to_dict())

# %% [markdown]
# ## The whole process, not just the state
#
# `peak_memory_bytes` is the process's peak anonymous memory (`RssAnon`, sampled after
# each forward, backward and step; on a GPU, `torch.cuda.max_memory_allocated`). On a
# CPU it includes what every torch process holds (the libraries it loads) <!-- fact: torch.import_rss -->, so the
# state of a 21M-parameter model is only part of it (the share is printed below), which is
# why the state is counted tensor by tensor above.

# %%
peaks = pd.DataFrame([{"mode": r.summary["mode_key"], "ranks": r.summary["world_size"],
                       "peak MiB (max over ranks)": max(r.summary["peak_memory_bytes"]) / 2**20,
                       "state MiB (rank 0)": sum(r.summary["memory_bytes"][0].values()) / 2**20}
                      for r in runs if r.summary["world_size"] == 2]).set_index("mode").round(0)
share = peaks["state MiB (rank 0)"] / peaks["peak MiB (max over ranks)"]
claim("the state is under half of the process's peak in every 2-rank run here", (share < 0.5).all(),
      state_over_peak=share.round(2).to_dict())
peaks

# %% [markdown]
# ## Recap
#
# Measured on this machine, per rank, before the optimizer step (MiB):

# %%
recap = (mem[mem["rank"] == 0].groupby(["mode", "world_size"]).measured.sum() / 2**20).unstack().round(1)
recap

# %% [markdown]
# * FSDP `NO_SHARD` = ZeRO-0, `SHARD_GRAD_OP` ~ ZeRO-2, `FULL_SHARD` = ZeRO-3, <!-- fact: torch.fsdp_sharding_strategies -->
#   `HYBRID_SHARD` ~ ZeRO++ hpZ (alike in spirit: both gather weights within a node, HYBRID_SHARD
#   by replicating across nodes, hpZ (in backward) from a second, intra-node shard; not in bytes:
#   the recap table) <!-- fact: torch.hybrid_shard_replicates --> <!-- fact: deepspeed.hpz_secondary_shard -->;
#   ZeRO-1 has no FSDP twin <!-- fact: torch.fsdp1_sharding_strategies -->. "=" is about what is sharded:
#   FULL_SHARD, NO_SHARD, ZeRO-1/2/3 trained identically over these short runs, ZeRO-0
#   (bf16) did not. HYBRID_SHARD is not in that list: its 4-rank run ended a little away from
#   FULL_SHARD's (the final losses in the job lines at the top); we have not traced where it
#   parts.
# * Every measured category but ZeRO-1/2's gradients was within 1% of the ZeRO model (as the
#   theory column counts it, before the step), on every rank; those gradients were, byte for
#   byte, the 1/N slice plus the rest of the parameters straddling its edges.
# * Fully sharded state at 4 ranks is a quarter of 1 rank's.
# * FULL_SHARD (aligned) and ZeRO-3 hold the same total but split it differently: fp32
#   shards and gradients vs bf16 shards and gradients + fp32 master. <!-- fact: accelerate.fsdp2_bf16_fp32_shards --> <!-- fact: deepspeed.zero3_bf16_dtypes -->
#
# Next: `02_precision` — why the precision write-up's FSDP run stalled when it trained without that fp32
# copy (bf16 weights and optimizer state), and what each fix costs.

# %% [markdown]
# ## Appendix: the rest of a config, key by key
#
# Sharding is one row of a launch config. `helpers.core.mapping.SETTINGS` holds the others as
# data, and `python -m helpers.translate` reads it to turn an FSDP config into the DeepSpeed
# one with the same settings (and back), with a warning and the nearest choice for every
# setting that has no exact counterpart. "Exact" is about what a setting asks for, not about
# bit-identical training: NO_SHARD and ZeRO-0 ask for the same sharding (nothing) and still
# train differently (above). <!-- fact: deepspeed.zero0_replicates -->

# %%
facts.show("deepspeed.bf16_master_weights_option", "deepspeed.no_bf16_keeps_model_dtype",
           "accelerate.fsdp2_ignores_prefetch_keys", "deepspeed.prefetch_bucket_elements")
# the table's notes rest on:
# fact: torch.hybrid_shard_replicates
# fact: deepspeed.hpz_secondary_shard
# fact: torch.fsdp2_cpu_offload_all
# fact: deepspeed.offload_keys
# fact: accelerate.low_memory_loading
# fact: accelerate.full_state_dict_one_file
# fact: deepspeed.save_16bit_one_file
# fact: torch.fsdp2_default_backward_prefetch
# fact: accelerate.fsdp2_bf16_fp32_shards
# fact: deepspeed.bf16_default_dtypes
# fact: deepspeed.zero0_bf16_optimizer
# fact: accelerate.no_reduce_dtype_key
# fact: deepspeed.reduce_dtype_keys
# fact: deepspeed.gradient_clipping_default
pd.set_option("display.max_colwidth", None)  # every note whole
pd.DataFrame(mapping.settings_rows()).set_index("topic")

# %% language="bash"
# python -m helpers.translate launch_configs/fsdp/shard_grad_op.yaml --to deepspeed -o notebooks/runs/01_sgo_as_ds.yaml

# %%
# the warning printed above rests on:
# fact: torch.fsdp2_reshard_after_forward
# fact: deepspeed.zero2_whole_params
from helpers import translate

sgo = translate.translate("launch_configs/fsdp/shard_grad_op.yaml", "deepspeed")
fs = translate.translate("launch_configs/fsdp/full_shard.yaml", "deepspeed")
claim("SHARD_GRAD_OP translates to ZeRO-2 as the nearest choice, with a warning (not exact)",
      sgo.json["zero_optimization"]["stage"] == 2 and len(sgo.warnings) > 0 and not sgo.exact,
      warnings=len(sgo.warnings))
claim("FULL_SHARD translates to ZeRO-3 exactly", fs.json["zero_optimization"]["stage"] == 3 and fs.exact,
      stage=fs.json["zero_optimization"]["stage"], warnings=len(fs.warnings))

# %% [markdown]
# ## Optional: other settings, and a memory estimate for your model
#
# Nothing below is part of the story above, and nothing runs until you click **Run**. The
# panel launches the selected modes into its own run directories (`notebooks/runs/panel_01_*`)
# and redraws what rank 0 holds. The estimator applies the ZeRO model of this notebook to any
# size of model: per-rank bytes for both backends, next to the measured bars of the runs above.

# %%
from helpers.core import mapping
from helpers.nb import widgets

widgets.ControlPanel("01", {key: mode.config for key, mode in mapping.MODES.items()},
                     args="$JOB", plot=widgets.plot_memory, selected=["full_shard", "zero3"], ranks=2)

# %%
widgets.MemoryEstimator(num_params=7_000_000_000)
