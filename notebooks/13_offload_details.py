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
# # 13 · Deep dive: NVMe offload, its limits, and step times with the copies
#
# **The question.** Notebook 03 showed where CPU offload puts each kind of state. Here: what does
# DeepSpeed's NVMe offload put on disk, and which two limits decide it? What does offload cost in
# host memory, and in step time on this machine? (A deep dive from notebook 03; the core path goes
# on with 04.)
#
# **What we run.** Notebook 03's five configs and `launch_configs/deepspeed/zero3_nvme.yaml` (both
# offload keys to `nvme`, a local directory), on the `tiny` model, 2 ranks each (1 on a one-GPU
# machine; on more, the tiny model's optimizer partitions would fall under NVMe's minimum: the sizes
# cell below). <!-- fact: deepspeed.nvme_min_aio_bytes --> As in notebook 03, on a CPU-only machine "device" and "host" are the same RAM.
# With `--reuse`, a job notebook 03 already ran here (same flags, ranks and code) is copied from
# its run directory instead of trained again, and its line says `reused`; otherwise it runs.

# %%
import os

from helpers import facts, nb
from helpers.core.mapping import CATEGORIES
from helpers.job import ops
from helpers.nb import plots, results, tables
from helpers.nb.claims import claim, ran, reused, step_times, timing

SIZE = nb.setup()  # "quick" under `make test`: the same cells, fewer steps
STEPS = 4 if SIZE == "quick" else 10
GPUS = nb.gpu_count()
NPROC = min(GPUS, 2) if GPUS else 2
ARGS = "--model tiny --micro-batch 8 --seq-len 64"  # notebook 03's jobs: its sizes are printed below
NVME_OK, NVME_STATE = ops.aio_status()
os.environ.update(STEPS=str(STEPS), NPROC=str(NPROC), ARGS=ARGS, NVME="1" if NVME_OK else "0",
                  NVME_STATE=NVME_STATE)
print(f"size={SIZE}: {STEPS} steps on {NPROC} ranks ({'GPU' if GPUS else 'CPU only: device and host are the same RAM'})")

# %% [markdown]
# ## Two limits
#
# ZeRO-3 keeps parameters of at most `stage3_param_persistence_threshold` elements whole on every
# rank, next to the compute, offload or not (each still has its 1/N partition, which is what
# offload moves); <!-- fact: deepspeed.zero3_persistent_small_params --> <!-- fact: deepspeed.zero3_persistent_keep_partition --> and it swaps to NVMe only tensors of at least `MIN_AIO_BYTES`
# per rank, or the config's `aio.block_size` if that is larger. <!-- fact: deepspeed.nvme_min_aio_bytes --> In the tiny model every
# decoder-layer weight is under the first and every parameter partition under the second, while the
# optimizer's fp32 partition (one flat buffer per kind of state per rank) <!-- fact: deepspeed.zero3_one_flat_partition_per_rank --> is over it on 1 or 2
# ranks. In the `small` model the decoder-layer matrices are over the threshold, so only their
# partitions are kept, <!-- fact: deepspeed.zero3_persistent_small_params --> and on 2 to 7 ranks the partitions of the embedding and the output
# layer, and only theirs, are large enough to be swapped; on 8 or more, none is (on one rank, some
# decoder-layer matrices too). Large enough, but not left on disk (by design; `small` is not run here): ZeRO-3 swaps them out as it
# builds the model, then reads them back into a host buffer for good, because `offload_param.max_in_cpu` (1e9 elements by default; our config
# leaves it) lets every partition of a model this size live in host memory. <!-- fact: deepspeed.nvme_params_read_back_max_in_cpu --> To keep parameters
# on NVMe, set it below the partitions' total (not run here). The two limits, and both models' sizes next to them
# (bf16 partitions of 1/`NPROC`, built on the meta device: no weights). (The first printed fact's evidence comes from its own test engine, whose threshold is set to 16: there a 256-element weight is not kept whole.)

# %%
import json
from pathlib import Path

from deepspeed.runtime.swap_tensor.utils import AIO_ALIGNED_BYTES, MIN_AIO_BYTES

from helpers.core.models import resolve_model
from helpers.estimate import is_persistent, persistence_threshold
from helpers.job.wrap import meta_model

DS_JSONS = [f"launch_configs/{path}.json" for path in ("deepspeed/zero3", "deepspeed/zero3_offload_optimizer",
                                                        "deepspeed/zero3_offload", "deepspeed/zero3_nvme")]
THRESHOLDS = {persistence_threshold(json.loads(Path(f).read_text())["zero_optimization"]) for f in DS_JSONS}
assert len(THRESHOLDS) == 1, f"this notebook's DeepSpeed configs set different persistence thresholds: {THRESHOLDS}"
THRESHOLD = THRESHOLDS.pop()  # the four DeepSpeed configs run here (each its own value, or DeepSpeed's default)
NVME_JSON = json.loads(Path("launch_configs/deepspeed/zero3_nvme.json").read_text())
NVME_MIN = max(MIN_AIO_BYTES, NVME_JSON.get("aio", {}).get("block_size", 0))  # as DeepSpeed's swappers take it
facts.show("deepspeed.zero3_persistent_small_params", "deepspeed.nvme_min_aio_bytes", "deepspeed.nvme_params_read_back_max_in_cpu")
print(f"stage3_param_persistence_threshold {THRESHOLD:,} elements; NVMe swaps tensors of at least "
      f"{NVME_MIN / 2**20:g} MiB per rank")
SHAPES = {}
for name in ("tiny", "small"):
    numel = {n: p.numel() for n, p in meta_model(resolve_model(name)).named_parameters()}
    layers = {n: v for n, v in numel.items() if ".layers." in n}
    matrices = [v for n, v in layers.items() if not n.endswith("norm.weight")]
    SHAPES[name] = dict(numel=numel, params=sum(numel.values()), layer_max=max(layers.values()), layer_matrix_min=min(matrices),
                        partition_max_bytes=max(numel.values()) * 2 // NPROC,
                        swappable=sorted(n for n, v in numel.items() if v * 2 // NPROC >= NVME_MIN),
                        over_threshold=sorted(n for n, v in numel.items() if not is_persistent(v, THRESHOLD)),  # the rest stay whole
                        persistent_bytes=sum(2 * v for v in numel.values() if is_persistent(v, THRESHOLD)),  # kept whole, bf16
                        fp32_partition_bytes=4 * -(-sum(numel.values()) // NPROC))  # the optimizer's flat partition
    print(f"{name:6s} {SHAPES[name]['params'] / 1e6:5.2f}M params; decoder-layer weights {min(layers.values()):,} to "
          f"{SHAPES[name]['layer_max']:,} elements; over the threshold: "
          f"{', '.join(over) if len(over := SHAPES[name]['over_threshold']) <= 3 else f'{len(over)} parameters'}; "
          f"largest bf16 partition "
          f"{SHAPES[name]['partition_max_bytes'] / 2**20:.2f} MiB per rank; partitions at or over the NVMe minimum: "
          f"{', '.join(SHAPES[name]['swappable']) or 'none'}; fp32 optimizer partition "
          f"{SHAPES[name]['fp32_partition_bytes'] / 2**20:.2f} MiB per rank")
tiny, small = SHAPES["tiny"], SHAPES["small"]
EMBED_AND_HEAD = ["lm_head.weight", "model.embed_tokens.weight"]
claim("tiny: only the embedding and the output layer are over the threshold (every decoder-layer weight and the "
      "final norm are kept whole), and every parameter partition is under the NVMe minimum",
      tiny["over_threshold"] == EMBED_AND_HEAD and not tiny["swappable"], over_threshold=tiny["over_threshold"])
claim(f"tiny on {NPROC} ranks: the optimizer's fp32 partition (master, and each of Adam's states) reaches the NVMe "
      "minimum (the swap itself is checked below)", tiny["fp32_partition_bytes"] >= NVME_MIN,
      partition_MiB=tiny["fp32_partition_bytes"] / 2**20)
claim("small: every decoder-layer matrix is over the threshold (the smallest has more elements)",
      small["layer_matrix_min"] > THRESHOLD,
      layer_matrix_min=small["layer_matrix_min"], threshold=THRESHOLD)
if 2 <= NPROC < 8:
    claim(f"small on {NPROC} ranks: the embedding's and the output layer's partitions reach the NVMe minimum, "
          "and no other's", small["swappable"] == EMBED_AND_HEAD, swappable=small["swappable"])
elif NPROC >= 8:
    claim(f"small on {NPROC} ranks: no partition reaches the NVMe minimum", not small["swappable"])
else:
    claim("small on 1 rank: the embedding, the output layer and some decoder-layer matrices reach the NVMe minimum",
          set(EMBED_AND_HEAD) < set(small["swappable"]), swappable=small["swappable"])
# the same counts at other rank counts (shapes only): which partitions NVMe would take
swap_at = {r: sorted(n for n, v in small["numel"].items() if v * 2 // r >= NVME_MIN) for r in range(1, 10)}
opt_at = {r: 4 * -(-tiny["params"] // r) >= NVME_MIN for r in range(1, 10)}
for r in range(1, 10):
    print(f"{r} ranks: small's partitions at or over the minimum: "
          f"{'embedding and output layer' if swap_at[r] == EMBED_AND_HEAD else len(swap_at[r]) or 'none'}; "
          f"tiny's fp32 optimizer partition over it: {opt_at[r]}")
claim("small: on 2 to 7 ranks exactly the embedding's and the output layer's partitions reach the minimum, on 8 or "
      "more none, on 1 more than those two",
      all(swap_at[r] == EMBED_AND_HEAD for r in range(2, 8)) and not any(swap_at[r] for r in (8, 9))
      and set(EMBED_AND_HEAD) < set(swap_at[1]))
claim("tiny: the optimizer's fp32 partition reaches the minimum on 1 or 2 ranks, not on 3 or more",
      opt_at[1] and opt_at[2] and not any(opt_at[r] for r in range(3, 10)))

# %% [markdown]
# ## NVMe needs a compiled op
#
# DeepSpeed reads and writes its swap files with Linux async I/O, a C++ op it compiles once
# (it needs libaio's header: `apt-get install libaio-dev`). <!-- fact: deepspeed.async_io_needs_libaio --> `make setup` installs the header
# when it can; the first NVMe job on a machine compiles the op (its `log.txt` says how long it took),
# and `python -m helpers.warmup --nvme` does it ahead of time. A cell never compiles it without
# saying so:

# %%
if not NVME_OK:
    print(f"NVMe run: SKIPPED here - {NVME_STATE}. The other five runs are unaffected.")
elif NVME_STATE == "built":
    print("NVMe run: DeepSpeed's async_io op is built; the NVMe run starts right away.")
else:
    print("NVMe run: async_io is NOT built yet. The NVMe cell below waits for a one-time compile "
          "before its first step (its log.txt says how long it took); `python -m helpers.warmup --nvme` does it "
          "ahead of time.")

# %% [markdown]
# ## Six runs
#
# The configs' offload keys, as notebook 03 reads them, with NVMe's. They say where each config *asks*
# each kind of state to go; section 1 shows where the bytes end up: in the tiny model's NVMe run, for
# one, the parameter partitions stay in host memory, not on disk. <!-- fact: deepspeed.nvme_small_partitions_in_host -->

# %%
CONFIGS = {"FSDP, no offload": "fsdp/full_shard", "FSDP offload": "fsdp/full_shard_offload",
           "DeepSpeed, no offload": "deepspeed/zero3", "DeepSpeed optimizer": "deepspeed/zero3_offload_optimizer",
           "DeepSpeed params + optimizer": "deepspeed/zero3_offload", "DeepSpeed NVMe": "deepspeed/zero3_nvme"}
print(tables.settings_table(CONFIGS).to_string())

# %% language="bash"
# for c in fsdp/full_shard fsdp/full_shard_offload deepspeed/zero3 deepspeed/zero3_offload_optimizer deepspeed/zero3_offload; do
#     torchrun --standalone --nproc_per_node $NPROC -m helpers.train --config launch_configs/$c.yaml \
#         --out notebooks/runs/13_$(basename $c) $ARGS --steps $STEPS --reuse notebooks/runs/03_$(basename $c) | tail -n 1
# done

# %% [markdown]
# The NVMe run swaps to a folder on this machine (the config's `nvme_path` is
# relative, so `helpers.train` puts it under the system temp dir), linked from the run
# directory as `nvme_swap`; on a real node point `nvme_path` at a fast local drive:

# %% language="bash"
# if [ "$NVME" = 1 ]; then
#     torchrun --standalone --nproc_per_node $NPROC -m helpers.train --config launch_configs/deepspeed/zero3_nvme.yaml \
#         --out notebooks/runs/13_zero3_nvme $ARGS --steps $STEPS | tail -n 1
#     find notebooks/runs/13_zero3_nvme/nvme_swap/ -name "*.swp" -path "*rank0*" | sort | head -n 8
# else
#     echo "skipped: $NVME_STATE"
# fi

# %%
RUNS = {label: results.load_run(f"notebooks/runs/13_{path.split('/')[1]}") for label, path in CONFIGS.items()
        if NVME_OK or "nvme" not in path}
BASE = {label: RUNS["FSDP, no offload" if label.startswith("FSDP") else "DeepSpeed, no offload"] for label in RUNS}
print(f"{len(RUNS)} runs loaded" + ("" if NVME_OK else f" (NVMe skipped: {NVME_STATE})"))
ran(f"every run trains the tiny model for {STEPS} steps on {NPROC} ranks, with notebook 03's data and batch", RUNS.values(),
    model="tiny", steps=STEPS, world_size=NPROC, seed=0, micro_batch=8, seq_len=64)
claim("each run used the config the table names", all(r.summary["config"] == f"launch_configs/{CONFIGS[label]}.yaml"
                                                      for label, r in RUNS.items()),
      configs=[r.summary["config"] for r in RUNS.values()])
reused("each reused run is notebook 03's run of the same config (all but --out), job key (flags, ranks, code) and "
       "losses", RUNS.values(), lambda r: f"notebooks/runs/03_{r.name[3:]}")

# %% [markdown]
# ## 1 · What NVMe puts where
#
# MB held by rank 0, per kind of state, and where (notebook 03 explains the first five rows):

# %%
print(tables.location_table(RUNS).to_string())

# %% [markdown]
# * **NVMe**: the fp32 master and Adam's states are swap files on disk (one flat buffer per
#   kind of state per rank, each over 1 MiB: the swap-file count is printed below). <!-- fact: deepspeed.nvme_swaps_states_not_step --> The
#   parameter partitions stay in host memory: each is under 1 MiB here, and with `max_in_cpu`
#   at its default ZeRO-3 would keep larger ones there too (above). <!-- fact: deepspeed.nvme_params_read_back_max_in_cpu -->
# * Like `offload_optimizer: cpu`, which keeps an fp32 copy of the gradient partition on the host
#   between steps, <!-- fact: deepspeed.offload_optimizer_keeps_fp32_grads --> the NVMe run makes that copy at the end of backward: pieces of at
#   least 1 MiB (per parameter) would go to swap files, the others wait in host memory for the
#   step (here all of them, each parameter's piece being smaller: the check below). <!-- fact: deepspeed.nvme_small_grads_wait_in_host --> The swap buffers its optimizer steps through are not in
#   these counts (section 2 measures them).

# %%
def places(label, cat, rank=0):
    return set(tables.where(RUNS[label], cat, rank))


R = range(NPROC)
OPT_OFFLOADED = ["DeepSpeed optimizer"] + (["DeepSpeed NVMe"] if NVME_OK else [])
host_grads = {label: [tables.where(RUNS[label], "grads", r)["host"] for r in R] for label in OPT_OFFLOADED}
dev_grads = [sum(tables.where(RUNS["DeepSpeed, no offload"], "grads", r).values()) for r in R]
fp32_master = [RUNS["DeepSpeed, no offload"].summary["memory_bytes"][r]["master_params"] for r in R]
claim("after backward, DeepSpeed without offload holds the bf16 gradient partition only (half the fp32 master's "  # fact: deepspeed.offload_optimizer_keeps_fp32_grads
      "bytes: its fp32 copy is made during the step); with the optimizer offloaded (" + ", ".join(OPT_OFFLOADED)
      + ") it already holds one more fp32 copy, in host memory, for the host-side step: the extra bytes equal the "
      "fp32 master's",
      all(2 * d == m for d, m in zip(dev_grads, fp32_master))
      and all(h - d == m for hs in host_grads.values() for h, d, m in zip(hs, dev_grads, fp32_master)),
      host_MB={k: [h / 1e6 for h in v] for k, v in host_grads.items()}, no_offload_MB=[d / 1e6 for d in dev_grads],
      fp32_master_MB=[m / 1e6 for m in fp32_master])
if NVME_OK:
    states = [tables.where(RUNS["DeepSpeed NVMe"], "optimizer_states", r) for r in R]
    claim("with NVMe the fp32 master is on disk and Adam's states too (all but the step counters)",  # fact: deepspeed.nvme_swaps_states_not_step
          all(places("DeepSpeed NVMe", "master_params", r) == {"disk"} for r in R)
          and all(st.get("host", 0) == 4 for st in states),  # host: the one 4-byte step counter (one flat group)
          disk_MB=[st["disk"] / 1e6 for st in states], host_bytes=[st.get("host", 0) for st in states])
    if RUNS["DeepSpeed NVMe"].summary["model"] == "tiny":
        part = 2 * -(-max(tiny["numel"].values()) // NPROC)  # the largest parameter's bf16 partition per rank
        claim("no param partition of the tiny model reaches the NVMe minimum, and none is on disk: "
              "the partitions are in host memory", part < NVME_MIN and all(
                  "disk" not in places("DeepSpeed NVMe", "params", r) and "host" in places("DeepSpeed NVMe", "params", r)
                  for r in R), largest_partition_bytes=part, nvme_min=NVME_MIN)
        piece = 4 * -(-max(tiny["numel"].values()) // NPROC)  # the largest parameter's fp32 gradient piece per rank
        claim("every parameter's fp32 gradient piece is under the NVMe minimum, so all of them wait in host memory: "  # fact: deepspeed.nvme_small_grads_wait_in_host
              "no gradient byte is on disk", piece < NVME_MIN
              and all(places("DeepSpeed NVMe", "grads", r) == {"host"} for r in R),
              largest_piece_MiB=piece / 2**20, minimum_MiB=NVME_MIN / 2**20)
    else:  # e.g. small: partitions over the minimum are swapped out at the build, then read back (max_in_cpu)
        claim("no param partition is on disk after the build (offload_param.max_in_cpu at its default): the "  # fact: deepspeed.nvme_params_read_back_max_in_cpu
              "partitions are in host memory", all("disk" not in places("DeepSpeed NVMe", "params", r)
                                                   and "host" in places("DeepSpeed NVMe", "params", r) for r in R))

# %% [markdown]
# The disk bytes are the swap files themselves, each rank's own (`helpers.job.observe.offload`
# reads `nvme_swap/zero_stage_3/*/rank{r}/*.swp`). <!-- fact: deepspeed.nvme_swap_file_paths --> Rank 0 has three: its fp32 master
# partition, Adam's momentum and variance for it, each the size of the fp32 master the
# no-offload run holds on rank 0, rounded up to DeepSpeed's I/O alignment (`AIO_ALIGNED_BYTES`): <!-- fact: deepspeed.aio_aligned_bytes -->

# %%
if NVME_OK:
    import tempfile

    nvme = RUNS["DeepSpeed NVMe"]
    swap_dir = nvme.path / "nvme_swap"
    claim("the NVMe run's swap folder is under the system temp dir, linked from the run directory as nvme_swap",
          swap_dir.is_symlink() and swap_dir.resolve().is_relative_to(Path(tempfile.gettempdir()).resolve()),
          target=os.readlink(swap_dir))
    by_rank = {r: sorted((swap_dir / "zero_stage_3").glob(f"*/rank{r}/*.swp")) for r in R}
    files = by_rank[0]
    on_disk = sum(f.stat().st_size for f in files)
    master = RUNS["DeepSpeed, no offload"].summary["memory_bytes"][0]["master_params"]
    aligned = -(-master // AIO_ALIGNED_BYTES) * AIO_ALIGNED_BYTES
    kinds = {r: sorted(f.name.split("-")[0] if "-" in f.name else "master" for f in fs) for r, fs in by_rank.items()}
    disk = [sum(tables.where(nvme, c, r).get("disk", 0) for c in CATEGORIES) for r in R]
    claim("every rank swaps three files (master, Adam's exp_avg and exp_avg_sq), each the no-offload run's fp32 "
          "master bytes on rank 0 rounded up to the I/O alignment (over the NVMe minimum); each rank's disk bytes "
          "are its own three files",
          all(kinds[r] == ["exp_avg", "exp_avg_sq", "master"] and disk[r] == 3 * aligned
              and all(f.stat().st_size == aligned for f in fs) for r, fs in by_rank.items()) and aligned >= NVME_MIN,
          file_bytes=[f.stat().st_size for f in files], master_bytes=master, aligned=aligned, disk_bytes=disk)
    print(f"rank 0: {len(files)} swap files, {on_disk / 1e6:.1f} MB; largest: "
          + ", ".join(f"{f.parent.parent.name}/{f.name} {f.stat().st_size / 1e6:.1f} MB"
                      for f in sorted(files, key=lambda f: -f.stat().st_size)[:3]))
else:
    print(f"NVMe skipped: {NVME_STATE}")

# %% [markdown]
# ## 2 · Totals, peaks and NVMe's buffers
#
# The same bytes added up per location, next to the process's peak anonymous memory
# (`RssAnon`, sampled each phase; on a GPU `max_memory_allocated` of the device). On this machine
# host and device are one memory, and each run's whole state is a small part of its peak (the check
# below), so the peaks are shown without a claim that offload lowers them (on a GPU, where the allocator's peak is exact,
# the cell checks that FSDP offload lowers it; not run here). Bytes do show that the NVMe run cannot have saved
# RAM here: when `offload_param` goes to `nvme`, DeepSpeed's parameter swapper allocates `buffer_count` x
# `buffer_size` bf16 elements of host memory per rank (page-locked on a GPU; not checked here) as it starts (whether or not any
# parameter is swapped), <!-- fact: deepspeed.nvme_param_swapper_locked_buffers --> plus its optimizer swapper's buffers; the job measures both
# (`swap_buffer_bytes`), and the parameter swapper's alone are more than the bytes this run moved
# to disk (the check below):

# %%
totals = tables.location_totals(RUNS)
totals["peak MB (rank 0)"] = [r.summary["peak_memory_bytes"][0] / 1e6 for r in RUNS.values()]
print(totals.round(1).to_string())
peak = {label: r.summary["peak_memory_bytes"][0] for label, r in RUNS.items()}
if GPUS:
    claim("FSDP offload lowers the device peak", peak["FSDP offload"] < peak["FSDP, no offload"],
          offload_MB=peak["FSDP offload"] / 1e6, none_MB=peak["FSDP, no offload"] / 1e6)
else:
    share = {label: totals.loc[label, "total"] * 1e6 / peak[label] for label in RUNS}
    claim("every run's state is under 5% of its process's peak", max(share.values()) < 0.05,
          state_over_peak={label: round(x, 4) for label, x in share.items()})
if NVME_OK:
    swap = NVME_JSON["zero_optimization"]["offload_param"]
    asked = swap["buffer_count"] * swap["buffer_size"] * 2
    buffers = RUNS["DeepSpeed NVMe"].summary["swap_buffer_bytes"]  # per rank: {params, optimizer}
    on_disk = [sum(tables.where(RUNS["DeepSpeed NVMe"], c, r).get("disk", 0) for c in CATEGORIES) for r in R]
    claim("on every rank the NVMe run's parameter swapper holds buffers of at least buffer_count x "  # fact: deepspeed.nvme_param_swapper_locked_buffers
          "buffer_size bf16 elements (their size read by the job), more bytes than the state the run moved to disk: "
          "here NVMe cannot have saved RAM; and rank 0's peak is above the CPU params + optimizer run's",
          all(asked <= b["params"] and d < b["params"] for b, d in zip(buffers, on_disk))
          and peak["DeepSpeed NVMe"] > peak["DeepSpeed params + optimizer"],
          param_buffers_MB=[b["params"] / 1e6 for b in buffers], asked_MB=asked / 1e6,
          optimizer_buffers_MB=[b["optimizer"] / 1e6 for b in buffers], on_disk_MB=[d / 1e6 for d in on_disk],
          peak_MB={"NVMe": peak["DeepSpeed NVMe"] / 1e6, "CPU params + optimizer": peak["DeepSpeed params + optimizer"]
                   / 1e6, "no offload": peak["DeepSpeed, no offload"] / 1e6})
    state = {label: [sum(RUNS[label].summary["memory_bytes"][r].values()) for r in R]
             for label in ("DeepSpeed NVMe", "DeepSpeed params + optimizer")}
    claim("the swap buffers are not in the state counts: per rank the NVMe run holds the CPU params + optimizer run's "
          "state plus only its three swap files' alignment padding",
          all(n - c == 3 * (aligned - master) for n, c in zip(*state.values())), state_bytes=state,
          padding=3 * (aligned - master))

# %% [markdown]
# ## 3 · Step times with the copies
#
# Step time of each run against the same backend without offload (how the cell computes it: the
# median of the steps after the warm-up steps the jobs' own medians leave out, and their
# quartiles). Each config ran once (here, or in notebook 03 when its matching run is copied), so a ratio here mixes what the offload path costs with the machine's drift between two runs: this section shows the ratios
# and claims no cost (notebook 07 interleaves repeated runs where it claims a difference).

# %%
TIMES = {label: timing(label, step_times(r), "no offload", step_times(BASE[label]))
         for label, r in RUNS.items() if BASE[label] is not r}
ratio = {label: t.ratio for label, t in TIMES.items()}
ax = plots.plt.subplots()[1]
ax.bar(list(ratio), list(ratio.values()), color=[plots.COLORS[RUNS[label].backend] for label in ratio])
ax.axhline(1, color="black", lw=0.8)
ax.set(ylabel="median step time / no offload", title="step time relative to the same backend without offload")
ax.tick_params(axis="x", rotation=20)
ax.figure.tight_layout()
for t in TIMES.values():
    print(f"{t.measured()}, one run each")
# a precondition, not a finding: the quartiles above need 2 or more steps a side after the warm-up (full 8, quick 2)
used = {label: (len(step_times(RUNS[label])), len(step_times(BASE[label]))) for label in ratio}
claim("each ratio rests on at least 2 steps after the warm-up on each side (offload, no offload)",
      all(min(n) >= 2 for n in used.values()), steps_used=used, ratio=ratio)

# %% [markdown]
# **What it means.** Without an accelerator, "copying to the host" is at most a copy within the
# same RAM (FSDP2 makes none) <!-- fact: torch.cpu_offload_on_cpu_is_noop -->; DeepSpeed's offload keeps an extra fp32 gradient
# copy there (the location table), whose cost is not measured. The ratios come from one run each,
# so they cannot tell the offload path from the machine's drift, and we have not broken the steps
# down. NVMe adds reads and writes of the swap files, which DeepSpeed opens with `O_DIRECT`, past
# the page cache. <!-- fact: deepspeed.aio_o_direct --> On a GPU (not run here) the picture changes: every step, offloaded
# parameters are copied across PCIe to the GPU to compute with (FSDP, which reshards after
# forward, copies them again for backward), <!-- fact: torch.fsdp2_offload_copies_to_gpu --> gradients go down to the host, the optimizer
# step runs on the host's cores instead of the GPU <!-- fact: deepspeed.offload_optimizer_steps_on_host -->, and (DeepSpeed with
# `offload_optimizer` alone) the updated bf16 weights come back up; the optimizer's states and fp32
# master stay on the host: that is what offloading them saves (not checked here). That time is the
# price of the accelerator memory offload frees; measure it there with these jobs, repeated
# and interleaved (notebook 07's `timing_runs`).
#
# ## Recap
#
# * NVMe swaps only tensors of at least 1 MiB per rank (or `aio.block_size`), and with `max_in_cpu`
#   at its default brings parameter partitions back to host memory (by design; no parameter is swapped here). <!-- fact: deepspeed.nvme_min_aio_bytes --> <!-- fact: deepspeed.nvme_params_read_back_max_in_cpu -->
# * In the tiny model's NVMe run the fp32 master and Adam's states are swap files (rank 0's three,
#   each its fp32 partition rounded up to the I/O alignment); the parameter partitions and the fp32
#   gradient copy stay in host memory. <!-- fact: deepspeed.nvme_swaps_states_not_step --> <!-- fact: deepspeed.nvme_small_grads_wait_in_host -->
# * At this size, with this config's buffers, NVMe cannot have saved RAM: its parameter swapper's buffers alone
#   hold more than it moved to disk. <!-- fact: deepspeed.nvme_param_swapper_locked_buffers --> On this CPU each run's state is a small part
#   of its process's peak.
# * Single runs print step-time ratios but claim no cost.
#
# Back to the path: `04_prefetch`.
