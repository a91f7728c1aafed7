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
# # 11 · Deep dive: sharding in detail
#
# **The question.** Notebook 01 measured what each sharding mode holds at 2 ranks (its hybrids at 4). Here: how do
# the bytes fall with 1, 2 and 4 ranks? Exactly how many gradient bytes does a ZeRO-1/2 rank hold?
# Where does ZeRO-0 part from NO_SHARD? How much of a process's memory is the state?
# And what is the rest of a config, key by key? (A deep dive from notebook 01; the core path goes
# on with 02.)
#
# **What we run.** The fully sharded pair (`full_shard`, `zero3`) at 1, 2 and 4 ranks; NO_SHARD
# and ZeRO-2 at 1 and 2; ZeRO-0 and ZeRO-1 at 2 — the `small` model (21M parameters), 2 steps,
# each job counting the bytes its ranks hold, as in notebook 01. The 2-rank jobs are notebook
# 01's own: with `--reuse`, one that 01 already ran here (same flags, ranks and code) is copied
# from its run directory, and its line says `reused`; otherwise it runs.

# %%
import os
from pathlib import Path

import pandas as pd
import torch

from helpers import facts, nb
from helpers.core import mapping, models
from helpers.nb import plots, results
from helpers.nb.claims import claim, ran, reused

SIZE = nb.setup()
# The quick size (CI's smoke test) stops at 2 ranks, as a 2-GPU node does: its 4-rank jobs were its longest.
SWEEP = {"full_shard": [1, 2, 4], "zero3": [1, 2, 4], "no_shard": [1, 2], "zero2": [1, 2], "zero1": [2],
         "zero0": [2]}
WORLDS = nb.world_sizes([1, 2, 4] if SIZE == "full" else [1, 2])  # GPU node: up to its GPUs
assert 2 in WORLDS, f"this notebook needs 2 ranks; this node has {nb.gpu_count()} GPU(s)"
JOB = "--model small --steps 2 --micro-batch 1 --seq-len 32"  # memory needs no long run
os.environ["JOB"] = JOB
plan = [(ws, mapping.MODES[key].config, f"notebooks/runs/11_{key}_{ws}") for key, worlds in SWEEP.items()
        for ws in worlds if ws in WORLDS]
twin = {out: out.replace("/11_", "/01_") if ws == 2 else "-" for ws, _, out in plan}  # 01's runs are at 2 ranks
Path("notebooks/runs").mkdir(parents=True, exist_ok=True)
Path("notebooks/runs/11_plan.txt").write_text("".join(f"{ws} {cfg} {out} {twin[out]}\n" for ws, cfg, out in plan))
print(f"size={SIZE}, ranks {WORLDS}: {len(plan)} jobs")

# %% language="bash"
# set -o pipefail
# while read ws cfg out from; do
#     printf 'ranks=%d  %-42s ' "$ws" "$cfg"
#     REUSE=(); [ "$from" != - ] && REUSE=(--reuse "$from")
#     torchrun --standalone --nproc_per_node "$ws" -m helpers.train --config "$cfg" --out "$out" $JOB "${REUSE[@]}" \
#         | tail -n 1
# done < notebooks/runs/11_plan.txt

# %%
runs = results.load_runs(*[out for _, _, out in plan])
reused("each reused run is notebook 01's 2-rank run of the same config (all but --out), job key (flags, ranks, "
       "code) and losses", runs, lambda r: f"notebooks/runs/01_{r.name[3:]}")
mem = results.memory_table(runs)
mem["ratio"] = mem.measured / mem.theory.where(mem.theory > 0)
boundary = mem["mode"].isin(["zero1", "zero2"]) & (mem.category == "grads")
GPUS = nb.gpu_count()
ran(f"every job trains the same model, small, for 2 steps ({'nccl' if GPUS else 'gloo'})", runs, model="small", steps=2,
    micro_batch=1, seq_len=32, num_params=runs[0].summary["num_params"], dist_backend="nccl" if GPUS else "gloo")
done = {m: sorted(r.summary["world_size"] for r in runs if r.summary["mode_key"] == m)
        for m in dict.fromkeys(r.summary["mode_key"] for r in runs)}  # from the runs, not from SWEEP
TEXT = {"full_shard": [1, 2, 4], "zero3": [1, 2, 4], "no_shard": [1, 2], "zero2": [1, 2], "zero1": [2], "zero0": [2]}
claim("small has 21M parameters, and the modes ran at the rank counts the text above names: full_shard and zero3 at 1, "
      "2 and 4, no_shard and zero2 at 1 and 2, zero1 and zero0 at 2 (those this size and node allow)",
      round(runs[0].summary["num_params"] / 1e6) == 21
      and done == {m: [w for w in ws if w in WORLDS] for m, ws in TEXT.items()},
      params_M=runs[0].summary["num_params"] / 1e6, ranks=done, allowed=WORLDS)

# %% [markdown]
# ## 1 · More ranks, less per rank — for the sharded parts
#
# The fully sharded modes (`full_shard`, `zero3`) divide (nearly) everything by the number of
# ranks (ZeRO-3 keeps its smallest parameters whole <!-- fact: deepspeed.zero3_persistent_small_params -->);
# ZeRO-2 keeps whole parameters <!-- fact: deepspeed.zero2_whole_params -->; `no_shard` divides nothing.
# (The printed fact's evidence comes from its own test engine, whose threshold is set to 16: there a 256-element weight is not kept whole.)

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


for m, ws in [(m, ws) for m in ("full_shard", "zero3") for ws in (2, 4) if ws in WORLDS]:  # 4: full size
    # within 0.1%, not exactly: a few bytes are whole on every rank (step counters; ZeRO-3's small params)
    claim(f"{m}: each of {ws} ranks holds 1/{ws} of what 1 rank holds, within 0.1%", all(abs(q * ws - 1) < 1e-3 for q in ratios(m, ws)), ratios=ratios(m, ws))
if "no_shard" in sweep_modes:
    claim("no_shard: 2 ranks each hold exactly what 1 rank holds", ratios("no_shard", 2) == [1, 1],
          ratios=ratios("no_shard", 2))
if "zero2" in sweep_modes:  # the model at 2 ranks: (2 + 2/2 + 12/2) / 16 = 9/16; with whole gradients 10/16
    claim("zero2: each of 2 ranks keeps whole params, and within 0.005 of 9/16 = 0.5625 of 1 rank's total (grads, "
          "fp32 master and optimizer states halved, plus section 2's overhang; 10/16 if it kept whole gradients)",
          ratios("zero2", 2, "params") == [1, 1] and all(abs(q - 9 / 16) < 0.005 for q in ratios("zero2", 2)),
          params_ratios=ratios("zero2", 2, "params"), total_ratios=ratios("zero2", 2))

# %% [markdown]
# ## 2 · ZeRO-1/2's gradient overhang
#
# DeepSpeed's stage-1/2 optimizer flattens each optimizer param group
# (the jobs' AdamW has one: all parameters; the fact's check below builds its own test model with
# two) into one buffer and gives each rank a contiguous slice of it. <!-- fact: deepspeed.zero12_flat_buffer_per_group -->
# A parameter that straddles a slice edge
# belongs to each rank it touches, and (with the default bf16 gradient buffer) each keeps that
# parameter's *whole* gradient until the step. <!-- fact: deepspeed.zero12_straddler_whole_grad --> So a rank holds its 1/N of the gradients plus the rest of the (at most two)
# parameters that straddle its slice's edges (so, by that arithmetic, the overhang weighs more when parameters are
# few and large). ZeRO-1 holds the same at this point: it reduces the gradients into partitions at the
# accumulation boundary, just before the step (notebook 01). <!-- fact: deepspeed.zero1_reduces_at_boundary --> The
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
claim("ZeRO-1/2 gradients: each rank holds its 1/N slice of the one param group (all parameters, in order) plus "
      "exactly the rest of the parameters straddling its slice's edges", (over.excess == over.counted).all(),
      max_ratio=over.groupby(["mode", "world_size"]).ratio.max().round(3).to_dict())
z3 = mem[(mem["mode"] == "zero3") & (mem.category == "grads")]
claim("ZeRO-3 has no such overhang: each rank holds exactly its 1/N of the gradients, at every world size run here",
      (z3.measured == z3.theory).all(), excess=(z3.measured - z3.theory).tolist())

# %% [markdown]
# ## 3 · Parity at every world size, and ZeRO-0
#
# Notebook 00's identical losses hold at every world size we ran on the CPU (gloo), over these
# 2-step runs. On a GPU
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
# Notebook 01's mapping (NO_SHARD = ZeRO-0) is about what is sharded, not about the arithmetic. `NO_SHARD` and ZeRO-0
# shard the same thing (nothing) <!-- fact: deepspeed.zero0_replicates -->, but here they do not train bit-identically.
# DeepSpeed runs ZeRO-0 in bf16 through a separate optimizer wrapper (`FP16_UnfusedOptimizer`)
# instead of its ZeRO code <!-- fact: deepspeed.zero0_bf16_optimizer -->, and ZeRO-0 keeps bf16 gradients
# where NO_SHARD keeps fp32 ones (checked below). At step 0, before any update, the reported gradient
# norms already differ by far more than the other modes' last-bit differences (printed below). We have not
# traced which difference parts them (`--trace-tensors` supports FSDP and ZeRO-3 only); `python -m
# helpers.compare RUN_A RUN_B` names the first step where two runs' numbers differ (notebook 12 shows it).
# At 2 ranks, over these 2 steps, ZeRO-1 and ZeRO-2 (one ZeRO optimizer class; ZeRO-3 runs another)
# give FSDP's losses exactly: <!-- fact: deepspeed.zero_optimizer_classes -->

# %%
facts.show("deepspeed.zero0_bf16_optimizer", "deepspeed.zero_optimizer_classes")
at2 = {r.summary["mode_key"]: r.summary for r in runs if r.summary["world_size"] == 2}
norm0 = {r.summary["mode_key"]: float(r.metrics.grad_norm.iloc[0]) for r in runs if r.summary["world_size"] == 2}
exact2 = nb.bitwise_parity_expected(2)  # bit for bit on a CPU (gloo); on GPUs see nb.bitwise_parity_expected
claim(f"at 2 ranks ZeRO-1, ZeRO-2 and NO_SHARD give {'exactly FULL_SHARD' if exact2 else 'within 1e-2 of FULL_SHARD'}'s "
      f"losses (the {len(at2['full_shard']['losses'])} steps of these runs)",
      all((at2[k]["losses"] == at2["full_shard"]["losses"]) if exact2 else max(
          abs(a - b) for a, b in zip(at2[k]["losses"], at2["full_shard"]["losses"], strict=True)) < 1e-2
          for k in ("zero1", "zero2", "no_shard")),
      largest_gap=max(abs(a - b) for k in ("zero1", "zero2", "no_shard")
                      for a, b in zip(at2[k]["losses"], at2["full_shard"]["losses"], strict=True)))
others = max(abs(norm0[k] - norm0["no_shard"]) for k in ("full_shard", "zero1", "zero2", "zero3"))
grads = {k: at2[k]["memory_bytes"][0]["grads"] / at2[k]["num_params"] for k in ("zero0", "no_shard")}  # bytes/param
last_bits = 2 * 2**-23 * norm0["no_shard"]  # two fp32 rounding steps at the norm's size
claim("ZeRO-0 does not: its losses differ from NO_SHARD's, and its step-0 gradient norm differs from NO_SHARD's over "
      "100x as much as any other mode's does (theirs within two fp32 rounding steps of the norm: last bits)",
      at2["zero0"]["losses"] != at2["no_shard"]["losses"] and abs(norm0["zero0"] - norm0["no_shard"]) > 100 * others
      and others < last_bits, step0_norm_no_shard=norm0["no_shard"], two_fp32_steps=last_bits,
      final_zero0=at2["zero0"]["final_loss"], final_no_shard=at2["no_shard"]["final_loss"],
      step0_norm_gap_zero0=abs(norm0["zero0"] - norm0["no_shard"]), step0_norm_gap_others=others)
claim("ZeRO-0 keeps 2 bytes of gradient per parameter (bf16), NO_SHARD 4 (fp32)", grads == {"zero0": 2, "no_shard": 4},
      grad_bytes_per_param=grads)

# %% [markdown]
# ## 4 · The whole process, not just the state
#
# `peak_memory_bytes` is the process's peak anonymous memory (`RssAnon`, sampled at the end
# of each forward and of each step; on a GPU, `torch.cuda.max_memory_allocated`). On a
# CPU it includes what every torch process holds (the libraries it loads) <!-- fact: torch.import_rss -->, so the
# state of a 21M-parameter model is only part of it (the share is printed below), which is
# why the jobs count the state tensor by tensor (notebook 01).

# %%
peaks = pd.DataFrame([{"mode": r.summary["mode_key"], "ranks": r.summary["world_size"],
                       "peak MiB (max over ranks)": max(r.summary["peak_memory_bytes"]) / 2**20,
                       "peak MiB (rank 0)": r.summary["peak_memory_bytes"][0] / 2**20,
                       "state MiB (rank 0)": sum(r.summary["memory_bytes"][0].values()) / 2**20}
                      for r in runs if r.summary["world_size"] == 2]).set_index("mode").round(0)
share = peaks["state MiB (rank 0)"] / peaks["peak MiB (rank 0)"]  # one process: rank 0's state over its own peak
print("what the jobs' peak is (their label for this device, a setting, not a measurement):",
      sorted({r.summary["peak_memory_source"] for r in runs}))
claim("rank 0's state is under half of its process's peak in every 2-rank run here", (share < 0.5).all(),
      state_over_peak=share.round(2).to_dict())
peaks

# %% [markdown]
# ## 5 · The rest of a config, key by key
#
# Sharding is one row of a launch config. `helpers.core.mapping.SETTINGS` holds the others as
# data (the table below), and `python -m helpers.translate` turns an FSDP config into the DeepSpeed
# one with the same settings (and back), with a warning and the nearest choice (one run here) for every
# value in the config that has no exact counterpart. "Exact" is about what a setting asks for, not about
# bit-identical training: NO_SHARD and ZeRO-0 ask for the same sharding (nothing) and still
# train differently (section 3). <!-- fact: deepspeed.zero0_replicates -->

# %%
facts.show("deepspeed.bf16_master_weights_option", "deepspeed.no_bf16_keeps_model_dtype",
           "accelerate.fsdp2_ignores_prefetch_keys", "deepspeed.prefetch_bucket_elements")
# the table's notes rest on:
# fact: torch.hybrid_shard_replicates
# fact: deepspeed.hpz_secondary_shard
# fact: torch.fsdp2_cpu_offload_all
# fact: deepspeed.offload_keys
# fact: accelerate.offload_swaps_in_cpu_adam
# fact: deepspeed.offload_needs_force_cpu_optimizer_off
# fact: accelerate.low_memory_loading
# fact: deepspeed.zero_init_partitions_on_creation
# fact: accelerate.full_state_dict_one_file
# fact: deepspeed.save_16bit_one_file
# fact: deepspeed.save_checkpoint_no_16bit
# fact: accelerate.save_state_no_16bit_file
# fact: torch.fsdp2_default_backward_prefetch
# fact: torch.fsdp2_forward_prefetch_order
# fact: accelerate.fsdp_state_dict_types
# fact: accelerate.fsdp2_bf16_fp32_shards
# fact: deepspeed.bf16_default_dtypes
# fact: deepspeed.zero0_bf16_optimizer
# fact: accelerate.no_reduce_dtype_key
# fact: deepspeed.reduce_dtype_keys
# fact: deepspeed.gradient_clipping_default
pd.set_option("display.max_colwidth", None)  # every note whole
pd.DataFrame(mapping.settings_rows()).set_index("topic")

# %% language="bash"
# python -m helpers.translate launch_configs/fsdp/shard_grad_op.yaml --to deepspeed -o notebooks/runs/11_sgo_as_ds.yaml

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
# ## Recap
#
# * Fully sharded state falls with the number of ranks (a quarter at 4 ranks, checked above);
#   NO_SHARD divides nothing, and ZeRO-2 keeps whole parameters.
# * At the ranks run here, a ZeRO-1/2 rank holds its 1/N slice of the gradients plus the rest of
#   the parameters that straddle its slice's edges, byte for byte; ZeRO-3 holds exactly its 1/N of
#   the gradients.
# * FULL_SHARD and ZeRO-3 give identical losses at every world size run here (2-step runs);
#   ZeRO-0's losses part from NO_SHARD's (where, we have not traced; its reported norm differs
#   already at step 0).
# * On a CPU the state was under half of each 2-rank run's peak here; the rest is not broken
#   down here.
#
# Back to the path: `02_precision`.

