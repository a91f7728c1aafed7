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
# # 03 · Offload: where the bytes live
#
# **The question.** The offload row of Accelerate's FSDP-vs-DeepSpeed concept guide says: FSDP offloads all or nothing, while
# DeepSpeed offloads parameters and the optimizer separately (and can go to NVMe: the deep dive
# `13_offload_details`). What does each CPU offload setting really move, and does it change training?
#
# **What we run.** The same model, data and steps with five configs, 2 ranks each (1 on a
# one-GPU machine):
#
# | run | config | offload setting |
# |---|---|---|
# | FSDP, no offload | `launch_configs/fsdp/full_shard.yaml` | - |
# | FSDP offload | `launch_configs/fsdp/full_shard_offload.yaml` | `fsdp_offload_params: true` <!-- fact: accelerate.fsdp_offload_one_switch --> |
# | DeepSpeed, no offload | `launch_configs/deepspeed/zero3.yaml` | - |
# | DeepSpeed optimizer | `launch_configs/deepspeed/zero3_offload_optimizer.yaml` | `offload_optimizer: cpu` |
# | DeepSpeed params + optimizer | `launch_configs/deepspeed/zero3_offload.yaml` | `offload_optimizer` + `offload_param: cpu` |
#
# **On a CPU-only machine** "device" and "host" are the same RAM: the runs show where each backend
# *puts* its states (its own bookkeeping) and the extra copies some settings make, not a saving of
# accelerator memory. On a GPU (not run here) the same cells read each tensor's real device, and
# the "device" column is what stays in accelerator memory: offload frees the rest.

# %%
import os

from helpers import facts, nb
from helpers.nb import plots, results, tables
from helpers.nb.claims import claim, ran

SIZE = nb.setup()  # "quick" under `make test`: the same cells, fewer steps
STEPS = 4 if SIZE == "quick" else 10
GPUS = nb.gpu_count()
NPROC = min(GPUS, 2) if GPUS else 2  # offload needs no more ranks to show what it moves
ARGS = "--model tiny --micro-batch 8 --seq-len 64"  # the tiny model: its size is printed in the recap
os.environ.update(STEPS=str(STEPS), NPROC=str(NPROC), ARGS=ARGS)
print(f"size={SIZE}: {STEPS} steps on {NPROC} ranks ({'GPU' if GPUS else 'CPU only: device and host are the same RAM'})")

# %% [markdown]
# ## The offload keys
#
# One key in FSDP; <!-- fact: accelerate.fsdp_offload_one_switch --> two in DeepSpeed, `offload_param` for the parameter partitions and
# `offload_optimizer` for the rest, each to `cpu` or `nvme` <!-- fact: deepspeed.offload_keys --> <!-- fact: deepspeed.zero3_offload_keys --> (where
# each config *asks* each kind of state to go; section 1 shows where each backend books the bytes; NVMe runs in
# the deep dive):

# %%
# NBVAL_CHECK_OUTPUT
CONFIGS = {"FSDP, no offload": "fsdp/full_shard", "FSDP offload": "fsdp/full_shard_offload",
           "DeepSpeed, no offload": "deepspeed/zero3", "DeepSpeed optimizer": "deepspeed/zero3_offload_optimizer",
           "DeepSpeed params + optimizer": "deepspeed/zero3_offload", "DeepSpeed NVMe": "deepspeed/zero3_nvme"}
print(tables.settings_table(CONFIGS).to_string())

# %% [markdown]
# ## Five runs
#
# Each run records (how the job measures; not checked here), after the backward pass of step 1, every tensor of the four kinds of state on
# each rank and where it is (`memory_location_bytes` in `summary.json`): on a GPU the tensor's
# device; here the backend's offload bookkeeping (FSDP2's `offload_to_cpu` per parameter, <!-- fact: torch.fsdp2_offload_policy_per_module -->
# DeepSpeed's `offload_optimizer`/`offload_param` and each partition's final location).

# %% language="bash"
# for c in fsdp/full_shard fsdp/full_shard_offload deepspeed/zero3 deepspeed/zero3_offload_optimizer deepspeed/zero3_offload; do
#     torchrun --standalone --nproc_per_node $NPROC -m helpers.train --config launch_configs/$c.yaml \
#         --out notebooks/runs/03_$(basename $c) $ARGS --steps $STEPS | tail -n 1
# done

# %%
RUNS = {label: results.load_run(f"notebooks/runs/03_{path.split('/')[1]}") for label, path in CONFIGS.items()
        if "nvme" not in path}  # the NVMe run: the deep dive's
BASE = {label: RUNS["FSDP, no offload" if label.startswith("FSDP") else "DeepSpeed, no offload"] for label in RUNS}
print(f"{len(RUNS)} runs loaded")
ran(f"the five runs train the same model on the same data for {STEPS} steps, {NPROC} ranks each", RUNS.values(),
    model="tiny", seed=0, micro_batch=8, seq_len=64, steps=STEPS, world_size=NPROC)
claim("each run used the config the table names", all(r.summary["config"] == f"launch_configs/{CONFIGS[label]}.yaml"
                                                      for label, r in RUNS.items()),
      configs=[r.summary["config"].split("/", 1)[1] for r in RUNS.values()])

# %% [markdown]
# ## 1 · Where each state lives
#
# MB held by rank 0, per kind of state, and where:

# %%
print(tables.location_table(RUNS).to_string())

# %%
axes = plots.location_bars(list(RUNS.values()), list(RUNS))
axes[0].figure.suptitle("rank 0's state by location" + ("" if GPUS else " (CPU only: device and host are one RAM)"))
axes[0].figure.tight_layout()

# %% [markdown]
# **What it shows.**
#
# * **FSDP offload puts everything on the host**: parameter shards, gradients and
#   Adam's states, and the optimizer steps there (on this CPU no byte moves). <!-- fact: torch.fsdp2_cpu_offload_all --> <!-- fact: torch.cpu_offload_on_cpu_is_noop --> No key offloads one
#   kind of state alone (Accelerate has one switch for the whole model; torch's `fully_shard`
#   takes it per module). <!-- fact: torch.fsdp2_offload_policy_per_module --> <!-- fact: accelerate.fsdp_offload_one_switch -->
# * **DeepSpeed can offload the optimizer alone**: with `offload_optimizer` the fp32 master,
#   Adam's states and the reduced gradient partitions go to the host, while the bf16
#   parameter partitions stay next to the compute. <!-- fact: deepspeed.zero3_offload_keys --> DeepSpeed also keeps an fp32 copy of
#   the gradient partition on the host for its host-side step, alive between steps, so after
#   backward the "grads" bar is one fp32 copy taller (without offload ZeRO-3 makes that copy
#   during the step and frees it after): <!-- fact: deepspeed.offload_optimizer_keeps_fp32_grads -->
#   this offload places bytes on the host *and* keeps more alive.
# * **Params + optimizer** moves every bf16 parameter partition to the host too. The
#   "persistent" small parameters (at most `stage3_param_persistence_threshold` elements each;
#   in this tiny model every decoder-layer weight and the final norm) also keep a whole copy
#   next to the compute (booked on the device here; not checked on a GPU). <!-- fact: deepspeed.zero3_offload_keys --> <!-- fact: deepspeed.zero3_persistent_small_params -->
#
# Here the location checks below read each backend's bookkeeping: they catch a config key that did not take
# effect, not bytes crossing a bus; the last one holds each place's bytes to the ZeRO model. (The last fact printed below takes its evidence from its own test engine, whose threshold is set to 16: there a 256-element weight is not kept whole.)

# %%
import json
from pathlib import Path

from helpers.core.models import resolve_model
from helpers.estimate import is_persistent, persistence_threshold
from helpers.job.wrap import meta_model


def places(label, cat, rank=0):
    return set(tables.where(RUNS[label], cat, rank))


facts.show("torch.fsdp2_offload_policy_per_module", "deepspeed.zero3_offload_keys",
           "deepspeed.offload_optimizer_keeps_fp32_grads", "deepspeed.zero3_persistent_small_params")
ALL3 = ("params", "grads", "optimizer_states")
R = range(NPROC)
def where_all(label, cats):
    """{category: the places it was booked in, over every rank}."""
    return {c: sorted(set().union(*(places(label, c, r) for r in R))) for c in cats}


claim("FSDP without offload: FSDP2 marked no parameter for offload, so params, grads and optimizer states are all "
      "booked on the device, on every rank",
      all(places("FSDP, no offload", c, r) == {"device"} for c in ALL3 for r in R),
      booked=where_all("FSDP, no offload", ALL3))
claim("FSDP offload: FSDP2 marked every parameter for offload, on every rank, so all three are booked on the host "  # fact: torch.fsdp2_cpu_offload_all
      "(the bookkeeping books a marked parameter's grad and Adam's states with it)",
      all(places("FSDP offload", c, r) == {"host"} for c in ALL3 for r in R), booked=where_all("FSDP offload", ALL3))
claim("FSDP offload holds the same state bytes as no offload: the same shards, booked on the host (buffers outside the "  # fact: torch.fsdp2_cpu_offload_all
      "state are not in these counts)",
      RUNS["FSDP offload"].summary["memory_bytes"] == RUNS["FSDP, no offload"].summary["memory_bytes"],
      rank0_offload=RUNS["FSDP offload"].summary["memory_bytes"][0],
      rank0_no_offload=RUNS["FSDP, no offload"].summary["memory_bytes"][0])
claim("DeepSpeed's offload_optimizer took effect: the engine flags its optimizer offloaded and its params not, so the "  # fact: deepspeed.zero3_offload_keys
      "fp32 master, Adam's states and the grad partitions are booked on the host (the bookkeeping books them by that "
      "flag) and the params on the device",
      all(places("DeepSpeed optimizer", "params", r) == {"device"} for r in R)
      and all(places("DeepSpeed optimizer", c, r) == {"host"}
              for c in ("optimizer_states", "master_params", "grads") for r in R),
      booked=where_all("DeepSpeed optimizer", ("params", "grads", "master_params", "optimizer_states")))
host_grads = [tables.where(RUNS["DeepSpeed optimizer"], "grads", r)["host"] for r in R]
dev_grads = [sum(tables.where(RUNS["DeepSpeed, no offload"], "grads", r).values()) for r in R]
fp32_master = [RUNS["DeepSpeed, no offload"].summary["memory_bytes"][r]["master_params"] for r in R]
claim("after backward, DeepSpeed without offload holds the bf16 gradient partition only (half the fp32 master's "  # fact: deepspeed.offload_optimizer_keeps_fp32_grads
      "bytes: its fp32 copy is made during the step); with the optimizer offloaded it already holds one more fp32 "
      "copy, for the host-side step: the extra bytes equal the fp32 master's",
      all(2 * d == m for d, m in zip(dev_grads, fp32_master))
      and all(h - d == m for h, d, m in zip(host_grads, dev_grads, fp32_master)),
      host_MB=[h / 1e6 for h in host_grads], no_offload_MB=[d / 1e6 for d in dev_grads],
      fp32_master_MB=[m / 1e6 for m in fp32_master])
model = RUNS["DeepSpeed params + optimizer"].summary["model"]
zero = json.loads(Path("launch_configs/deepspeed/zero3_offload.json").read_text())["zero_optimization"]
THRESHOLD = persistence_threshold(zero)  # the config's value, or DeepSpeed's default
numel = {n: p.numel() for n, p in meta_model(resolve_model(model)).named_parameters()}  # shapes only, no weights
kept = [n for n, v in numel.items() if is_persistent(v, THRESHOLD)]
persistent = 2 * sum(numel[n] for n in kept)  # their bf16 bytes
print(f"the config's arithmetic (model shapes and the JSON, not a run): threshold {THRESHOLD} elements; "
      f"{model}'s parameters over it: {sorted(set(numel) - set(kept))}; {len(kept)} at or under it")
both = [tables.where(RUNS["DeepSpeed params + optimizer"], "params", r) for r in R]
alone = [tables.where(RUNS["DeepSpeed optimizer"], "params", r) for r in R]
claim("with offload_param, the param bytes not booked on the host are exactly the bf16 bytes of the whole parameters "  # fact: deepspeed.zero3_persistent_small_params
      "of at most the threshold's elements (ZeRO-3 kept exactly those whole), and host plus device equal the params "
      "without offload_param",
      all(b.get("host", 0) > 0 and b.get("device", 0) == persistent and b["host"] + b["device"] == a["device"]
          for b, a in zip(both, alone)),
      host_MB=[b.get("host", 0) / 1e6 for b in both], device_MB=[b.get("device", 0) / 1e6 for b in both],
      persistent_MB=persistent / 1e6, without_offload_param_MB=[a["device"] / 1e6 for a in alone])
counters = 4 * RUNS["FSDP offload"].summary["audit"]["parameters"]  # Adam's fp32 step counters: at most one per tensor


def expected(label):
    """(device, host) bytes per rank by the ZeRO model's formula (memory_theory_bytes), plus the persistent copies."""
    t = RUNS[label].summary["memory_theory_bytes"]
    if label == "FSDP offload":
        return 0, sum(t.values())
    host = t["master_params"] + t["optimizer_states"] + t["grads"] + t["master_params"]  # + the fp32 grad copy
    return (t["params"] + persistent, host) if label == "DeepSpeed optimizer" else (persistent, host + t["params"])


def held(label, r, place):
    return sum(c[place] for c in RUNS[label].summary["memory_location_bytes"][r].values())


off = {label: [(held(label, r, "device") - expected(label)[0], held(label, r, "host") - expected(label)[1]) for r in R]
       for label in ("FSDP offload", "DeepSpeed optimizer", "DeepSpeed params + optimizer")}
claim("each offload run's bytes per place are the ZeRO model's for 1/N of the model: FSDP offload's whole fp32 state "
      "on the host; with DeepSpeed, the fp32 master, Adam's states, the bf16 grads and their fp32 copy on the host, "
      "the bf16 params too with offload_param, the rest and the persistent copies next to the compute (Adam's 4-byte "
      "step counters aside: one per tensor under FSDP, one per flat group under DeepSpeed)",
      all(d == 0 and h == (counters if label == "FSDP offload" else 4) for label, v in off.items() for d, h in v),
      bytes_over_model_device_host=off, fsdp_counters=counters)

# %% [markdown]
# ## 2 · Does it change training?

# %%
losses = {label: r.summary["losses"] for label, r in RUNS.items()}
same = {label: losses[label] == BASE[label].summary["losses"] for label in RUNS if BASE[label] is not RUNS[label]}
for label in RUNS:
    print(f"{label:30s} final loss {losses[label][-1]:.4f}  "
          + (f"identical to no offload: {same[label]}" if label in same else "(the baseline)"))
if GPUS:  # a host-side optimizer step can round unlike the GPU's kernels (not yet run on a GPU)
    gap = {label: max(abs(a - b) / abs(b) for a, b in zip(losses[label], BASE[label].summary["losses"]))
           for label in same}
    claim("every offload setting trains like the same backend without offload (every step's loss within 1%)",
          max(gap.values()) < 0.01, relative_gap=gap)
else:
    claim("every offload setting run here gives the same backend's losses without offload, bit for bit",
          all(same.values()), identical=same)
if nb.bitwise_parity_expected(NPROC):  # CPU; GPU: see nb.bitwise_parity_expected
    claim("FSDP without offload gives DeepSpeed's losses without offload bit for bit (the aligned pair of notebook 02)",
          losses["FSDP, no offload"] == losses["DeepSpeed, no offload"], largest_gap=max(abs(a - b) for a, b in zip(
              losses["FSDP, no offload"], losses["DeepSpeed, no offload"], strict=True)))
if SIZE == "full" and NPROC == 2:  # the last of 10 steps is a bump (the deep dive 10_launching_details traces it)
    lo = losses["FSDP, no offload"]
    claim("the last loss is a bump at step 9 after the loss had fallen at every step before it, not a stall "
          "(the deep dive 10_launching_details traces it)",
          lo[9] > lo[8] + 0.3 and all(b < a for a, b in zip(lo[:9], lo[1:9])), steps_0_to_9=[round(x, 4) for x in lo[:10]])
ds_off = {label: (r.summary["effective"]["optimizer"], r.config["deepspeed"]["json"].get("zero_force_ds_cpu_optimizer"))
          for label, r in RUNS.items() if label.startswith("DeepSpeed") and "no offload" not in label}
claim("every DeepSpeed offload run stepped torch's AdamW, its JSON setting zero_force_ds_cpu_optimizer false",
      all(v == ("AdamW", False) for v in ds_off.values()), optimizer_and_setting=ds_off)

# %% [markdown]
# On this CPU, offload changed the backends' bookkeeping and copies, not the arithmetic (our reading:
# the same torch AdamW steps on the host, as our JSONs set `zero_force_ds_cpu_optimizer: false`), <!-- fact: deepspeed.offload_needs_force_cpu_optimizer_off -->
# so the losses are the same bit for bit. On a GPU the step moves to the host; <!-- fact: deepspeed.offload_optimizer_steps_on_host -->
# we do not assume it rounds like the GPU's kernels, so there the check allows 1% per step (not yet
# run).
#
# **What it costs.** Without an accelerator there is no transfer to pay for: "copying to the host" is at most a copy
# within the same RAM (FSDP2 makes none). <!-- fact: torch.cpu_offload_on_cpu_is_noop --> On a GPU (not run here), every step,
# offloaded parameters cross PCIe to the GPU to compute with, <!-- fact: torch.fsdp2_offload_copies_to_gpu --> gradients go down
# to the host and the optimizer steps on the host's cores. <!-- fact: deepspeed.offload_optimizer_steps_on_host --> That time is
# the price of the accelerator memory offload frees. The deep dive `13_offload_details` prints the
# step times of these configs on this machine.
#
# ## Recap
#
# What this machine measured (from the run directories):

# %%
facts.show("deepspeed.offload_needs_force_cpu_optimizer_off")
totals = tables.location_totals(RUNS)
print(f"{RUNS['FSDP, no offload'].summary['num_params'] / 1e6:.1f}M params, {NPROC} ranks, {STEPS} steps, "
      f"on {RUNS['FSDP, no offload'].summary['device']}; state MB on rank 0 (device / host):")
for label, row in totals.iterrows():
    print(f"  {label:30s} {row['device']:7.1f} / {row['host']:7.1f}")

# %% [markdown]
# * Accelerate's FSDP has one offload switch, and it moves parameters, gradients and optimizer states
#   together; <!-- fact: accelerate.fsdp_offload_one_switch --> <!-- fact: torch.fsdp2_cpu_offload_all --> DeepSpeed offloads the optimizer alone (the bf16 params
#   stay) or the params too. <!-- fact: deepspeed.zero3_offload_keys -->
# * DeepSpeed's CPU optimizer offload keeps an fp32 gradient copy on the host between steps; <!-- fact: deepspeed.offload_optimizer_keeps_fp32_grads -->
#   ZeRO-3 keeps its small persistent params whole on every rank. <!-- fact: deepspeed.zero3_persistent_small_params -->
# * Here the losses did not change with offload, bit for bit (on a GPU the check allows 1%).
#   On a GPU the "device" column is what stays in accelerator memory, the rest paid for in PCIe traffic and a host-side
#   optimizer step (not measured here).
# * More in the deep dive `13_offload_details`: NVMe (what goes to disk, and why), the process's
#   peak, and step times.
#
# Next: `04_prefetch`.

# %% [markdown]
# ## Optional: try other settings
#
# Nothing below is part of the story above, and nothing runs until you click **Run**. The
# panel's defaults are this notebook's own command (`$ARGS --steps $STEPS`); it launches the selected configs
# into its own run directories (`notebooks/runs/panel_03_*`) and redraws where rank 0's states live. Try
# the `small` model: `13_offload_details` says what changes.

# %%
from helpers.nb import widgets

widgets.ControlPanel("03", {"FSDP": "launch_configs/fsdp/full_shard.yaml",
                            "FSDP offload": "launch_configs/fsdp/full_shard_offload.yaml",
                            "ZeRO-3": "launch_configs/deepspeed/zero3.yaml",
                            "ZeRO-3 offload optimizer": "launch_configs/deepspeed/zero3_offload_optimizer.yaml",
                            "ZeRO-3 offload all": "launch_configs/deepspeed/zero3_offload.yaml"},
                     args="$ARGS --steps $STEPS", plot=widgets.plot_locations,
                     selected=["FSDP offload", "ZeRO-3 offload all"])
