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
# **The question.** Hugging Face's write-up on aligning FSDP and DeepSpeed precision in Accelerate
# ([From DeepSpeed to FSDP and Back Again](https://huggingface.co/blog/deepspeed-to-fsdp-and-back))
# ends on a throughput table: on 4x A100, FSDP in its aligned mode and DeepSpeed ZeRO-3 train IBM
# Granite 7B at 3158.7 and 3094.5 tokens/s per device, an MFU of 0.41 and 0.40. How is such a table
# counted, and what does it say on your own machine?
#
# **What we run.** The write-up's aligned pair (bf16 compute, fp32 master weights) <!-- fact: accelerate.fsdp2_bf16_fp32_shards --> <!-- fact: deepspeed.zero3_bf16_dtypes -->
# on this machine, twice each. Every job writes `tokens_per_s_per_rank`, `step_time_s` (medians,
# warm-up left out), `flops_per_token`, `peak_flops` and `mfu` to its `summary.json`.

# %%
import os
import statistics

import pandas as pd

from helpers import facts, nb
from helpers.core import metrics, models
from helpers.job.observe import throughput
from helpers.nb import results
from helpers.nb.claims import claim, in_turn, ran, step_times, timing_runs

SIZE = nb.setup()
GPUS = nb.gpu_count()
NPROC = nb.nproc()  # one rank per GPU on a GPU node (nccl), else 2 gloo ranks (one per core of the guide's 2-core box)
PAIR_STEPS = 8 if SIZE == "quick" else 20
os.environ.update(NPROC=str(NPROC), PAIR_STEPS=str(PAIR_STEPS))
print(f"size={SIZE}: pair {PAIR_STEPS} steps on {NPROC} ranks; warm-up steps left out: {metrics.WARMUP_STEPS}")

# %% [markdown]
# ## How a job counts: FLOPs per token, peak, MFU
#
# **MFU** = model FLOPs per token x tokens/s per device / the device's peak FLOP/s.
#
# * **FLOPs per token** = `6 N + 12 L H Q T`, for `L` layers of `H` heads of `Q` dimensions over
#   `T` tokens of context (the PaLM paper's count). Each weight does a multiply-add (2 FLOPs) per
#   token forward and two backward: `6 N`. `N` leaves out the embedding table (a lookup does no
#   arithmetic) but keeps the output projection `lm_head`, a real matmul. <!-- fact: torch.embedding_is_lookup --> <!-- fact: transformers.llama_lm_head_untied_linear -->
#   `12 L H Q T` is attention's two matmuls over the sequence, not halved for the causal mask.
# * **Peak**: on a GPU, the dense peak in the compute dtype by device name (printed below; plain
#   fp32 for fp32 jobs, as torch keeps TF32 off for matmuls), <!-- fact: torch.tf32_off_for_matmuls -->
#   or `--peak-tflops`. On a CPU each job **measures** it at start: rank 0 times a 512x512 matmul
#   in the job's compute dtype on its one thread.
# * **Warm-up**: the first two steps are left out of the medians (first-touch allocations, lazily
#   created optimizer state, the memory and dtype probes at step 1: what they do, not timed here). <!-- fact: torch.adam_state_lazy --> <!-- fact: deepspeed.zero3_optimizer_state_lazy -->
#
# The FLOPs of our presets, from the function the jobs call:

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
print("GPU dense peaks, TFLOPS (bf16, fp32) by device name:",
      ", ".join(f"{pat.replace(chr(92) + 'b', '').replace('.*', ' ')} ({b}, {f})" for pat, b, f in
                throughput.GPU_PEAK_TFLOPS if b))
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
claim("arithmetic on the write-up's own figures (typed in above, no run of ours): its 6 N term gives its MFU to "
      "within 10% (\"7B\" is a rounded N)", (seed_mfu / SEEDS["MFU"] - 1).abs().max() < 0.10,
      six_N_mfu=seed_mfu.round(3).tolist(), its_mfu=SEEDS["MFU"].tolist(),
      apart=round((seed_mfu / SEEDS["MFU"] - 1).abs().max(), 3))

# %% [markdown]
# ## The write-up's table, on this machine
#
# The aligned pair of notebook 00 (`full_shard.yaml`, `zero3.yaml`), `tiny`, `NPROC` ranks. It
# runs twice, in turn (FSDP, DeepSpeed, FSDP, DeepSpeed): a shared machine can slow down in the
# middle of one job, and repeated runs made in turn help tell that apart from a backend.

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


PAIR_RUNS = (fsdp, ds, fsdp_2, ds_2)
ran(f"the aligned pair ran twice each: tiny, {PAIR_STEPS} steps, {NPROC} ranks" + ("" if GPUS else " sharing one CPU"),
    PAIR_RUNS, model="tiny", steps=PAIR_STEPS, world_size=NPROC, num_nodes=1, **({} if GPUS else {"device": "cpu"}),
    dist_backend="nccl" if GPUS else "gloo")
in_turn("they ran in turn, each after the previous one ended: FSDP, DeepSpeed, FSDP, DeepSpeed", PAIR_RUNS)
dt = [r.summary["dtypes"] for r in PAIR_RUNS]
claim("FSDP ran full_shard.yaml and DeepSpeed zero3.yaml, notebook 00's aligned pair: bf16 compute, the optimizer on "
      "fp32 weights (FSDP's stored shards, DeepSpeed's master copy)",
      [r.summary["config"] for r in PAIR_RUNS] == ["launch_configs/fsdp/full_shard.yaml",
                                                   "launch_configs/deepspeed/zero3.yaml"] * 2
      and all(d["forward_weight"] == "bf16" and d["optimizer_param"] == "fp32" for d in dt)
      and all(d["stored_param"] == "fp32" for d in dt[0::2]) and all(d["master_param"] == "fp32" for d in dt[1::2]),
      configs=[r.summary["config"].split("/", 1)[1] for r in PAIR_RUNS],
      forward=[d["forward_weight"] for d in dt], optimizer_param=[d["optimizer_param"] for d in dt])
claim(f"each job's step time is the median of its steps after the first {metrics.WARMUP_STEPS} (warm-up); its "
      "tokens/s/device is one rank's tokens per step over that time",
      metrics.WARMUP_STEPS == 2 and all(
          r.summary["step_time_s"] == statistics.median(step_times(r, metrics.WARMUP_STEPS))
          and abs(r.summary["tokens_per_s_per_rank"] * r.summary["step_time_s"] * r.summary["world_size"]
                  / r.summary["tokens_per_step"] - 1) < 1e-9 for r in PAIR_RUNS),
      tokens_per_rank_step=fsdp.summary["tokens_per_step"] // fsdp.summary["world_size"])
claim("each job's MFU is its FLOPs per token (the presets' count for tiny, above) x tokens/s / its peak",
      all(r.summary["flops_per_token"] == presets.loc["tiny", "FLOPs/token (T=64)"]
          and abs(r.summary["flops_per_token"] * r.summary["tokens_per_s_per_rank"] / r.summary["peak_flops"]
                  / r.summary["mfu"] - 1) < 1e-9 for r in PAIR_RUNS),
      flops_per_token=fsdp.summary["flops_per_token"])
here = f"{fsdp.summary['world_size']}x {fsdp.summary['device']}"
pair = pd.DataFrame([table_row(r) for r in (fsdp, ds, fsdp_2, ds_2)],
                    index=[f"{name} (run {k}), {here}" for k in (1, 2)
                           for name in ("FSDP (aligned)", "DeepSpeed ZeRO-3")])
pd.concat([pair, SEEDS]).round(3)

# %%
peaks = [r.summary["peak_flops"] for r in PAIR_RUNS]
print("peak per rank, as each job measured it:", [throughput.fmt_flops(p) for p in peaks],
      f"(the largest {max(peaks) / min(peaks) - 1:.1%} above the smallest) -", fsdp.summary["peak_flops_source"])
# below 1: the peak must be a ceiling (a definition, not fitted; MFU is a ratio of timings and moves from run to run)
claim("every MFU is below 1, against a peak in the dtype the job's forward computes in"
      + ("" if GPUS else ", measured by rank 0 alone (a 512x512 matmul on one thread) in each job"),
      all(r.summary["mfu"] < 1 and (f"dense {r.summary['dtypes']['forward_weight']}" if GPUS else
                                         f"measured: 512x512 {r.summary['dtypes']['forward_weight']} matmul, "
                                         "1 thread(s), rank 0 alone") in r.summary["peak_flops_source"]
          for r in PAIR_RUNS),
      mfu=[r.summary["mfu"] for r in PAIR_RUNS], peaks=[throughput.fmt_flops(p) for p in peaks],
      compute=[r.summary["dtypes"]["forward_weight"] for r in PAIR_RUNS],
      peak_sources=sorted({r.summary["peak_flops_source"].split(",")[0] for r in PAIR_RUNS}))
if nb.bitwise_parity_expected(NPROC):  # bit for bit on a CPU (gloo); on GPUs see nb.bitwise_parity_expected
    claim("the four jobs do the same training (identical losses, as in notebook 00)",
          all(r.summary["losses"] == fsdp.summary["losses"] for r in PAIR_RUNS))
else:
    gap = max(abs(a - b) for r in PAIR_RUNS for a, b in zip(r.summary["losses"], fsdp.summary["losses"], strict=True))
    claim("the four jobs do the same training (losses within 1e-2)", gap < 1e-2, largest_gap=gap)
PAIR = timing_runs("FSDP", [fsdp, fsdp_2], "DeepSpeed", [ds, ds_2], metrics.WARMUP_STEPS)
print(PAIR)
print("the verdict's rule (helpers.nb.claims.Timing, by design): it names a faster backend only if every run of one "
      "is beyond every run of the other and their steps' quartiles part")
if not GPUS:
    claim(f"tokens/s/device here is per rank: all {NPROC} ranks of each job ran on this one machine's CPU "
          f"({os.cpu_count()} cores)", all(r.summary["device"] == "cpu" and r.summary["num_nodes"] == 1
                                           and r.summary["world_size"] == NPROC for r in (fsdp, fsdp_2, ds, ds_2)))
mean_tps = {b: sum(r.summary["tokens_per_s_per_rank"] for r in runs) / 2
            for b, runs in (("FSDP", (fsdp, fsdp_2)), ("DeepSpeed", (ds, ds_2)))}
print(f"FSDP / DeepSpeed tokens/s: {mean_tps['FSDP'] / mean_tps['DeepSpeed']:.2f} here (the mean of two runs each), "
      f"{3158.7 / 3094.5:.2f} in the write-up (its two figures: one number each, no spread)")
tps = max(r.summary["tokens_per_s_per_rank"] for r in (fsdp, fsdp_2))  # FSDP's run with more tokens/s
achieved = tps * fsdp.summary["flops_per_token"]
peak = sorted(peaks)[len(peaks) // 2]  # the upper median of the four
print(f"FLOPs per token: Granite 7B's 6 N alone is {6 * 7e9 / fsdp.summary['flops_per_token']:,.0f}x tiny's "
      "(from the two models' sizes, not from a run)")
apart = {"peak": 312e12 / peak, "achieved": 0.41 * 312e12 / achieved}
said = (f"an A100's 312 TFLOPS is {apart['peak']:,.{2 if GPUS else 0}f}x this {'GPU' if GPUS else 'CPU thread'}'s "
        f"{fsdp.summary['dtypes']['forward_weight']} peak (the upper median of our four jobs'); achieved FLOP/s: the "
        f"write-up's {apart['achieved']:,.0f}x ours")
if GPUS:
    print(said)
else:  # both ratios have been over 10,000x here at either size; 1,000x leaves room for faster CPUs
    claim(f"the absolute numbers are not comparable: {said} (each over 1,000x)", min(apart.values()) > 1e3,
          **{k: round(v) for k, v in apart.items()})

# %% [markdown]
# **What it means.** Here the two backends give identical losses. Whether one was faster, in these
# runs on this machine, is the verdict above (its rule is printed with it); the write-up's two figures differ by 2%.
# Each job measures its peak again (the four's spread is printed above); MFU divides by that
# peak, so it moves with the peak as well as with tokens/s (the formula): compare the backends by tokens/s. "tokens/s/device" here
# is per rank; on this machine the ranks share one CPU (checked above). The last lines set our absolute numbers beside the write-up's.
#
# ## What may limit MFU here (not measured), and what changes on a GPU node
#
# * **One thread per rank.** Each rank computes on one thread (`nb.setup` sets `OMP_NUM_THREADS=1` unless you set it); the peak is one
#   thread's (its source, checked above). <!-- fact: torch.omp_num_threads_sets_intraop --> On a GPU node every rank has its own device.
# * **gloo collectives on the CPU.** FSDP gathers each layer's weights and reduce-scatters its
#   gradients; ZeRO-3 does the same in buckets. <!-- fact: torch.fsdp2_collective_counts --> <!-- fact: deepspeed.zero_bucket_defaults -->
#   With gloo they run on gloo's worker threads, on the same cores that compute (notebook 04 draws them on its timelines). <!-- fact: torch.gloo_worker_threads -->
#   On GPUs, NCCL runs on its own streams and prefetch overlaps the next layer's all-gather with
#   this layer's compute (not checked here). <!-- fact: torch.gpu_collectives_own_stream -->
# * **Fixed costs per op.** A small model issues many small ops (Python, op launches, the
#   optimizer's per-parameter loop) that do no model FLOPs. <!-- fact: torch.adamw_foreach_false_loops -->
#   On a GPU (not checked here), `torch.compile` fuses ops, and CUDA graphs (its modes `"reduce-overhead"` and
#   `"max-autotune"`, not the default) cut launches. <!-- fact: torch.compile_default_no_cudagraphs -->
#
# ## Recap

# %%
facts.show("torch.compile_default_no_cudagraphs")
ran(f"pair: bf16 compute, micro-batch 8, {PAIR_STEPS} steps", PAIR_RUNS, mixed_precision="bf16", micro_batch=8,
    steps=PAIR_STEPS)
pd.concat([pair.assign(model="tiny"), SEEDS.assign(model="Granite 7B")]).round(3)

# %% [markdown]
# * MFU = FLOPs per token (`6 N + 12 L H Q T`, embedding left out) x tokens/s / peak; the same
#   `6 N` term gives the write-up's MFU from its tokens/s to within 10%.
# * Here the aligned pair gives identical losses on both backends; its speed difference is the verdict
#   printed above, which names a faster backend only when runs made in turn all part and their
#   steps' quartiles part too.
# * How throughput and MFU move with the model's size and the number of ranks, and bf16 against
#   fp32 matmul peaks on a CPU: the deep dive `17_scaling`. The harness's own cost: `python benchmarks/overhead.py`.
#
# Next: `08_batch_size`.

# %% [markdown]
# ## Optional: try other settings
#
# Nothing below is part of the story above, and nothing runs until you click **Run**. The
# panel's defaults are this notebook's command, one run per config (the aligned pair, `tiny`, `PAIR_STEPS` steps); it launches the selected configs
# into its own run directories (`notebooks/runs/panel_07_*`) and redraws tokens/s per rank and MFU. Try the `small` model, or 1 and 4 ranks (on a CPU, ranks share the cores).

# %%
from helpers.nb import widgets

widgets.ControlPanel("07", {"FSDP": "launch_configs/fsdp/full_shard.yaml",
                            "DeepSpeed": "launch_configs/deepspeed/zero3.yaml"},
                     args="--model tiny --steps $PAIR_STEPS", plot=widgets.plot_throughput)
