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
# DeepSpeed offloads parameters and the optimizer separately, and can go to NVMe. What does
# each setting really move, where does each kind of state end up, and does it change
# training?
#
# **What we run.** The same model, data and steps with six configs, 2 ranks each (1 on a
# one-GPU machine; on more, the tiny model's optimizer partitions would fall under NVMe's
# minimum: the sizes cell below): <!-- fact: deepspeed.nvme_min_aio_bytes -->
#
# | run | config | offload setting |
# |---|---|---|
# | FSDP, no offload | `launch_configs/fsdp/full_shard.yaml` | - |
# | FSDP offload | `launch_configs/fsdp/full_shard_offload.yaml` | `fsdp_offload_params: true` <!-- fact: accelerate.fsdp_offload_one_switch --> |
# | DeepSpeed, no offload | `launch_configs/deepspeed/zero3.yaml` | - |
# | DeepSpeed optimizer | `launch_configs/deepspeed/zero3_offload_optimizer.yaml` | `offload_optimizer: cpu` |
# | DeepSpeed params + optimizer | `launch_configs/deepspeed/zero3_offload.yaml` | `offload_optimizer` + `offload_param: cpu` |
# | DeepSpeed NVMe | `launch_configs/deepspeed/zero3_nvme.yaml` | both to `nvme`, a local directory |
#
# **What we look at.** (1) the bytes each rank holds, by kind of state and by *location*:
# accelerator ("device"), host memory ("host"), disk; (2) checks of the guide's claims
# against those bytes; (3) step time as a ratio to no offload (single runs: shown, no cost
# claimed); (4) the losses.
#
# **Read this first on a CPU-only machine.** Here there is no accelerator: "device" and
# "host" are the same RAM. The runs show where each backend *puts* its states (its own
# bookkeeping: what it sends through its offload path) and the extra copies some settings
# make; they cannot show a saving of accelerator memory, because there is none: device and host are one
# RAM, and only the NVMe run's swap files leave it (for the disk). On a GPU the same
# cells read each tensor's real device, and the "device" column is the accelerator memory
# that offload frees.

# %%
import os

from helpers import facts, nb
from helpers.core.mapping import CATEGORIES
from helpers.job import ops
from helpers.nb import plots, results, tables
from helpers.nb.claims import claim, step_times, timing

SIZE = nb.setup()  # "quick" under `make test`: the same cells, fewer steps
STEPS = 4 if SIZE == "quick" else 10
GPUS = nb.gpu_count()
NPROC = min(GPUS, 2) if GPUS else 2  # offload needs no more ranks to show what it moves
ARGS = "--model tiny --micro-batch 8 --seq-len 64"  # the tiny model: its sizes are printed below
NVME_OK, NVME_STATE = ops.aio_status()
os.environ.update(STEPS=str(STEPS), NPROC=str(NPROC), ARGS=ARGS, NVME="1" if NVME_OK else "0",
                  NVME_STATE=NVME_STATE)
print(f"size={SIZE}: {STEPS} steps on {NPROC} ranks ({'GPU' if GPUS else 'CPU only: device and host are the same RAM'})")

# %% [markdown]
# Two DeepSpeed limits shape what the tiny model shows: ZeRO-3 keeps parameters of at most
# `stage3_param_persistence_threshold` elements whole on every rank, next to the compute,
# offload or not; <!-- fact: deepspeed.zero3_persistent_small_params --> and it swaps to NVMe only tensors of at least `MIN_AIO_BYTES` per rank, or
# the config's `aio.block_size` if that is larger. <!-- fact: deepspeed.nvme_min_aio_bytes --> In the tiny model every decoder-layer weight is under the first (each
# parameter still has its 1/N partition, which is what offload moves; the small ones are also
# kept whole on every rank), <!-- fact: deepspeed.zero3_persistent_keep_partition --> and every parameter partition is under the second, while the
# optimizer's fp32 partition (one flat buffer per kind of state per rank) <!-- fact: deepspeed.zero3_one_flat_partition_per_rank --> is over it on this
# notebook's ranks. With
# `ARGS = "--model small ..."` the decoder-layer matrices are over the threshold, so only
# their partitions are kept, <!-- fact: deepspeed.zero3_persistent_small_params --> and on 2 to 7 ranks (this notebook runs 2 but on one GPU) the partitions of the
# embedding and the output layer, and only theirs, are large enough to be swapped; on 8 or
# more, none is (on one rank a partition is the whole tensor, and the larger decoder-layer
# matrices reach it too). Large enough, but not left on disk: ZeRO-3 swaps them out as it
# builds the model, then reads them back into a host buffer for good, because
# `offload_param.max_in_cpu` (1e9 elements by default; our config leaves it) lets every
# partition of a model this size live in host memory. <!-- fact: deepspeed.nvme_params_read_back_max_in_cpu --> To keep parameters on NVMe, set it
# below the partitions' total. The two limits, and both models' sizes
# next to them (bf16 partitions of 1/`NPROC`, built on the meta device: no weights):

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
      "minimum, so NVMe swaps it", tiny["fp32_partition_bytes"] >= NVME_MIN,
      partition_MiB=tiny["fp32_partition_bytes"] / 2**20)
claim("small: every decoder-layer matrix is over the threshold", small["layer_matrix_min"] > THRESHOLD)
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
# when it can; the first NVMe job on a machine compiles the op, once (its `log.txt` says how long it took),
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
# ## The offload keys
#
# One key in FSDP; <!-- fact: accelerate.fsdp_offload_one_switch --> two in DeepSpeed, `offload_param` for the parameter partitions and
# `offload_optimizer` for the rest <!-- fact: deepspeed.offload_keys --> <!-- fact: deepspeed.zero3_offload_keys --> (read from the configs: where each one
# *asks* for each kind of state to go; section 1 shows where the bytes end up: in the tiny
# model's NVMe run, for one, the parameter partitions stay in host memory, not on disk): <!-- fact: deepspeed.nvme_small_partitions_in_host -->

# %%
# NBVAL_CHECK_OUTPUT
CONFIGS = {"FSDP, no offload": "fsdp/full_shard", "FSDP offload": "fsdp/full_shard_offload",
           "DeepSpeed, no offload": "deepspeed/zero3", "DeepSpeed optimizer": "deepspeed/zero3_offload_optimizer",
           "DeepSpeed params + optimizer": "deepspeed/zero3_offload", "DeepSpeed NVMe": "deepspeed/zero3_nvme"}
print(tables.settings_table(CONFIGS).to_string())

# %% [markdown]
# ## Six runs
#
# Each run measures, after the backward pass of step 1, every tensor of the four kinds of
# state on each rank and where it is (`memory_location_bytes` in `summary.json`,
# `helpers.job.observe.offload`): on a GPU from the tensor's device; on this machine from the backend's
# offload bookkeeping (FSDP2's `offload_to_cpu` per parameter, <!-- fact: torch.fsdp2_offload_policy_per_module --> DeepSpeed's
# `offload_optimizer`/`offload_param` and each partition's final location); NVMe-swapped
# states from the sizes of the rank's swap files on disk.

# %% language="bash"
# for c in fsdp/full_shard fsdp/full_shard_offload deepspeed/zero3 deepspeed/zero3_offload_optimizer deepspeed/zero3_offload; do
#     torchrun --standalone --nproc_per_node $NPROC -m helpers.train --config launch_configs/$c.yaml \
#         --out notebooks/runs/03_$(basename $c) $ARGS --steps $STEPS | tail -n 1
# done

# %% [markdown]
# The NVMe run swaps to a folder on this machine's own disk (the config's `nvme_path` is
# relative, so `helpers.train` puts it under the system temp dir), linked from the run
# directory as `nvme_swap`; on a real node point `nvme_path` at a fast local drive:

# %% language="bash"
# if [ "$NVME" = 1 ]; then
#     torchrun --standalone --nproc_per_node $NPROC -m helpers.train --config launch_configs/deepspeed/zero3_nvme.yaml \
#         --out notebooks/runs/03_zero3_nvme $ARGS --steps $STEPS | tail -n 1
#     find notebooks/runs/03_zero3_nvme/nvme_swap/ -name "*.swp" -path "*rank0*" | sort | head -n 8
# else
#     echo "skipped: $NVME_STATE"
# fi

# %%
RUNS = {label: results.load_run(f"notebooks/runs/03_{path.split('/')[1]}") for label, path in CONFIGS.items()
        if NVME_OK or "nvme" not in path}
BASE = {label: RUNS["FSDP, no offload" if label.startswith("FSDP") else "DeepSpeed, no offload"] for label in RUNS}
print(f"{len(RUNS)} runs loaded" + ("" if NVME_OK else f" (NVMe skipped: {NVME_STATE})"))

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
# * **FSDP offload moves everything together**: the parameter shards, their gradients and
#   Adam's states all go to the host, and the optimizer steps there. <!-- fact: torch.fsdp2_cpu_offload_all --> No key offloads one
#   kind of state alone (Accelerate has one switch for the whole model; torch's `fully_shard`
#   takes it per module). <!-- fact: torch.fsdp2_offload_policy_per_module --> <!-- fact: accelerate.fsdp_offload_one_switch -->
# * **DeepSpeed can offload the optimizer alone**: with `offload_optimizer` the fp32 master,
#   Adam's states and the reduced gradient partitions go to the host, while the bf16
#   parameter partitions stay next to the compute. <!-- fact: deepspeed.zero3_offload_keys --> Offloading to the CPU, DeepSpeed also
#   keeps an fp32 copy of the gradient partition on the host for its host-side step (a buffer
#   of its own, which by DeepSpeed's source lives between steps), so after backward the "grads"
#   bar is one fp32 copy of the partition taller (the check below, read after backward; without
#   offload ZeRO-3 holds no such copy then: it makes one during the step and frees it after): <!-- fact: deepspeed.offload_optimizer_keeps_fp32_grads -->
#   offload moves bytes *and* keeps more of them alive. The NVMe run makes the same fp32
#   gradient copy at the end of backward: pieces of at least 1 MiB would go to swap files, the
#   others wait in host memory for the step (here all of them: the same check). <!-- fact: deepspeed.nvme_small_grads_wait_in_host --> The swap
#   buffers its optimizer steps through are not in these counts (section 2 measures them).
# * **Params + optimizer** moves the bf16 parameter partitions to the host too. The
#   "persistent" small parameters that ZeRO-3 keeps whole stay next to the compute - in
#   this tiny model that is every decoder-layer weight and the final norm, whose bytes "device"
#   keeps (the check below prints both parts). <!-- fact: deepspeed.zero3_offload_keys --> <!-- fact: deepspeed.zero3_persistent_small_params -->
# * **NVMe**: the fp32 master and Adam's states are swap files on disk (one flat buffer per
#   kind of state per rank, each over 1 MiB: the swap-file count is printed below). <!-- fact: deepspeed.nvme_swaps_states_not_step --> The
#   parameter partitions stay in host memory: each is under 1 MiB here, and with `max_in_cpu`
#   at its default ZeRO-3 would keep larger ones there too (above). <!-- fact: deepspeed.nvme_params_read_back_max_in_cpu -->
#
# On this machine the checks below read each backend's own bookkeeping (what it was told to
# offload, as it recorded it): they catch a config key that did not take effect, not bytes crossing a
# bus. On a GPU the same checks read each tensor's device.

# %%
def places(label, cat, rank=0):
    return set(tables.where(RUNS[label], cat, rank))


facts.show("torch.fsdp2_offload_policy_per_module", "deepspeed.zero3_offload_keys",
           "deepspeed.offload_optimizer_keeps_fp32_grads")
ALL3 = ("params", "grads", "optimizer_states")
R = range(NPROC)
claim("FSDP without offload keeps params, grads and optimizer states on the device, on every rank",
      all(places("FSDP, no offload", c, r) == {"device"} for c in ALL3 for r in R))
claim("FSDP offload moves all three to the host together, on every rank (the concept guide's 'all or nothing')",  # fact: torch.fsdp2_cpu_offload_all
      all(places("FSDP offload", c, r) == {"host"} for c in ALL3 for r in R))
claim("FSDP offload holds the same state bytes as no offload: the same shards, moved (buffers outside the "  # fact: torch.fsdp2_cpu_offload_all
      "state are not in these counts)",
      RUNS["FSDP offload"].summary["memory_bytes"] == RUNS["FSDP, no offload"].summary["memory_bytes"])
claim("DeepSpeed's offload_optimizer keeps the params on the device and puts the fp32 master, Adam's states "  # fact: deepspeed.zero3_offload_keys
      "and the grad partitions on the host",
      all(places("DeepSpeed optimizer", "params", r) == {"device"} for r in R)
      and all(places("DeepSpeed optimizer", c, r) == {"host"}
              for c in ("optimizer_states", "master_params", "grads") for r in R))
OPT_OFFLOADED = ["DeepSpeed optimizer"] + (["DeepSpeed NVMe"] if NVME_OK else [])
host_grads = {label: [tables.where(RUNS[label], "grads", r)["host"] for r in R] for label in OPT_OFFLOADED}
dev_grads = [sum(tables.where(RUNS["DeepSpeed, no offload"], "grads", r).values()) for r in R]
fp32_master = [RUNS["DeepSpeed, no offload"].summary["memory_bytes"][r]["master_params"] for r in R]
claim("after backward, DeepSpeed without offload holds the bf16 gradient partition only (half the fp32 master's "  # fact: deepspeed.offload_optimizer_keeps_fp32_grads
      "bytes: its fp32 copy is made during the step); with the optimizer offloaded (" + ", ".join(OPT_OFFLOADED)
      + ") it already holds one more fp32 copy, for the host-side step: the extra bytes equal the fp32 master's",
      all(2 * d == m for d, m in zip(dev_grads, fp32_master))
      and all(h - d == m for hs in host_grads.values() for h, d, m in zip(hs, dev_grads, fp32_master)),
      host_MB={k: [h / 1e6 for h in v] for k, v in host_grads.items()}, no_offload_MB=[d / 1e6 for d in dev_grads],
      fp32_master_MB=[m / 1e6 for m in fp32_master])
both = [tables.where(RUNS["DeepSpeed params + optimizer"], "params", r) for r in R]
alone = [tables.where(RUNS["DeepSpeed optimizer"], "params", r) for r in R]
persistent = SHAPES[RUNS["DeepSpeed params + optimizer"].summary["model"]]["persistent_bytes"]
claim("adding offload_param moves the same param bytes to the host but for the persistent ones, which stay whole "  # fact: deepspeed.zero3_persistent_small_params
      "on the device (bf16 bytes of every parameter of at most the threshold's elements)",
      all(b.get("host", 0) > 0 and b.get("device", 0) == persistent and b["host"] + b["device"] == a["device"]
          for b, a in zip(both, alone)),
      host_MB=[b.get("host", 0) / 1e6 for b in both], device_MB=[b.get("device", 0) / 1e6 for b in both],
      persistent_MB=persistent / 1e6)
if NVME_OK:
    states = [tables.where(RUNS["DeepSpeed NVMe"], "optimizer_states", r) for r in R]
    claim("with NVMe the fp32 master is on disk and Adam's states too (all but the step counters)",  # fact: deepspeed.nvme_swaps_states_not_step
          all(places("DeepSpeed NVMe", "master_params", r) == {"disk"} for r in R)
          and all(st["disk"] > 1000 * st.get("host", 0) for st in states),
          disk_MB=[st["disk"] / 1e6 for st in states], host_bytes=[st.get("host", 0) for st in states])
    if RUNS["DeepSpeed NVMe"].summary["model"] == "tiny":
        claim("no param partition of the tiny model reaches the NVMe minimum, and none is on disk: "
              "the partitions are in host memory", all("disk" not in places("DeepSpeed NVMe", "params", r)
                                                       and "host" in places("DeepSpeed NVMe", "params", r) for r in R))
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
    nvme = RUNS["DeepSpeed NVMe"]
    files = sorted((nvme.path / "nvme_swap" / "zero_stage_3").glob("*/rank0/*.swp"))
    on_disk = sum(f.stat().st_size for f in files)
    master = RUNS["DeepSpeed, no offload"].summary["memory_bytes"][0]["master_params"]
    aligned = -(-master // AIO_ALIGNED_BYTES) * AIO_ALIGNED_BYTES
    claim("rank 0 swaps three files, each the no-offload run's fp32 master bytes on rank 0 rounded up to the "
          "I/O alignment", len(files) == 3 and all(f.stat().st_size == aligned for f in files),
          file_bytes=[f.stat().st_size for f in files], master_bytes=master, aligned=aligned)
    print(f"rank 0: {len(files)} swap files, {on_disk / 1e6:.1f} MB; largest: "
          + ", ".join(f"{f.parent.parent.name}/{f.name} {f.stat().st_size / 1e6:.1f} MB"
                      for f in sorted(files, key=lambda f: -f.stat().st_size)[:3]))
else:
    print(f"NVMe skipped: {NVME_STATE}")

# %% [markdown]
# ## 2 · Totals per location
#
# The same bytes added up per location, next to the process's peak anonymous memory
# (`RssAnon`, sampled each phase; on a GPU `max_memory_allocated` of the device). On a GPU
# the device peak is what offload lowers (not checked here); on this machine host and device are one memory,
# so offload has nowhere to move the bytes. Nor could these peaks show it: each run's whole
# state is a small part of its peak (the check below), so on this CPU the peaks are shown
# without a claim about them (on a GPU, where
# the allocator's peak is exact, the cell checks that FSDP offload lowers it). Bytes do show that the
# NVMe run cannot have saved RAM here: when `offload_param` goes to `nvme`, DeepSpeed's
# parameter swapper allocates `buffer_count` x `buffer_size` bf16 elements of page-locked
# host memory per rank as it starts (whether or not any parameter is swapped), <!-- fact: deepspeed.nvme_param_swapper_locked_buffers --> plus its
# optimizer swapper's buffers; the job measures both (`swap_buffer_bytes`), and the parameter
# swapper's alone are more than the bytes this run moved to disk (the check below):

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
    claim("on every rank the NVMe run's parameter swapper holds page-locked buffers of at least buffer_count x "  # fact: deepspeed.nvme_param_swapper_locked_buffers
          "buffer_size bf16 elements (their size read by the job), more bytes than the state the run moved to disk: "
          "here NVMe cannot have saved RAM", all(asked <= b["params"] and d < b["params"] for b, d in zip(buffers, on_disk)),
          param_buffers_MB=[b["params"] / 1e6 for b in buffers], asked_MB=asked / 1e6,
          optimizer_buffers_MB=[b["optimizer"] / 1e6 for b in buffers], on_disk_MB=[d / 1e6 for d in on_disk],
          peak_MB={"NVMe": peak["DeepSpeed NVMe"] / 1e6, "no offload": peak["DeepSpeed, no offload"] / 1e6})

# %% [markdown]
# ## 3 · What the copies cost
#
# Step time of each run against the same backend without offload: the median of the steps
# after the warm-up steps the jobs' own medians leave out, and their quartiles. Each config
# runs once, one after the other (on a machine other work may share), so a
# ratio here mixes what the offload path costs with the machine's drift between two runs: this section shows the ratios
# and claims no cost (notebook 08 interleaves repeated runs where it claims one).

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
claim("every ratio compares two runs of the same backend, model and steps, each with steps after the warm-up",
      all(RUNS[label].backend == BASE[label].backend and RUNS[label].summary["steps"] == BASE[label].summary["steps"]
          and RUNS[label].summary["model"] == BASE[label].summary["model"]
          and min(len(step_times(RUNS[label])), len(step_times(BASE[label]))) >= 2 and 0 < x < float("inf")
          for label, x in ratio.items()), ratio=ratio)

# %% [markdown]
# **What it means.** The lines above are what these single runs measured. Without an accelerator, "copying to
# the host" is at most a copy within the same RAM (FSDP2 makes none) <!-- fact: torch.cpu_offload_on_cpu_is_noop --> and the optimizer runs on the same cores either way,
# so there is no transfer to pay for. What differs is the code each offload path runs (its own
# buffers and copies). The ratios above come from one run each, so they cannot tell the
# offload path from the machine's drift, and we have not broken the steps down. NVMe adds reads and
# writes of the swap files, which DeepSpeed opens with `O_DIRECT`, past the page cache. <!-- fact: deepspeed.aio_o_direct --> On a GPU (not run here) the picture changes: every step, offloaded
# parameters are copied across PCIe to the GPU to compute with (FSDP, which reshards after
# forward, copies them again for backward), <!-- fact: torch.fsdp2_offload_copies_to_gpu --> gradients go down to the host, the optimizer
# step runs on the host's cores instead of the GPU <!-- fact: deepspeed.offload_optimizer_steps_on_host -->, and (DeepSpeed with
# `offload_optimizer` alone) the updated bf16 weights come back up; the optimizer's states and fp32
# master stay on the host: that is what offloading them saves (not checked here).
# That time is the price of the accelerator memory offload frees; measure it there with the
# same cells, repeated and interleaved.
#
# ## 4 · The losses

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
    claim("every offload setting trains bit-identically to the same backend without offload", all(same.values()),
          identical=same)
if nb.bitwise_parity_expected(NPROC):  # CPU; GPU: see nb.bitwise_parity_expected
    claim("FSDP without offload trains bit-identically to DeepSpeed without offload (the aligned pair of notebook 02)",
          losses["FSDP, no offload"] == losses["DeepSpeed, no offload"])
if SIZE == "full" and NPROC == 2:  # the last of 10 steps is a bump (notebook 00 explains it)
    lo = losses["FSDP, no offload"]
    claim("the last loss is a bump at step 9 after the loss had fallen at every step before it, not a stall",
          lo[9] > lo[8] + 0.3 and all(b < a for a, b in zip(lo[:9], lo[1:9])), step0=lo[0], step8=lo[8], step9=lo[9])

# %% [markdown]
# On this CPU, offload changed the backends' bookkeeping and copies (and, with NVMe, where the
# optimizer's bytes wait: on disk), not the arithmetic, because the same torch AdamW steps on the host
# (our JSONs set `zero_force_ds_cpu_optimizer: false`): <!-- fact: deepspeed.offload_needs_force_cpu_optimizer_off --> the losses are the same bit for bit. (On a GPU, where the
# step moves to the host, <!-- fact: deepspeed.offload_optimizer_steps_on_host --> we do not assume it rounds like the GPU's kernels (not checked
# here): there the check compares every step's loss within 1% instead, not yet run.) At full size on 2 ranks the final loss is step 9's, a bump after the loss fell
# at every step before it (the check above, which runs there; notebook 00 trains on the same
# data at the same rate and explains it), not a sign that training stalled.
#
# ## Recap
#
# What this machine measured (from the run directories):

# %%
facts.show("deepspeed.offload_needs_force_cpu_optimizer_off")
print(f"{RUNS['FSDP, no offload'].summary['num_params'] / 1e6:.1f}M params, {NPROC} ranks, {STEPS} steps, "
      f"on {RUNS['FSDP, no offload'].summary['device']}; MB on rank 0 (device / host / disk):")
for label, row in totals.iterrows():
    t = TIMES.get(label)
    print(f"  {label:30s} {row['device']:7.1f} / {row['host']:7.1f} / {row['disk']:7.1f}   "
          + (f"step time x{t.ratio:.2f} (one run each: no cost claimed)" if t else "(the baseline)"))
if not NVME_OK:
    print(f"  DeepSpeed NVMe: skipped ({NVME_STATE})")

# %% [markdown]
# * Accelerate's FSDP has one offload switch, and it moves parameters, gradients and optimizer states
#   together; <!-- fact: accelerate.fsdp_offload_one_switch --> <!-- fact: torch.fsdp2_cpu_offload_all --> DeepSpeed offloads the optimizer alone (the bf16 params stay), the params
#   too, and either to NVMe, where the master weights and Adam's states become swap files. <!-- fact: deepspeed.zero3_offload_keys --> <!-- fact: deepspeed.nvme_swaps_states_not_step -->
# * DeepSpeed's CPU optimizer offload keeps an fp32 gradient copy on the host between steps; <!-- fact: deepspeed.offload_optimizer_keeps_fp32_grads --> ZeRO-3 keeps its
#   small persistent params next to the compute; <!-- fact: deepspeed.zero3_persistent_small_params --> only tensors of at least 1 MiB per rank
#   (or the config's `aio.block_size`, if larger) go to disk. <!-- fact: deepspeed.nvme_min_aio_bytes -->
# * On this CPU, with the same torch AdamW stepping on the host, the losses do not change with offload, bit for bit <!-- fact: deepspeed.offload_needs_force_cpu_optimizer_off --> (on a GPU the host-side
#   step is checked within 1% instead, not yet run there). On this CPU-only machine no accelerator memory is
#   saved - there is none: device and host are one RAM, and only NVMe's swap files leave it -
#   and its single runs claim no step-time cost; on a GPU the "device" column is what offload
#   frees, paid for in PCIe traffic and a host-side optimizer step <!-- fact: torch.fsdp2_offload_copies_to_gpu --> <!-- fact: deepspeed.offload_optimizer_steps_on_host --> (measure it there with
#   repeated, interleaved runs).

# %% [markdown]
# ## Optional: try other settings
#
# Nothing below is part of the story above, and nothing runs until you click **Run**. The
# panel's defaults are this notebook's own command (`$ARGS --steps $STEPS`); it launches the selected configs
# into its own run directories (`notebooks/runs/panel_03_*`) and redraws where rank 0's states live. Try the `small` model: its decoder-layer matrices are then over the persistence threshold (only their partitions are kept). <!-- fact: deepspeed.zero3_persistent_small_params -->

# %%
from helpers.nb import widgets

widgets.ControlPanel("03", {"FSDP": "launch_configs/fsdp/full_shard.yaml",
                            "FSDP offload": "launch_configs/fsdp/full_shard_offload.yaml",
                            "ZeRO-3": "launch_configs/deepspeed/zero3.yaml",
                            "ZeRO-3 offload optimizer": "launch_configs/deepspeed/zero3_offload_optimizer.yaml",
                            "ZeRO-3 offload all": "launch_configs/deepspeed/zero3_offload.yaml"},
                     args="$ARGS --steps $STEPS", plot=widgets.plot_locations,
                     selected=["FSDP offload", "ZeRO-3 offload all"])
