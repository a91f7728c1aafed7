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
# # 04 · Prefetch: when the bytes move, seen on per-rank timelines
#
# **The question.** A sharded model must gather its parameters before it can compute with them.
# FSDP lets you say *when* (explicit forward/backward prefetch, resharding after forward) and
# *in what pieces* (which modules are units). <!-- fact: torch.fsdp2_explicit_prefetch_api -->
# DeepSpeed ZeRO-3 gathers each module's own parameters when that module runs; thresholds
# decide how much more it prefetches (`stage3_prefetch_bucket_size`, capped by
# `stage3_max_live_parameters`) and how long it keeps a parameter (`stage3_max_reuse_distance`). <!-- fact: deepspeed.zero3_gathers_per_module --> What does prefetch
# change in the order, number and size of the gathers?
#
# **What we run.** Four short jobs with `--profile`: every rank records a `torch.profiler` trace of
# two steps after warm-up; `helpers.nb.traces` reads them and `helpers.nb.plots.timeline` draws,
# per rank, what the training thread computed and what went over the wire.
#
# | setting | config in `launch_configs/` |
# |---|---|
# | FSDP, no prefetch | `fsdp/full_shard_no_prefetch.yaml` |
# | FSDP, forward + backward prefetch | `fsdp/full_shard_prefetch.yaml` |
# | ZeRO-3, no prefetch, release after use | `deepspeed/zero3_no_prefetch.yaml` |
# | ZeRO-3, prefetch by thresholds | `deepspeed/zero3_prefetch.yaml` |
#
# **An honest word about this machine.** On a GPU (not checked here), collectives run on their own
# CUDA streams, so a prefetched all-gather travels while the previous layer computes. <!-- fact: torch.gpu_collectives_own_stream --> On a CPU there are no streams.
# Gloo runs collectives on its own worker threads, <!-- fact: torch.gloo_worker_threads --> so
# DeepSpeed's asynchronous all-gathers can proceed while the training thread computes, on the same
# few cores (`14_prefetch_details`: here, mostly waiting); <!-- fact: deepspeed.zero3_async_all_gather --> FSDP2's are synchronous: the training
# thread waits for each. <!-- fact: torch.fsdp2_gathers_synchronous -->
# Here FSDP's prefetch *moves a gather ahead of compute* and ZeRO-3's prefetch settings *merge* gathers; <!-- fact: deepspeed.zero3_bucket_gathers_once -->
# the traces show both.

# %%
import os
import re

from helpers import facts, nb
from helpers.core.config import load_job_config
from helpers.core.metrics import WARMUP_STEPS
from helpers.core.models import resolve_model
from helpers.job import wrap
from helpers.nb import plots, results, traces
from helpers.nb.claims import claim, ran, step_times, timing

SIZE = nb.setup()  # "quick" under `make test`: the same cells, smaller batches
facts.show("torch.fsdp2_gathers_synchronous", "deepspeed.zero3_async_all_gather")  # who waits for a gather on gloo
GPUS = nb.gpu_count()
NPROC = GPUS if GPUS else 2
MODEL = "small" if GPUS and SIZE == "full" else "tiny"  # on a CPU, tiny keeps the profiled jobs short
BATCH = "--micro-batch 4 --seq-len 32" if SIZE == "quick" else "--micro-batch 8 --seq-len 64"
STEPS = 4
ARGS = f"--model {MODEL} --steps {STEPS} {BATCH} --profile"  # --profile records steps 2 and 3
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
ran(f"four short jobs ({STEPS} steps), each rank tracing the two steps after warm-up", pf.values(), model=MODEL,
    steps=STEPS, world_size=NPROC, dist_backend="nccl" if GPUS else "gloo", profiled_steps=[2, 3])
claim("every rank of every job wrote its trace, and each job ran the config the table names",
      all((r.path / f"trace_rank{i}.json").exists() for r in pf.values() for i in range(NPROC))
      and all(r.summary["config"].endswith(f"/{v[3:]}.yaml") for r, v in zip(pf.values(), PF.values())),
      configs=[r.summary["config"] for r in pf.values()])


def differ(a, b, skip=("source", "out", "config_file")):
    """Dotted keys where two (nested) configs differ."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return [""] if a != b else []
    return sorted(f"{k}.{d}".rstrip(".") for k in a.keys() | b.keys() if k not in skip
                  for d in differ(a.get(k), b.get(k), skip))


fsdp_diff = differ(pf["FSDP no prefetch"].config, pf["FSDP prefetch"].config)
claim("the FSDP pair differs only in its forward and backward prefetch",
      fsdp_diff == ["fsdp.backward_prefetch", "fsdp.forward_prefetch"], differ=fsdp_diff)
zero_diff = differ(pf["ZeRO-3 no prefetch"].config, pf["ZeRO-3 prefetch"].config)
zo = {k: pf[k].config["deepspeed"]["json"]["zero_optimization"] for k in ("ZeRO-3 no prefetch", "ZeRO-3 prefetch")}
claim("the ZeRO-3 pair differs only in stage3_* thresholds and overlap_comm, and both set "
      "stage3_param_persistence_threshold 0", "deepspeed.json.zero_optimization.overlap_comm" in zero_diff
      and all(re.fullmatch(r"deepspeed\.json\.zero_optimization\.(stage3_\w+|overlap_comm)", d) for d in zero_diff)
      and all(z["stage3_param_persistence_threshold"] == 0 for z in zo.values()), differ=zero_diff)
facts.show("accelerate.fsdp2_ignores_prefetch_keys")  # why the FSDP pair needs helpers.train, not accelerate launch
plots.timeline(list(pf.values()), labels=list(pf));

# %% [markdown]
# **Reading it.** Each panel is one run's step 2; per rank, the upper lane is compute (the training
# thread's operators, including autograd nodes that call a collective and wait in it), the
# lower lane communication (gloo's transfers); shaded: rank 0's phases. Each
# FSDP gather brings one unit: the input embedding, a decoder block, or the final norm + head (the
# units `helpers.train` makes from these files, as `accelerate launch` would). <!-- fact: accelerate.fsdp2_embedding_and_tail_units -->
# ZeRO-3 without prefetch gathers each module's own parameters when it runs, in forward and again
# in backward: many small transfers. <!-- fact: deepspeed.zero3_gathers_per_module -->
# With its default-sized prefetch bucket (5e7 elements, bigger than this whole model) it fetches,
# from its second step on, everything in the first gather and keeps each parameter until its last
# use in backward: one all-gather per step. <!-- fact: deepspeed.zero3_bucket_gathers_once --> It
# keeps a parameter whose next use is prefetched or within `stage3_max_reuse_distance` (printed below). <!-- fact: deepspeed.zero3_release_not_by_max_live -->
#
# Here prefetch changed no loss: all four runs give identical losses (a GPU check allows 1e-2).

# %%
losses = {k: r.summary["losses"] for k, r in pf.items()}
facts.show("deepspeed.zero3_bucket_gathers_once", "deepspeed.zero3_release_not_by_max_live")
print("stage3_max_reuse_distance in zero3_prefetch.json:",
      pf["ZeRO-3 prefetch"].config["deepspeed"]["json"]["zero_optimization"].get("stage3_max_reuse_distance",
                                                                                  "unset (DeepSpeed's default 1e9)"))
spread = max(max(s) - min(s) for s in zip(*losses.values(), strict=True))
PARITY = nb.bitwise_parity_expected(NPROC)
alike = spread == 0 if PARITY else spread < 1e-2
if PARITY:
    claim("all four runs give identical losses at every step", alike, largest_gap=spread,
          losses=[round(x, 4) for x in losses["FSDP prefetch"]])
else:
    claim("all four runs' losses are within 1e-2 of each other at every step (GPU)", alike, largest_gap=spread)

# %% [markdown]
# ### What FSDP's prefetch reorders
#
# FSDP2 marks its work in the trace (`FSDP::all_gather (model.layers.1)`,
# `FSDP::post_forward (model.layers.0)`, ...). <!-- fact: torch.fsdp2_trace_labels --> Without forward
# prefetch, block 1 is gathered when its own forward starts, after block 0 has finished; with it,
# block 0's forward first issues block 1's all-gather (`set_modules_to_forward_prefetch`), before
# block 0 computes. <!-- fact: torch.fsdp2_forward_prefetch_order --> The trace can show less:
# that the gather starts before block 0's forward is done.

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
# FSDP's count follows from its units: forward gathers each unit that holds parameters once; backward gathers again
# every unit that resharded after forward (the embedding and the blocks; the final norm + head
# unit stays gathered, needed again at once, and the root holds no parameters here); <!-- fact: accelerate.fsdp2_keeps_root_tail_gathered -->
# gradients are reduce-scattered once per unit that holds parameters. FSDP's prefetch changes *when*,
# not *how many*. <!-- fact: torch.fsdp2_collective_counts -->
# `helpers.job.wrap.expected_collectives` writes that down; the table is what the traces counted
# (rank 0, one step; MB = the gathered (unsharded) tensor's size, bf16 for gathers; peak and step
# time: each job's own).

# %%
tab = traces.collective_table(list(pf.values()), labels=list(pf))
tab["step_time_ms"] = [r.summary["step_time_s"] * 1e3 for r in pf.values()]
tab.round(2)

# %%
units_tf = wrap.check_wrap_policy(load_job_config("launch_configs/fsdp/full_shard_prefetch.yaml"),
                                  resolve_model(MODEL))
want = wrap.expected_collectives(units_tf, reshard_after_forward=True)
n_tensors = len(list(wrap.meta_model(resolve_model(MODEL)).parameters()))
model_mb = sum(u.num_params for u in units_tf) * 2 / 1e6  # the whole model in bf16
fsdp_rows = tab.loc[["FSDP no prefetch", "FSDP prefetch"]]
fsdp_exact = ((fsdp_rows.all_gathers == want["all_gathers"]).all()
              and (fsdp_rows.reduce_scatters == want["reduce_scatters"]).all()
              and ((fsdp_rows.all_gather_MB * 1e6 - want["all_gather_bytes"]).abs() < 1).all()  # to the byte: the
              and units_tf[-1].num_params == 0)  # embedding's re-gather and norm + head's differ by 256 B; root: none
claim(f"FSDP's {len(units_tf)} units predict its collectives exactly (counts, and gathered bytes to the byte), with and "
      "without prefetch; the root unit holds no parameters", fsdp_exact, expected=want,
      counted=fsdp_rows[["all_gathers", "reduce_scatters"]].to_dict("index"),
      gathered_bytes=(fsdp_rows.all_gather_MB * 1e6).round().astype(int).to_dict(), root_params=units_tf[-1].num_params)
per_unit = {k: traces.fsdp_gathers_per_step(pf[k]) for k in fsdp_rows.index}  # from the traces' unit labels
told = {u.name.replace("+", ", "): 1 if "lm_head" in u.name else 2 for u in units_tf if u.num_params}  # the prose
claim("per unit, in both FSDP traces: the embedding and each block are gathered twice per step (forward, then "
      "backward again), the norm + head unit once", all(g == told for g in per_unit.values()),
      gathers_per_step=per_unit)
claim(f"ZeRO-3 without prefetch gathers each of the {n_tensors} parameter tensors on its own, in forward and "
      "again in backward (twice the model's bytes)", tab.loc["ZeRO-3 no prefetch", "all_gathers"] == 2 * n_tensors
      and abs(tab.loc["ZeRO-3 no prefetch", "all_gather_MB"] - 2 * model_mb) < 1e-3,
      all_gathers=int(tab.loc["ZeRO-3 no prefetch", "all_gathers"]), MB=tab.loc["ZeRO-3 no prefetch", "all_gather_MB"],
      model_MB=model_mb)
bucket = zo["ZeRO-3 prefetch"]["stage3_prefetch_bucket_size"]
n_params = pf["ZeRO-3 prefetch"].summary["num_params"]
per_step = traces.collectives(pf["ZeRO-3 prefetch"]).all_gathers.tolist()
print(f"the config's setting: stage3_prefetch_bucket_size {bucket} elements; the model: {n_params} parameters")
claim("ZeRO-3 with its prefetch settings (the bucket and reuse distance printed above) gathers once per step, in both "
      "profiled steps", per_step == [1, 1], all_gathers_per_step=per_step)

# %% [markdown]
# ## 3 · What prefetch holds: the size of one gather
#
# `largest_all_gather_MB` is what one gather puts in memory at once: with ZeRO-3's bucket the whole
# model, without it one module's parameters (here one tensor). A prefetched FSDP unit is gathered
# earlier, so by design one more unit can be held next to the one computing (not measured: traces
# show when a gather starts, not how long it is held). <!-- fact: torch.fsdp2_forward_prefetch_order -->
# We claim nothing from the table's `peak_allocated_MB`: one job per setting, and identical jobs'
# peaks differ (`18_fit_details` prints by how much).

# %%
largest_unit = max(units_tf, key=lambda u: u.num_params)  # in the wrap plan
unit_mb = largest_unit.num_params * 2 / 1e6  # in bf16
big = tab["largest_all_gather_MB"]
claim("ZeRO-3's prefetch bucket gathers the whole model at once", abs(big["ZeRO-3 prefetch"] - model_mb) < 1e-3,
      largest_gather_MB=big["ZeRO-3 prefetch"], model_MB=model_mb)
tensor_mb = max(q.numel() for q in wrap.meta_model(resolve_model(MODEL)).parameters()) * 2 / 1e6  # bf16
# bytes are exact: largest tensor 0.256 MB of a 1.169 MB model (0.22) at full and quick size (tiny)
claim("without prefetch ZeRO-3's largest gather is the largest single tensor, under a quarter of the model (the count "
      "above shows one gather per tensor)",
      abs(big["ZeRO-3 no prefetch"] - tensor_mb) < 1e-3 and big["ZeRO-3 no prefetch"] < model_mb / 4,
      largest_gather_MB=big["ZeRO-3 no prefetch"], largest_tensor_MB=tensor_mb, model_MB=model_mb)
claim(f"FSDP's largest single gather is the same, prefetch or not: the bytes of the wrap plan's largest unit "
      f"(a {largest_unit.cls})", big["FSDP prefetch"] == big["FSDP no prefetch"]
      and abs(big["FSDP prefetch"] - unit_mb) < 1e-3,
      largest_gather_MB=big[["FSDP no prefetch", "FSDP prefetch"]].tolist(), largest_unit_MB=unit_mb,
      units_MB=[round(u.num_params * 2 / 1e6, 4) for u in units_tf])

# %% [markdown]
# **Step time.** Medians and quartiles of each job's two profiled steps: one run each, a rough
# look that calls no verdict (notebook 07 says why). On
# gloo FSDP2 waits for each gather, so by design its prefetch reorders them and cannot hide them
# behind compute <!-- fact: torch.fsdp2_gathers_synchronous -->. A difference between two single runs
# does not say why (not checked here: runs drift, notebook 07, and the FSDP pair also differs in backward prefetch).

# %%
timed = {k: r.metrics.step.iloc[WARMUP_STEPS:].tolist() for k, r in pf.items()}  # the steps step_times keeps
traced = {k: traces.step_numbers(r) for k, r in pf.items()}
claim("each job's step times are the two steps its trace recorded (rank 0's ProfilerStep numbers)",
      all(timed[k] == traced[k] and len(step_times(r)) == 2 for k, r in pf.items()), steps=timed, traced=traced)
for a, b in (("FSDP prefetch", "FSDP no prefetch"), ("ZeRO-3 prefetch", "ZeRO-3 no prefetch")):
    print(f"{timing(a, step_times(pf[a]), b, step_times(pf[b])).measured()}, one run each")

# %% [markdown]
# ## Recap: measured on this machine

# %%
ran(f"model {MODEL}, {NPROC} ranks, {'GPU (nccl)' if GPUS else 'CPU (gloo)'}", pf.values(), model=MODEL,
    world_size=NPROC, dist_backend="nccl" if GPUS else "gloo")
claim(f"prefetch changes when FSDP gathers, not how many: with and without prefetch the traces count the gathers "
      f"(count and total bytes) and reduce-scatters its {len(units_tf)} units predict; with it, block 1's gather starts "
      "before block 0's forward is done, without it after",
      fsdp_exact and ag1 < done1 and ag0 > done0,  # fact: torch.fsdp2_forward_prefetch_order
      counted=fsdp_rows[["all_gathers", "all_gather_MB", "reduce_scatters"]].to_dict("index"), predicted=want,
      block1_gather_vs_block0_done_ms={"prefetch": [ag1, done1], "no prefetch": [ag0, done0]})
n_zero = int(tab.loc["ZeRO-3 no prefetch", "all_gathers"])
n_one = int(tab.loc["ZeRO-3 prefetch", "all_gathers"])
claim("ZeRO-3's prefetch settings merge its per-module gathers into one: two per parameter tensor in the step counted "
      "without prefetch, one with them, the whole model at once",
      n_zero == 2 * n_tensors and n_one == 1 and abs(big["ZeRO-3 prefetch"] - model_mb) < 1e-3,
      all_gathers_no_prefetch=n_zero, tensors=n_tensors, all_gathers_prefetch=n_one,
      largest_gather_MB=big["ZeRO-3 prefetch"], model_MB=model_mb)
claim("all four settings give identical losses" if PARITY else "all four settings train alike (within 1e-2)", alike,
      largest_gap=spread)

# %% [markdown]
# More in the deep dive `14_prefetch_details`: other unit choices, computing and communicating at
# once on gloo, and `--compile`.
#
# Next: `05_loading`.

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
