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
# # 17 · Deep dive: throughput and MFU vs model size and ranks
#
# **The question.** Notebook 07 counted tokens/s and MFU for one model on this machine. How do they
# move with the model's size and with the number of ranks, and which dtype is the fast one on this
# CPU? (A deep dive from notebook 07; the core path goes on with 08.)
#
# **What we run.** Both backends over model sizes and over 1, 2 and 4 ranks with
# `benchmarks/scaling.py`, which launches real `helpers.train` jobs and collects their summaries
# into a CSV. The sweeps train the **plain fp32 pair** (`fsdp/full_shard_low_precision.yaml
# --model-dtype fp32` next to `deepspeed/zero3_fp32.yaml`), whose speed should not depend on which
# bf16 instructions a CPU has (not checked: one CPU here).

# %%
import os

import pandas as pd
import torch

from helpers import facts, nb
from helpers.job.observe import throughput
from helpers.nb import plots, results
from helpers.nb.claims import claim, ran

SIZE = nb.setup()
GPUS = nb.gpu_count()
NPROC = nb.nproc()
RANK_SWEEP = nb.world_sizes([1, 2, 4])  # on a GPU node: up to its number of GPUs
RANK_EXTRA = [n for n in RANK_SWEEP if n != NPROC]  # the NPROC point is the size sweep's own job
SIZES = ["tiny", "small"]  # add "medium" on a faster machine: left out to keep this notebook short
RANKS_MODEL = "tiny"  # its point at NPROC ranks is the size sweep's own tiny job
SWEEP = "--steps 5 --micro-batch 2 --seq-len 64 --dtype fp32"
os.environ.update(NPROC=str(NPROC), SIZES=" ".join(SIZES), RANK_EXTRA=" ".join(map(str, RANK_EXTRA)),
                  RANKS_MODEL=RANKS_MODEL, SWEEP=SWEEP)
print(f"size={SIZE}: sizes {SIZES} on {NPROC} ranks; ranks {RANK_SWEEP} on {RANKS_MODEL}")

# %% [markdown]
# ## bf16 on a CPU: fast or slow, by instruction set
#
# How fast a CPU runs a bf16 matmul depends on its instructions (torch's compiled CPU kernels,
# not checked here). The cell below lists what this one has, measures both peaks here (one
# thread, three rounds in turn) and checks which dtype is faster (our reading: without bf16
# instructions, fp32 over 3x bf16; with them, bf16 above fp32: the check for a CPU that has them, not run here). On a GPU, bf16 tensor cores
# are the fast path (not checked here). The peak is measured in the job's dtype, so MFU
# counts against the arithmetic the job does; each job measures it again (the size sweep's
# range is printed below).

# %%
flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
BF16_UNITS = sorted({f for f in flags if "bf16" in f})
print("bf16 instructions:", BF16_UNITS or "none")
if not GPUS:
    torch.set_num_threads(1)  # as each job's rank: one thread
    peak = {"bf16": 0.0, "fp32": 0.0}
    for _ in range(3):  # in turn, the best of each
        for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            peak[name] = max(peak[name], throughput.measure_cpu_peak(dt))
    print({k: throughput.fmt_flops(v) for k, v in peak.items()}, f"fp32 / bf16 = {peak['fp32'] / peak['bf16']:.2f}")
    if not BF16_UNITS:
        claim("this CPU has no bf16 instructions: its fp32 peak is over 3x its bf16 one", peak["fp32"] > 3 * peak["bf16"],
              ratio=peak["fp32"] / peak["bf16"])
    else:
        claim(f"with {', '.join(BF16_UNITS)}, bf16 is the faster path on this CPU", peak["bf16"] > peak["fp32"],
              bf16_over_fp32=peak["bf16"] / peak["fp32"])

# %% [markdown]
# ## 1 · Throughput and MFU vs model size
#
# Both backends, `NPROC` ranks, 2 sequences of 64 tokens per rank per step, fp32.
# Each line is one real job; the CSV is read back below.

# %% language="bash"
# python benchmarks/scaling.py --models $SIZES --world-sizes $NPROC $SWEEP --out notebooks/runs/17_size.csv

# %%
size = pd.read_csv("notebooks/runs/17_size.csv")
PAIR_CONFIGS = {"fsdp": "launch_configs/fsdp/full_shard_low_precision.yaml",
                "deepspeed": "launch_configs/deepspeed/zero3_fp32.yaml"}


def read_back(csv, what):
    """The CSV's jobs, after checking each row is its run's summary; the ran() check of the sweep's setup."""
    runs = results.load_runs(*csv.run)
    claim(f"{what}: each CSV row is a real job's summary, one per backend and point, the plain fp32 pair's configs",
          len(set(zip(csv.backend, csv.model, csv.world_size))) == len(csv) == len(PAIR_CONFIGS) * len(
              set(zip(csv.model, csv.world_size))) and set(csv.backend) == set(PAIR_CONFIGS)
          and all(r.summary["config"] == PAIR_CONFIGS[r.backend] and (row.backend, row.model, row.world_size)
                  == (r.backend, r.summary["model"], r.summary["world_size"])
                  and abs(row.mfu / r.summary["mfu"] - 1) < 1e-9 for row, r in zip(csv.itertuples(), runs, strict=True)),
          jobs=len(runs))
    ran(f"{what}: 5 steps of 2 sequences of 64 tokens per rank, fp32 weights, no mixed precision", runs, steps=5,
        micro_batch=2, seq_len=64, model_dtype="fp32", mixed_precision="no",
        dist_backend="nccl" if GPUS else "gloo")
    jobs = [r.summary for r in runs]
    # a job's best call is timed to the clock's tick, so two jobs can measure the same peak: the check is that
    # the values are not all one number (one shared value for every job is the wrong result it rules out)
    claim(f"{what}: every job computed its forward in fp32"
          + ("" if GPUS else " and measured its own peak, with an fp32 matmul on one thread (its summary says so; the "
             "jobs' values are not all one number)"),
          all(j["dtypes"]["forward_weight"] == "fp32" for j in jobs) and (GPUS or (
              csv.peak_flops.nunique() > 1 and all("fp32 matmul, 1 thread(s)" in j["peak_flops_source"]
                                                   for j in jobs))),
          peak_sources=sorted({j["peak_flops_source"].split(", rank")[0] for j in jobs}),
          different_values=f"{csv.peak_flops.nunique()} of {len(jobs)}")
    return runs


size_runs = read_back(size, "size sweep")
claim(f"the jobs' own summaries: {', '.join(SIZES)} on both backends, each at {NPROC} ranks, no point missing",
      sorted(zip(size.backend, size.model)) == sorted((b, m) for b in PAIR_CONFIGS for m in SIZES)
      and set(size.world_size) == {NPROC}, points=sorted(zip(size.backend, size.model, size.world_size)))
print(f"the fp32 jobs measured peaks of {throughput.fmt_flops(size.peak_flops.min())} to "
      f"{throughput.fmt_flops(size.peak_flops.max())} per rank")
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
flops = [int(by.loc[("fsdp", m), "flops_per_token"]) for m in SIZES]
print(f"FLOPs per token ({' < '.join(SIZES)}; from each model's config, the same on both backends): {flops}")
claim(f"on both backends each larger size ({' < '.join(SIZES)}) processes fewer tokens per second",
      all(all(x > y for x, y in zip(v, v[1:])) for v in toks.values()), tokens_per_s=toks)
claim(f"and uses the core better: MFU is higher for {' and '.join(SIZES[1:])} than for tiny",
      all(min(v[1:]) > v[0] for v in mfu.values()), mfu_by_size=mfu)
print(f"MFU per backend, {' -> '.join(SIZES)}: {mfu}")
off = {b: [float(by.loc[(b, m), "step_time_s"] * (1 - by.loc[(b, m), "mfu"])) for m in SIZES] for b in ("fsdp", "deepspeed")}
grew = {b: v[-1] / v[0] for b, v in off.items()}
claim(f"the time off the peak, step time x (1 - MFU), grows from tiny to {SIZES[-1]} on both backends, but less than "
      "the FLOPs per token do", all(1 < g < flops[-1] / flops[0] for g in grew.values()),
      off_peak_grew={b: round(g, 1) for b, g in grew.items()}, flops_grew=round(flops[-1] / flops[0], 1))
print("FSDP / DeepSpeed step time per size (one 5-step job each, no spread: not a comparison of the backends):",
      {m: round(float(by.loc[("fsdp", m), "step_time_s"] / by.loc[("deepspeed", m), "step_time_s"]), 2)
       for m in SIZES})

# %% [markdown]
# **What it means.** In these one-job-per-point runs, `small` processes fewer tokens per second than `tiny` (more FLOPs per token),
# and uses the core better than `tiny` does (each MFU against its own
# job's measured peak, which moves from job to job: the range printed above). The time off the peak
# grew too, but less than the FLOPs (checked above). Our reading (not broken down here): a `tiny` step
# is a few small matmuls wrapped in work that does no model FLOPs: per-op costs (Python, launching
# each op), and per-step work that grows with the model but is no matmul — the optimizer's
# per-parameter loop (FSDP's; DeepSpeed steps one flat partition), gloo's collectives (FSDP gathers
# each unit, again in backward when it resharded after forward, and reduces it once). <!-- fact: torch.adamw_foreach_false_loops --> <!-- fact: deepspeed.zero3_steps_one_flat_partition --> <!-- fact: torch.fsdp2_collective_counts --> What the runs show (checked below): at 2 ranks over 90% of a `tiny` step's time
# is off the peak, and the FSDP jobs were set to loop over parameters and to reshard;
# which overhead costs what, they do not isolate. Whether it keeps rising
# beyond `small` is not measured here: add `medium` to `--models` and look (on a CPU it need not rise,
# our reading: a larger model's weights and activations also outgrow the caches). The last
# line compares the backends at each size from one short job each: with no spread to read,
# it is a pointer for your own runs, not a result (notebook 07's repeated pair shows how to compare backends).
#
# ## 2 · Throughput and MFU vs ranks
#
# The same model on 1, 2 and 4 ranks (on a GPU node: as many of those as it has GPUs). On a
# machine with 2 CPUs (this one's count is printed below), 4 ranks are more ranks than CPUs. The point at this
# machine's own rank count is the size sweep's job (the same command), not run twice.

# %% language="bash"
# python benchmarks/scaling.py --models $RANKS_MODEL --world-sizes $RANK_EXTRA $SWEEP --out notebooks/runs/17_ranks.csv

# %%
facts.show("torch.fsdp2_collective_counts", "torch.adamw_foreach_false_loops", "deepspeed.zero3_steps_one_flat_partition")
extra = pd.read_csv("notebooks/runs/17_ranks.csv")
ranks = pd.concat([extra, size[(size.model == RANKS_MODEL) & (size.world_size == NPROC)]]).sort_values("world_size")
ranks = ranks.reset_index(drop=True)
rank_runs = read_back(ranks, "rank sweep")
fsdp_runs = list({r.path.resolve(): r for r in size_runs + rank_runs if r.backend == "fsdp"}.values())  # each job once
ran("the overheads the reading in section 1 names: FSDP's optimizer loops over its parameters (read from the live "
    "optimizer), and its per-layer units are set to reshard after forward (the config)", fsdp_runs, optimizer_impl="for-loop", reshard_after_forward=True)
claim(f"most of a {RANKS_MODEL} step's time is off the peak: 1 - MFU is over 0.9 for both backends at {NPROC} ranks",
      all(1 - v[0] > 0.9 for v in mfu.values()), off_peak_share={b: round(1 - v[0], 3) for b, v in mfu.items()})
claim(f"the jobs' own summaries: {RANKS_MODEL} on {RANK_SWEEP} ranks, both backends, no point missing",
      sorted(zip(ranks.backend, ranks.world_size)) == sorted((b, n) for b in PAIR_CONFIGS for n in RANK_SWEEP)
      and set(ranks.model) == {RANKS_MODEL}, world_sizes=sorted(set(ranks.world_size)))
print(f"the jobs of this sweep measured peaks of {throughput.fmt_flops(ranks.peak_flops.min())} to "
      f"{throughput.fmt_flops(ranks.peak_flops.max())} per rank (MFU is against each job's own)")
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
CORES = len(os.sched_getaffinity(0))  # the CPUs this process may run on
print(f"CPUs this notebook may use: {CORES}")
for backend in ("fsdp", "deepspeed") if not GPUS and CORES <= 2 else ():  # on a GPU node each rank has its GPU
    two, four = rk.loc[(backend, 2)], rk.loc[(backend, 4)]
    # one short job per point, made one after the other: these ratios are printed, not compared (a timing
    # verdict needs repeated, interleaved runs: helpers.nb.claims.timing_runs)
    print(f"{backend}: 4 ranks over 2, per rank {four.tokens_per_s_per_rank / two.tokens_per_s_per_rank:.2f}x, "
          f"all ranks {four.tokens_per_s / two.tokens_per_s:.2f}x (one short job each)")
at_four = [r for r in rank_runs if r.summary["world_size"] == 4]
if not GPUS and CORES < 4:
    shared = [next((ln for ln in (r.path / "log.txt").read_text().splitlines() if "ranks on this node share" in ln), None)
              for r in at_four]
    claim("each 4-rank job saw more ranks than CPU cores on its node and said so in its log",
          len(at_four) == 2 and all(r.summary["device"] == "cpu" for r in at_four) and all(shared),
          note=shared[0][:60] if shared and shared[0] else None)
    print("peaks by ranks (GFLOP/s; rank 0's matmul while the others wait):",
          {f"{b} {n}": round(p / 1e9, 1) for (b, n), p in sorted(rk.peak_flops.items())})
elif not GPUS:
    print(f"at 4 ranks on {CORES} CPUs: no CPU shared")

# %% [markdown]
# **What it means.** Here 4 ranks shared the CPUs (checked above). Each job's peak is rank 0's
# one-thread matmul, timed while the other ranks wait (the guide's design); whether waiting ranks
# left it a whole CPU is not measured (the peaks are printed above): the 4-rank MFU divides by that peak.
# How much of the per-rank ratio above is that sharing is not measured here; the ratios
# above come from one short job each, so no speed conclusion is drawn from them. On a GPU node
# every rank has its own device (not run here).
#
# ## Recap
#
# * Here (one job per point), `small` processed fewer tokens per second than `tiny` and used
#   the core better (higher MFU); its time off the peak grew less than its FLOPs. What fills that time is our reading.
# * Here 4 ranks ran on fewer CPUs (checked above), so they shared them. The ratios above are
#   one short job each: no speed conclusion is drawn from them.
# * On this CPU the check above says which dtype is faster (it depends on the instruction set,
#   not checked here); each job counted MFU against a peak in its own dtype
#   (checked above).
#
# Back to the path: `08_batch_size`.

