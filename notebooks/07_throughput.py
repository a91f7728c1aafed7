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
# # 07 · Throughput: tokens/s per device, step time and MFU
#
# **The question.** Hugging Face's write-up on aligning FSDP and DeepSpeed precision in
# Accelerate ends on a throughput table: on 4x A100, FSDP in its aligned
# mode and DeepSpeed ZeRO-3 train IBM Granite 7B at 3158.7 and 3094.5 tokens/s per device,
# an MFU of 0.41 and 0.40. Can you make that table for your own hardware, and how does it
# move with the model's size and the number of ranks?
#
# **What we run.** The write-up's aligned pair (bf16 compute, fp32 master weights) on
# this machine; <!-- fact: accelerate.fsdp2_bf16_fp32_shards --> <!-- fact: deepspeed.zero3_bf16_dtypes --> then both backends over model sizes and over 1, 2 and 4 ranks
# (`benchmarks/scaling.py`, which launches real `helpers.train` jobs and collects their
# summaries into a CSV).
#
# **What we look at.** Every job writes `tokens_per_s_per_rank` and `step_time_s` (median,
# warm-up steps left out; `helpers.core.metrics`), and `flops_per_token`, `peak_flops` and
# `mfu` (`helpers.job.observe.throughput`) into its `summary.json`. We put them next to the write-up's GPU numbers and
# ask what limits them here.

# %%
import os

import pandas as pd

from helpers import facts, nb
from helpers.core import metrics, models
from helpers.job.observe import throughput
from helpers.nb import plots, results
from helpers.nb.claims import claim, timing_runs

SIZE = nb.setup()
QUICK = SIZE == "quick"
GPUS = nb.gpu_count()
NPROC = nb.nproc()  # one rank per GPU on a GPU node (nccl), else 2 gloo ranks (one per core of the guide's 2-core box)
RANK_SWEEP = nb.world_sizes([1, 2, 4])  # on a GPU node: up to its number of GPUs
RANK_EXTRA = [n for n in RANK_SWEEP if n != NPROC]  # the NPROC point is the size sweep's own job
PAIR_STEPS = 8 if QUICK else 20
SIZES = ["tiny", "small"] if QUICK else ["tiny", "small", "medium"]
RANKS_MODEL = "tiny" if QUICK else "small"
SWEEP = "--steps 5 --micro-batch 2 --seq-len 64 --dtype fp32"
os.environ.update(NPROC=str(NPROC), PAIR_STEPS=str(PAIR_STEPS), SIZES=" ".join(SIZES),
                  RANK_EXTRA=" ".join(map(str, RANK_EXTRA)),
                  RANKS_MODEL=RANKS_MODEL, SWEEP=SWEEP)
print(f"size={SIZE}: pair {PAIR_STEPS} steps on {NPROC} ranks; sizes {SIZES}; ranks sweep on {RANKS_MODEL}; "
      f"warm-up steps left out: {metrics.WARMUP_STEPS}")

# %% [markdown]
# ## How a job counts: FLOPs per token, peak, MFU
#
# **MFU** = model FLOPs per token x tokens/s per device / the device's peak FLOP/s.
#
# * **FLOPs per token** = `6 N + 12 L H Q T`, for `L` layers of `H` attention heads of `Q`
#   dimensions each, over `T` tokens of context (the PaLM paper's count; nanoGPT and
#   torchtitan use it too). Each weight does a multiply-add (2 FLOPs) per token forward
#   and two backward: `6 N`. `N` leaves out the **embedding table** — a lookup does no
#   arithmetic, and in our presets it is a sizeable share of all parameters (the table
#   below) — but keeps the output
#   projection `lm_head`, a real hidden x vocab matmul. <!-- fact: torch.embedding_is_lookup --> <!-- fact: transformers.llama_lm_head_untied_linear --> `12 L H Q T` is attention's two
#   matmuls (`QK^T`, `AV`) over the sequence, not halved for the causal mask.
# * **Peak**: on a GPU, the dense peak in the compute dtype by device name
#   (`helpers.job.observe.throughput.GPU_PEAK_TFLOPS`, printed below; plain fp32 for fp32
#   jobs, as torch keeps TF32 off for matmuls) <!-- fact: torch.tf32_off_for_matmuls -->, or `--peak-tflops` for one
#   the table lacks (written for, not yet run on, a GPU). On a CPU there is no data sheet to trust,
#   so each job **measures** it at start: rank 0 alone times a 512x512 matmul in the job's
#   compute dtype on its one thread (the other ranks wait).
# * **Warm-up**: the first two steps are left out of the medians — step 0 pays first-touch
#   allocations and lazily created optimizer state, step 1 runs the
#   memory and dtype probes. <!-- fact: torch.adam_state_lazy --> <!-- fact: deepspeed.zero3_optimizer_state_lazy -->
#
# The FLOPs of our presets, from the same function the jobs call (shapes only, no memory):

# %%
# NBVAL_CHECK_OUTPUT
rows = []
for name in models.PRESETS:
    with models.torch.device("meta"):
        m = models.build_model(models.resolve_model(name), models.torch.bfloat16, seed=0, device="meta")
    total, emb = models.count_params(m), throughput.embedding_params(m)
    rows.append({"model": name, "params": total, "embedding": emb, "N (no embedding)": total - emb,
                 "FLOPs/token (T=64)": throughput.flops_per_token(m, 64)})
presets = pd.DataFrame(rows).set_index("model")
presets["embedding share"] = (presets.embedding / presets.params).round(3)
print("GPU peaks (TFLOPS) by device and dtype:", throughput.GPU_PEAK_TFLOPS)
presets

# %%
facts.show("torch.embedding_is_lookup", "torch.tf32_off_for_matmuls")
claim("tiny's count is 6 N + 12 L H Q T by hand (N = 456,320 without the embedding, L = 2, H x Q = 4 x 32, "
      "T = 64)",
      presets.loc["tiny", "FLOPs/token (T=64)"] == 6 * 456_320 + 12 * 2 * 128 * 64,
      flops_per_token=int(presets.loc["tiny", "FLOPs/token (T=64)"]))

# %% [markdown]
# Its `6 N` term alone (attention left out, N rounded to 7e9) gives the write-up's MFU from its
# tokens/s to within 10%: Granite 7B at 3158.7
# tokens/s on an A100 (312 TFLOPS) is `6 x 7e9 x 3158.7 / 312e12`:

# %%
SEEDS = pd.DataFrame({"tokens/s/device": [3158.7, 3094.5], "step time (s)": [10.4, 10.6], "MFU": [0.41, 0.40]},
                     index=["FSDP (aligned), 4x A100", "DeepSpeed ZeRO-3, 4x A100"])
seed_mfu = 6 * 7e9 * SEEDS["tokens/s/device"] / 312e12
claim("6 N x tokens/s / peak gives the write-up's MFU within 10% (\"7B\" is a rounded N)",
      ((seed_mfu / SEEDS["MFU"] - 1).abs() < 0.1).all(), ours=seed_mfu.round(3).tolist(), write_up=SEEDS["MFU"].tolist())

# %% [markdown]
# ## The write-up's table, on this machine
#
# The aligned pair (the configs of notebook 00: FSDP `full_shard.yaml`, DeepSpeed
# `zero3.yaml`, bf16 compute on fp32 master weights), `tiny`, `NPROC` ranks. In a
# terminal, jobs longer than a few seconds also show a progress bar with the loss and
# tokens/s; the notebooks turn it off (`GUIDE_PROGRESS=0`, set by `nb.setup`), so each job's
# `step` lines are its progress. The pair runs twice, in turn (FSDP, DeepSpeed, FSDP,
# DeepSpeed): a shared machine can slow down in the middle of one job, and only repeated runs
# made in turn tell that apart from a backend.

# %% language="bash"
# for rep in 1 2; do
#     torchrun --standalone --nproc_per_node $NPROC -m helpers.train --config launch_configs/fsdp/full_shard.yaml \
#         --out notebooks/runs/07_fsdp_$rep --model tiny --steps $PAIR_STEPS | tail -n 2
#     torchrun --standalone --nproc_per_node $NPROC -m helpers.train --config launch_configs/deepspeed/zero3.yaml \
#         --out notebooks/runs/07_deepspeed_$rep --model tiny --steps $PAIR_STEPS | tail -n 2
# done

# %%
fsdp, ds, fsdp_2, ds_2 = results.load_runs("notebooks/runs/07_fsdp_1", "notebooks/runs/07_deepspeed_1",
                                           "notebooks/runs/07_fsdp_2", "notebooks/runs/07_deepspeed_2")


def table_row(run):
    s = run.summary
    return {"tokens/s/device": s["tokens_per_s_per_rank"], "step time (s)": s["step_time_s"], "MFU": s["mfu"]}


here = f"{fsdp.summary['world_size']}x {fsdp.summary['device']}"
pair = pd.DataFrame([table_row(r) for r in (fsdp, ds, fsdp_2, ds_2)],
                    index=[f"{name} (run {k}), {here}" for k in (1, 2)
                           for name in ("FSDP (aligned)", "DeepSpeed ZeRO-3")])
pd.concat([pair, SEEDS]).round(3)

# %%
print("peak per rank:", throughput.fmt_flops(fsdp.summary["peak_flops"]), "-", fsdp.summary["peak_flops_source"])
PAIR_RUNS = (fsdp, ds, fsdp_2, ds_2)
claim("every MFU is below 1 against a peak measured in the dtype the job's forward computes in",
      all(0 < r.summary["mfu"] < 1 and (f"dense {r.summary['dtypes']['forward_weight']}" if GPUS else
                                         f"{r.summary['dtypes']['forward_weight']} matmul") in r.summary["peak_flops_source"]
          for r in PAIR_RUNS),
      mfu=[r.summary["mfu"] for r in PAIR_RUNS], compute=[r.summary["dtypes"]["forward_weight"] for r in PAIR_RUNS],
      peak_sources=sorted({r.summary["peak_flops_source"].split(",")[0] for r in PAIR_RUNS}))
claim("the four jobs do the same training (identical losses, as in notebook 00)",
      all(r.summary["losses"] == fsdp.summary["losses"] for r in PAIR_RUNS))
PAIR = timing_runs("FSDP", [fsdp, fsdp_2], "DeepSpeed", [ds, ds_2], metrics.WARMUP_STEPS)
print(PAIR)
print(f"FSDP / DeepSpeed tokens/s: {1 / PAIR.ratio:.2f} here (medians), {3158.7 / 3094.5:.2f} in the write-up")
tps = max(r.summary["tokens_per_s_per_rank"] for r in (fsdp, fsdp_2))  # FSDP's run with more tokens/s
achieved = tps * fsdp.summary["flops_per_token"]
print(f"peak: an A100's 312 TFLOPS is {312e12 / fsdp.summary['peak_flops']:,.0f}x this core's (FSDP run 1's "
      f"peak); achieved FLOP/s: the write-up's {0.41 * 312e12 / achieved:,.0f}x ours; tokens/s: ours "
      f"{tps / 3158.7:.1f}x the write-up's (FSDP's run with more tokens/s)")

# %% [markdown]
# **What it means.** The two backends do the same work. Whether one was faster here is the
# verdict above: a difference is called only when every run of one is beyond every run of the
# other and their steps' spreads part (step times on a shared 2-core machine vary from step to
# step and from job to job); the write-up's two figures on 4x A100 (one number each, no spread) differ by 2%. The table shows every run: the
# same job's step time can move between runs (the run medians above).
# The absolute numbers are not comparable with the write-up's: the last line puts the peaks and
# the achieved FLOP/s side by side; tokens/s depends on both the model (ours needs far fewer
# FLOPs per token) and the hardware (this core has far less peak).
#
# ## bf16 on a CPU: fast or slow, by instruction set
#
# How fast a CPU runs a bf16 matmul depends on its instructions (torch's compiled CPU kernels,
# not checked here). The cell below lists what this one has; the first cell after the size
# sweep prints both measured peaks and checks which dtype is faster here (without bf16
# instructions, fp32 over 3x bf16; with them, bf16 above fp32). On a GPU, bf16 tensor cores
# are the fast path (not checked here). The peak is measured in the job's dtype, so MFU
# counts against the arithmetic the job does; each job measures it again (the fp32 sweep's
# range is printed below). The sweeps below train the **plain fp32 pair**
# (`fsdp/full_shard_low_precision.yaml --model-dtype fp32` next to `deepspeed/zero3_fp32.yaml`),
# whose speed does not depend on which bf16 instructions a CPU has.

# %%
flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
BF16_UNITS = sorted({f for f in flags if "bf16" in f})
print("bf16 instructions:", BF16_UNITS or "none")

# %% [markdown]
# ## Throughput and MFU vs model size
#
# Both backends, `NPROC` ranks, 2 sequences of 64 tokens per rank per step, fp32.
# Each line is one real job; the CSV is read back below.

# %% language="bash"
# python benchmarks/scaling.py --models $SIZES --world-sizes $NPROC $SWEEP --out notebooks/runs/07_size.csv

# %%
size = pd.read_csv("notebooks/runs/07_size.csv")
fp32_peak = size.peak_flops.median()
print(f"fp32 peak {throughput.fmt_flops(fp32_peak)} (median; the jobs measured "
      f"{throughput.fmt_flops(size.peak_flops.min())} to {throughput.fmt_flops(size.peak_flops.max())}) vs bf16 peak "
      f"{throughput.fmt_flops(fsdp.summary['peak_flops'])} per rank: fp32 / bf16 = {fp32_peak / fsdp.summary['peak_flops']:.2f}")
if not GPUS and not BF16_UNITS:
    claim("this CPU has no bf16 instructions: the median measured fp32 peak is over 3x the bf16 one",
          fp32_peak > 3 * fsdp.summary["peak_flops"], ratio=fp32_peak / fsdp.summary["peak_flops"])
elif not GPUS:
    claim(f"with {', '.join(BF16_UNITS)}, bf16 is the faster path on this CPU: its measured peak is above fp32's",
          fsdp.summary["peak_flops"] > fp32_peak, bf16_over_fp32=fsdp.summary["peak_flops"] / fp32_peak)
size[["backend", "model", "num_params", "flops_per_token", "step_time_s", "tokens_per_s_per_rank", "mfu"]].round(3)

# %%
fig, (left, right) = plots.plt.subplots(1, 2)
for backend, g in size.groupby("backend"):
    kw = dict(color=plots.COLORS[backend], label=backend, **plots.LINES[backend])
    left.plot(g.num_params, g.tokens_per_s_per_rank, **kw)
    right.plot(g.num_params, g.mfu, **kw)
left.set(xscale="log", yscale="log", xlabel="parameters", ylabel="tokens/s per rank", title="throughput vs size")
right.set(xscale="log", xlabel="parameters", ylabel="MFU", title="MFU vs size", ylim=(0, 1.2 * size.mfu.max()))
left.legend(), right.legend()
fig.tight_layout()

# %%
by = size.set_index(["backend", "model"])
COLS = ("fsdp", "deepspeed")
mfu = {b: [round(float(by.loc[(b, m), "mfu"]), 3) for m in SIZES] for b in COLS}
toks = {b: [round(float(by.loc[(b, m), "tokens_per_s_per_rank"]), 1) for m in SIZES] for b in COLS}
claim(f"on both backends each larger size processes fewer tokens per second ({' > '.join(SIZES)})",
      all(all(x > y for x, y in zip(v, v[1:])) for v in toks.values()), tokens_per_s=toks)
claim(f"and uses the core better: MFU is higher for every larger size than for tiny ({', '.join(SIZES[1:])})",
      all(min(v[1:]) > v[0] for v in mfu.values()), mfu_by_size=mfu)
rising = all(v == sorted(v) for v in mfu.values())
print(f"MFU {'rises' if rising else 'does not rise'} at every step up in size here ({' -> '.join(SIZES)}): {mfu}")
print("FSDP / DeepSpeed step time per size (one 5-step job each, no spread: not a comparison of the backends):",
      {m: round(float(by.loc[("fsdp", m), "step_time_s"] / by.loc[("deepspeed", m), "step_time_s"]), 2)
       for m in SIZES})

# %% [markdown]
# **What it means.** Bigger models process fewer tokens per second (more FLOPs per token),
# and the ones larger than `tiny` use the core better than `tiny` does. Our reading (the
# fixed costs are not measured here): a `tiny` step is a few small matmuls wrapped in fixed costs —
# Python, launching each op, the optimizer's per-parameter loop (FSDP's; DeepSpeed steps one
# flat partition), gloo's collectives (FSDP gathers each layer twice, reduces it once) — which do
# no model FLOPs. <!-- fact: torch.adamw_foreach_false_loops --> <!-- fact: deepspeed.zero3_steps_one_flat_partition --> <!-- fact: torch.fsdp2_collective_counts --> As the matmuls grow, those costs
# shrink relative to the arithmetic, and MFU is higher than tiny's. Whether it keeps rising
# with every size is the line above: it need not on a CPU, where a larger model's weights
# and activations also outgrow the caches (we have not broken `medium`'s step down). The last
# line compares the backends at each size from one short job each: with no spread to read,
# it is a pointer for your own runs, not a result (the pair above is the comparison).
#
# ## Throughput and MFU vs ranks
#
# The same model on 1, 2 and 4 ranks (on a GPU node: as many of those as it has GPUs). On a
# CPU machine with 2 cores (this one's count is printed below), at 4 ranks two ranks share
# each core. The point at this
# machine's own rank count is the size sweep's job (the same command), not run twice.

# %% language="bash"
# python benchmarks/scaling.py --models $RANKS_MODEL --world-sizes $RANK_EXTRA $SWEEP --out notebooks/runs/07_ranks.csv

# %%
facts.show("torch.fsdp2_collective_counts", "torch.adamw_foreach_false_loops", "deepspeed.zero3_steps_one_flat_partition")
ranks = pd.concat([pd.read_csv("notebooks/runs/07_ranks.csv"),
                   size[(size.model == RANKS_MODEL) & (size.world_size == NPROC)]]).sort_values("world_size")
ranks = ranks.reset_index(drop=True)
fig, (left, right) = plots.plt.subplots(1, 2)
for backend, g in ranks.groupby("backend"):
    kw = dict(color=plots.COLORS[backend], label=backend, **plots.LINES[backend])
    left.plot(g.world_size, g.tokens_per_s, **kw)
    right.plot(g.world_size, g.mfu, **kw)
left.set(xlabel="ranks", ylabel="tokens/s, all ranks", title=f"{RANKS_MODEL}: total throughput", xticks=RANK_SWEEP)
right.set(xlabel="ranks", ylabel="MFU (per rank)", title="MFU vs ranks", xticks=RANK_SWEEP,
          ylim=(0, 1.2 * ranks.mfu.max()))
left.legend(), right.legend()
fig.tight_layout()
ranks[["backend", "world_size", "step_time_s", "tokens_per_s_per_rank", "tokens_per_s", "mfu"]].round(3)

# %%
rk = ranks.set_index(["backend", "world_size"])
CORES = os.cpu_count()
print(f"cores on this machine: {CORES}")
for backend in ("fsdp", "deepspeed") if not GPUS and CORES <= 2 else ():  # on a GPU node each rank has its GPU
    two, four = rk.loc[(backend, 2)], rk.loc[(backend, 4)]
    # one short job per point, made one after the other: these ratios are printed, not compared (a timing
    # verdict needs repeated, interleaved runs: helpers.nb.claims.timing_runs)
    print(f"{backend}: 4 ranks over 2, per rank {four.tokens_per_s_per_rank / two.tokens_per_s_per_rank:.2f}x, "
          f"all ranks {four.tokens_per_s / two.tokens_per_s:.2f}x (one short job each)")
if not GPUS:
    print(f"at 4 ranks on {CORES} cores: {4 / CORES:g} ranks per core")

# %% [markdown]
# ## What limits MFU here, and what changes on a GPU node
#
# * **One thread per rank, oversubscribed at 4 ranks.** Each rank computes on one core
#   (`OMP_NUM_THREADS=1`); the peak is that core's. <!-- fact: torch.omp_num_threads_sets_intraop --> At 4 ranks on this 2-core
#   machine two ranks share a core (printed above), so each shares its core's peak with another rank. How much slower that
#   makes a rank depends on how much of its step it waits in collectives, leaving the core to
#   the other rank; the ratios printed above come from one short job each and move from run to
#   run on a shared machine, so this notebook draws no speed conclusion from them.
#   On a GPU node every rank has its own device.
# * **gloo collectives on the CPU.** FSDP gathers each layer's weights and reduce-scatters
#   its gradients; ZeRO-3 does the same in buckets. <!-- fact: torch.fsdp2_collective_counts --> <!-- fact: deepspeed.zero_bucket_defaults --> With gloo these are memory copies
#   and loopback sockets on the same 2 cores that compute: gloo's own threads can run them
#   beside the compute, but they take cycles from the same cores (notebook 04 counts the
#   collectives per step and times how long they run beside compute). <!-- fact: torch.gloo_worker_threads --> On GPUs, NCCL over
#   NVLink/InfiniBand runs on its own streams and FSDP's prefetch overlaps the next
#   layer's all-gather with this layer's compute (not checked here). <!-- fact: torch.gpu_collectives_own_stream -->
# * **Fixed costs per op.** A small model issues many small ops; on a GPU the same
#   launch overheads shrink with `torch.compile`, which fuses ops, and CUDA graphs (its
#   modes `"reduce-overhead"` and `"max-autotune"`, not the default). <!-- fact: torch.compile_default_no_cudagraphs --> We have not measured how
#   much of the write-up's 0.4 that accounts for.
# * **bf16 depends on the hardware.** The check after the size sweep says which dtype is
#   faster on this CPU; on GPUs bf16 is the fast path (not checked here). On each, MFU counts
#   against the peak in the job's own dtype (measured on a CPU, from the table on a GPU).
#
# ## Recap
#
# Measured on this machine (from the run directories and the sweep CSVs), next to the
# write-up's GPU reference. The pair and the sweeps differ in dtype and micro-batch (printed
# below), so read each group on its own:

# %%
facts.show("torch.compile_default_no_cudagraphs")
recap = pd.concat([
    pair.assign(model="tiny", dtype="bf16"),
    size.assign(name=lambda d: d.backend + " " + d.model + ", " + d.world_size.astype(str) + " ranks")
        .set_index("name")
        .rename(columns={"tokens_per_s_per_rank": "tokens/s/device", "step_time_s": "step time (s)", "mfu": "MFU"})
        [["tokens/s/device", "step time (s)", "MFU", "model", "dtype"]],
    SEEDS.assign(model="Granite 7B", dtype="bf16"),
])
print(f"pair: {fsdp.config['mixed_precision']} compute, micro-batch {fsdp.config['train']['micro_batch']}; "
      f"sweeps: {SWEEP}")
recap.round(3)

# %% [markdown]
# * The aligned pair trains identically on both backends; its speed difference here is the
#   verdict printed above (claimed only when two runs of each, made in turn, all part), its MFU
#   measured against a peak in its own dtype.
# * The larger models reach a higher MFU than tiny (whether MFU rose at every size is printed
#   above); fixed costs per op are our reading of why.
# * Ranks beyond the cores make no rank faster: at 4 ranks on 2 cores, two ranks share a
#   core (the per-rank ratio above).
# * Reproduce the harness's own cost: `python benchmarks/overhead.py` (harness vs minimal
#   hand-written FSDP2 and DeepSpeed loops).

# %% [markdown]
# ## Optional: try other settings
#
# Nothing below is part of the story above, and nothing runs until you click **Run**. The
# panel's defaults are this notebook's own command (the aligned pair, `tiny`, `$PAIR_STEPS` steps); it launches the selected configs
# into its own run directories (`notebooks/runs/panel_07_*`) and redraws tokens/s per rank and MFU. Try the `small` model, or 1 and 4 ranks (on a CPU, ranks share the cores).

# %%
from helpers.nb import widgets

widgets.ControlPanel("07", {"FSDP": "launch_configs/fsdp/full_shard.yaml",
                            "DeepSpeed": "launch_configs/deepspeed/zero3.yaml"},
                     args="--model tiny --steps $PAIR_STEPS", plot=widgets.plot_throughput)
