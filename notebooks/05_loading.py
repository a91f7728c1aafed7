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
# # 05 · Loading a pretrained model without every rank holding all of it
#
# **The question.** Sharding saves memory *once the model is sharded*. But a pretrained
# model has to be read first — and if every rank reads the whole file, the peak memory per
# rank is the full model anyway. How do FSDP and DeepSpeed avoid that, and what do they
# save?
#
# **What we run.** A local pretrained checkpoint (a preset saved with `save_pretrained`:
# `config.json`, `generation_config.json`, `model.safetensors`), <!-- fact: transformers.save_pretrained_files -->
# loaded by real jobs in three ways, at 2 ranks:
#
# | method | config key (Accelerate's) | what each rank does |
# |---|---|---|
# | naive | `fsdp_cpu_ram_efficient_loading: false` (`accelerate launch` turns it on when a file leaves it out) | `from_pretrained` on every rank (in bf16 here), upcast to fp32 for mixed precision, then shard <!-- fact: accelerate.ram_efficient_loading_default_off --> <!-- fact: accelerate.fsdp2_upcasts_with_mixed_precision --> |
# | FSDP RAM-efficient | `fsdp_cpu_ram_efficient_loading` (the launcher also demands `fsdp_sync_module_states`, which FSDP2 ignores) <!-- fact: accelerate.fsdp2_sync_module_states_required_but_ignored --> | meta-device init, shard, `to_empty`; rank 0 reads and broadcasts (here `set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`; `accelerate launch` broadcasts per tensor with its own function) <!-- fact: torch.broadcast_from_rank0_per_tensor --> |
# | DeepSpeed ZeRO-3 init | `zero3_init_flag` | `from_pretrained` inside `deepspeed.zero.Init` (transformers' `HfDeepSpeedConfig`): <!-- fact: transformers.from_pretrained_in_zero_init --> each module's parameters are partitioned once it is created <!-- fact: deepspeed.zero_init_partitions_on_creation --> |
#
# **What we look at.** Per rank: load time, peak `RssAnon` and `RssFile` (see below why
# not plain RSS), and whether every loaded value equals the file's, in its place on its rank
# — all from `summary.json` under `loading`.

# %%
import math
import os

import pandas as pd
from safetensors import safe_open

from helpers import facts, nb
from helpers.job import loading
from helpers.nb import plots, results
from helpers.nb.claims import claim, ran

SIZE = nb.setup()  # "quick" under `make test`: a smaller model
MODEL = "small" if SIZE == "quick" else "medium"
N = 2  # ranks: one per core here; on a GPU node one per GPU (nccl)
assert nb.world_sizes([N]), f"this notebook needs {N} ranks; this node has {nb.gpu_count()} GPU(s)"
PRETRAINED = f"notebooks/runs/05_pretrained_{MODEL}"
os.environ.update(MODEL=MODEL, PRETRAINED=PRETRAINED, N=str(N))
print(f"size={SIZE}: preset {MODEL} at {N} ranks")
facts.show("accelerate.fsdp2_sync_module_states_required_but_ignored")  # the FSDP row's second key

# %% [markdown]
# ## A local "pretrained" checkpoint
#
# Nothing can be downloaded here, so we make one (once; later runs reuse it): the preset with seeded random weights,
# saved in fp32 with `save_pretrained`. `--model DIR` accepts any such directory, a real
# checkpoint included (not run here).

# %% language="bash"
# [ -f $PRETRAINED/model.safetensors ] || python -m helpers.loading $MODEL $PRETRAINED
# ls -la $PRETRAINED

# %% [markdown]
# ## Three loads
#
# One optimizer step each (the load is what we measure; the step only shows the job runs on).
# The measurement (how `helpers.train` brackets it; not checked here) runs from model creation until the weights are sharded: through
# `fully_shard` for naive loading, through `fully_shard`, `to_empty` and rank 0's broadcast
# for RAM-efficient loading, through `from_pretrained` for ZeRO-3
# init (the partitioning happened during it; `deepspeed.initialize` then allocates the
# optimizer's fp32 master partitions, which is not loading). <!-- fact: deepspeed.initialize_fp32_master -->

# %% language="bash"
# for CFG in fsdp/full_shard fsdp/full_shard_ram_efficient deepspeed/zero3_init; do
#   torchrun --standalone --nproc_per_node $N -m helpers.train --config launch_configs/$CFG.yaml \
#     --out notebooks/runs/05_$(basename $CFG) --model $PRETRAINED --steps 1 --micro-batch 1 --seq-len 8 \
#     | grep loaded
# done

# %% [markdown]
# (Host memory only: on a GPU node the same jobs put the shards on the GPUs, which these
# numbers do not show; the cells are written for, not yet run on, a GPU.)
#
# ## Why `RssAnon` and `RssFile`, not RSS
#
# transformers memory-maps safetensors files. <!-- fact: transformers.safetensors_memory_mapped --> Pages of the mapping count in RSS as
# `RssFile` while they are touched, but the kernel can drop them at any time (they are a
# cache of the file). What a rank really *owns* is anonymous memory, `RssAnon`: tensors it
# allocated. Plain RSS adds the two and overstates what a method costs.

# %%
NAMES = {"full_shard": "naive", "full_shard_ram_efficient": "FSDP RAM-efficient", "zero3_init": "ZeRO-3 init"}
runs = {label: results.load_run(f"notebooks/runs/05_{name}") for name, label in NAMES.items()}
rows = []
for label, run in runs.items():
    ld = run.summary["loading"]
    for rank, r in enumerate(ld["ranks"]):
        rows.append(dict(method=label, rank=rank, seconds=r["seconds"],
                         peak_anon_MiB=r["peak_rss_anon_bytes"] / 2**20,
                         peak_file_MiB=r["peak_rss_file_bytes"] / 2**20,
                         after_anon_MiB=r["after_rss_anon_bytes"] / 2**20,
                         weights_match=ld["weights_match"], used=ld["method"]))
table = pd.DataFrame(rows)
counts = {label: r.summary["num_params"] for label, r in runs.items()}  # each job's own parameter count
num_params = run.summary["num_params"]
print(f"{num_params / 1e6:.1f}M params: {num_params * 4 / 2**20:.0f} MiB in fp32, {num_params * 2 / 2**20:.0f} MiB in bf16")
ran(f"three loads of {PRETRAINED} at {N} ranks, one optimizer step each", runs.values(), model=PRETRAINED,
    world_size=N, steps=1, dist_backend="nccl" if nb.gpu_count() else "gloo")
dt = {label: r.summary["dtypes"] for label, r in runs.items()}
claim("every method loads in bf16; naive then holds fp32 (the upcast for mixed precision)",
      all(d["loaded"] == "bf16" for d in dt.values()) and dt["naive"]["stored_param"] == "fp32",
      loaded={k: d["loaded"] for k, d in dt.items()}, naive_holds=dt["naive"]["stored_param"])
with safe_open(f"{PRETRAINED}/model.safetensors", "pt") as f:
    saved = [f.get_slice(k) for k in f.keys()]
claim("the checkpoint holds the model in fp32: every tensor F32, as many values as the jobs' parameters",
      {t.get_dtype() for t in saved} == {"F32"} and set(counts.values()) == {sum(math.prod(t.get_shape()) for t in saved)},
      dtypes=sorted({t.get_dtype() for t in saved}), values=sum(math.prod(t.get_shape()) for t in saved),
      params=counts)
table.round(1)

# %%
full_MiB = num_params * 4 / 2**20  # the whole model in fp32: the file's dtype, and naive's after the upcast
fig, ax = plots.plt.subplots()
width = 0.8 / len(NAMES)
for i, label in enumerate(NAMES.values()):
    s = table[table.method == label]
    ax.bar(s["rank"] + (i - 1) * width, s.peak_anon_MiB, width, label=label,
           color=plots.COLORS["deepspeed" if label.startswith("ZeRO") else "fsdp"],
           hatch="//" if label == "naive" else None, edgecolor="white")
ax.axhline(full_MiB, color="k", ls="--", lw=1, label="whole model (fp32)")
ax.axhline(full_MiB / N, color="k", ls=":", lw=1, label="one shard (fp32)")
ax.set(xlabel="rank", ylabel="peak RssAnon above start (MiB)", title=f"{N} ranks", xticks=range(N))
fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=3, frameon=False)
fig.tight_layout(rect=(0, 0.14, 1, 1))

# %% [markdown]
# **What it means.**
#
# * **Naive**: every rank peaks near or above the whole model in fp32 (after the upcast; the dashed line). Ranks on one
#   machine load at the same time (by design: the job starts every rank's load together), each holding its own full copy.
# * **FSDP RAM-efficient**: the other ranks build the model on the meta device (no memory)
#   and receive rank 0's broadcast one full tensor at a time, keeping only their shard; they
#   peak far below naive. By the guide's design (`helpers.job.loading`), rank 0 builds the whole state dict in its own memory, in the load
#   dtype (bf16 here), to broadcast it, <!-- fact: torch.broadcast_from_rank0_per_tensor --> on top of its own fp32 shard, and its
#   peak stays well above the others'. The saving is on the other `world_size - 1` ranks (one here),
#   which never build the whole state dict (by design: the peaks alone cannot show it).
# * **ZeRO-3 init**: each module's parameters are partitioned once the module is created, <!-- fact: deepspeed.zero_init_partitions_on_creation -->
#   and filled module by module; only rank 0 reads the file's values <!-- fact: transformers.zero3_rank0_reads_fills_per_module --> (`peak_file_MiB`: rank 0's is
#   the memory-mapped file, page cache, not a copy it made; the others' stays far below). The
#   peaks cannot show whether a rank ever held the whole model: above its bf16 shard a rank
#   holds DeepSpeed's working memory, which we have not broken down. What they show is that every rank, rank 0 included, stays
#   well below naive.
#
# The checks below hold these statements' numbers to this run.

# %%
facts.show("torch.broadcast_from_rank0_per_tensor", "deepspeed.zero_init_partitions_on_creation",
           "transformers.zero3_rank0_reads_fills_per_module")  # the mechanisms above
ASKED = {"naive": "naive", "FSDP RAM-efficient": "fsdp_ram_efficient", "ZeRO-3 init": "zero3_init"}
match_ok = (table.used == table.method.map(ASKED)).all() and table.weights_match.all()
claim("each job's config selects the method its label names (as the job recorded it), and in every job every rank's "
      "loaded values equal the file's (rounded to the load dtype), element by element, in place", match_ok,
      used=sorted(set(zip(table.method, table.used))), jobs_matching=f"{sum(r.summary['loading']['weights_match'] for r in runs.values())} of {len(runs)} (each job's "
      "ranks, all-reduced)")
# one bound per method, at either size (quick: small): a rank that built the whole fp32 model would peak near naive
BOUND, ZBOUND = 0.6, 0.7  # FSDP RAM-efficient's other ranks; ZeRO-3 init's ranks
peak = {label: table[table.method == label].set_index("rank").peak_anon_MiB for label in NAMES.values()}
naive, ram, zero = peak["naive"], peak["FSDP RAM-efficient"], peak["ZeRO-3 init"]
naive_ok = (naive > 0.9 * full_MiB).all()
claim("naive: every rank peaks near or above the whole model (over 90% of its fp32 size)", naive_ok,
      peak_MiB=naive.round(0).tolist(), model_MiB=full_MiB)
ram_ok = ram.drop(0).max() < BOUND * naive.min()
claim(f"FSDP RAM-efficient: the other ranks peak far below naive (under {BOUND:.0%} of it)", ram_ok,
      others_MiB=ram.drop(0).round(0).tolist(), naive_MiB=naive.min())
host_shard = full_MiB / N if not nb.gpu_count() else 0  # a rank's fp32 shard in host memory (a GPU holds it there)
two = full_MiB / 2 + host_shard  # the whole state dict in bf16 + that shard (naive's whole fp32 model peaks higher)
rank0_ok = 0.9 * two < ram[0] < 1.05 * two and ram[0] > 1.3 * ram.drop(0).max()
claim("FSDP RAM-efficient: rank 0 peaks at the whole bf16 state dict plus its host fp32 shard (90% to 105% of the "
      "two, below naive's peak), well above the others (over 1.3x); at 2 ranks those bytes equal a whole fp32 copy's, "
      "so the bytes alone cannot tell which rank 0 held (the mechanism is the fact above)", rank0_ok and ram[0] < naive.min(),
      rank0_MiB=ram[0], two_MiB=two, naive_MiB=naive.min(), others_max_MiB=ram.drop(0).max())
if SIZE == "full":  # medium: the state dict dwarfs the process; quick's small model leaves more of it to the libraries
    claim("FSDP RAM-efficient: its ranks keep fp32 shards, and rank 0 saves little (its peak over 80% of naive's): the "
          "saving is on the other ranks", dt["FSDP RAM-efficient"]["stored_param"] == "fp32"
          and ram[0] > 0.8 * naive.min(), stored=dt["FSDP RAM-efficient"]["stored_param"],
          rank0_share_of_naive=ram[0] / naive.min())
zero_ok = zero.max() < ZBOUND * naive.min()
claim(f"ZeRO-3 init: every rank, rank 0 included, peaks well below naive (under {ZBOUND:.0%} of it)" + (
      "" if nb.gpu_count() else ", and above the whole model in bf16: the peaks cannot rule out a rank holding it"),
      zero_ok and (nb.gpu_count() or zero.min() > full_MiB / 2), peak_MiB=zero.round(0).tolist(),
      naive_MiB=naive.min(), whole_bf16_MiB=full_MiB / 2)
file_MiB = os.path.getsize(f"{PRETRAINED}/model.safetensors") / 2**20
for label in ("FSDP RAM-efficient", "ZeRO-3 init"):
    pages = table[table.method == label].set_index("rank").peak_file_MiB
    # a 2 ms sampler can miss the last tensors' pages on a busy box (seen in CI at quick size: 75.3 of 79.5 MiB)
    claim(f"{label}: only rank 0's file-backed memory (RssFile) grows by most of the file's size (over 80% of it); "
          "the others' by under a tenth of rank 0's", pages[0] > 0.8 * file_MiB and pages.drop(0).max() < 0.1 * pages[0],
          rank0_MiB=round(pages[0], 1), file_MiB=round(file_MiB, 1), others_MiB=pages.drop(0).round(1).tolist())

# %% [markdown]
# ## The rotary-buffer trap
#
# Meta-device init creates no memory; `to_empty()` then allocates *uninitialised* memory
# for every parameter and buffer, and the state dict fills the parameters. <!-- fact: torch.to_empty_uninitialised -->
# But RoPE's `inv_freq` is a **non-persistent** buffer: it is computed in `__init__` and never
# saved, so no checkpoint restores it. <!-- fact: transformers.rope_buffers_non_persistent --> After `to_empty()` it holds whatever bytes were there:
# nothing raises an error (the cell below runs on), and the model would compute its positions from those bytes (no forward pass runs here). `helpers.job.loading.fix_rotary` rebuilds
# such buffers from the config. See it on a tiny model:

# %%
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from helpers.core.models import model_config, resolve_model  # noqa: E402

facts.show("transformers.rope_buffers_non_persistent")
cfg = model_config(resolve_model("tiny"))
fresh = AutoModelForCausalLM.from_config(cfg).model.rotary_emb
good = fresh.inv_freq
meta = loading.meta_model(resolve_model("tiny"), torch.float32)
print("persistent?", "model.rotary_emb.inv_freq" in meta.state_dict())
meta.to_empty(device="cpu")
rotary = meta.model.rotary_emb
print("after to_empty:", rotary.inv_freq[:4], " correct:", good[:4])
claim("after to_empty, inv_freq no longer holds the computed values",
      not torch.equal(rotary.inv_freq, good), differing=int((rotary.inv_freq != good).sum()), of=good.numel())
fixed = loading.fix_rotary(meta, "cpu")
print("after fix_rotary:", rotary.inv_freq[:4])
claim("inv_freq is in no state dict, so no checkpoint can restore it",  # fact: transformers.rope_buffers_non_persistent
      not any("inv_freq" in k for k in meta.state_dict()), state_dict_keys=len(meta.state_dict()))
buffers = dict(fresh.named_buffers())
claim("fix_rotary rebuilt the one rotary module's buffers, each equal to a freshly built model's", fixed == 1
      and all(torch.equal(b, buffers[n]) for n, b in rotary.named_buffers()), buffers=sorted(buffers))

# %% [markdown]
# ## Recap

# %%
for label in NAMES.values():
    s = table[table.method == label]
    print(f"{label:20s} rank 0 peak {s.peak_anon_MiB.iloc[0]:7.0f} MiB, other ranks max "
          f"{s[s['rank'] > 0].peak_anon_MiB.max():7.0f} MiB, load {s.seconds.max():5.1f} s")
claim("naive loading cost every rank the whole model (the measured window ends after sharding)", naive_ok,
      peak_MiB=naive.round(0).tolist(), model_MiB=full_MiB)
claim("FSDP's RAM-efficient loading (meta init, rank-0 read, broadcast) kept the other ranks far below naive; "
      "its rank 0 still peaked near the whole state dict plus its shard (by design it holds both)", ram_ok and rank0_ok,
      peak_MiB=ram.round(0).tolist(), two_MiB=two, naive_MiB=naive.min())  # fact: torch.broadcast_from_rank0_per_tensor
claim("with ZeRO-3 init (partition on creation) every rank, rank 0 included, peaked well below naive (whether a rank "
      "ever held the whole bf16 model, the peaks cannot show)", zero_ok, peak_MiB=zero.round(0).tolist(),
      naive_MiB=naive.min())  # fact: deepspeed.zero_init_partitions_on_creation
claim("weights loaded every way equal the file's, value by value on every rank (rounded to the load dtype)", match_ok,
      jobs=len(runs))

# %% [markdown]
# Meta init needs the non-persistent buffers (RoPE `inv_freq`) recomputed: they are in no state dict. <!-- fact: transformers.rope_buffers_non_persistent -->
#
# Next: `06_checkpointing` (after the optional panel below).

# %% [markdown]
# ## Optional: try other settings
#
# Nothing below is part of the story above, and nothing runs until you click **Run**. The
# panel's defaults are this notebook's own command (one step of `$PRETRAINED` at 2 ranks); it launches the selected configs
# into its own run directories (`notebooks/runs/panel_05_*`) and redraws each run's peak memory
# while loading, per rank. Try 4 ranks, or ZeRO-3 init against naive loading.

# %%
from helpers.nb import widgets

widgets.ControlPanel("05", {"naive": "launch_configs/fsdp/full_shard.yaml",
                            "RAM-efficient": "launch_configs/fsdp/full_shard_ram_efficient.yaml",
                            "ZeRO-3 init": "launch_configs/deepspeed/zero3_init.yaml"},
                     args="--model $PRETRAINED --steps 1 --micro-batch 1 --seq-len 8", plot=widgets.plot_loading,
                     ranks=2)
