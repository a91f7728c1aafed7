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
# # 09 · Fine-tuning with LoRA: a frozen base under each backend
#
# **The question.** When only a LoRA adapter trains, what does each backend still hold per
# rank for the frozen base? Does the adapter come back out whole? And do the two backends still
# train alike?
#
# **What we run.** Real jobs with `--peft launch_configs/peft/lora.json`. This is rank-8 LoRA on the
# attention output and MLP down projections (`o_proj`, `down_proj`; the file also names GPT-2's
# `c_proj`, which matches nothing in this Llama: each job's log line lists what was adapted). The job
# injects it with PEFT, which freezes everything else <!-- fact: peft.adapter_dtype -->. Both
# backends hand only the adapter to the optimizer. Details: [docs/finetuning.md](../docs/finetuning.md).

# %%
import json
import os

import pandas as pd

from helpers import estimate as est
from helpers import facts, nb
from helpers.compare import compare
from helpers.nb import plots, results
from helpers.nb.claims import claim

SIZE = nb.setup()  # "quick" under `make test`: the tiny model, 2 ranks
MODEL, WORLDS = ("tiny", [2]) if SIZE == "quick" else ("small", [1, 2, 4])
WORLDS = nb.world_sizes(WORLDS)
CONFIGS = {"full_shard": "fsdp/full_shard", "zero2": "deepspeed/zero2", "zero3": "deepspeed/zero3"}
LORA = "launch_configs/peft/lora.json"
os.environ.update(MODEL=MODEL, WORLDS=" ".join(map(str, WORLDS)), LORA=LORA, CONFIGS=" ".join(CONFIGS.values()))
print(f"size={SIZE}: {MODEL} at {WORLDS} ranks;", json.load(open(LORA)))

# %% [markdown]
# ## What each rank holds
#
# Three configs at each rank count, 2 steps each. Every job splits its state into a trainable
# part and a frozen part (`memory_split_bytes` in `summary.json`), and measures its peak.

# %% language="bash"
# for N in $WORLDS; do
#   for CFG in $CONFIGS; do
#     torchrun --standalone --nproc_per_node $N -m helpers.train --config launch_configs/$CFG.yaml \
#       --out notebooks/runs/09_$(basename $CFG)_$N --model $MODEL --steps 2 --micro-batch 2 --seq-len 64 \
#       --peft $LORA | grep -E "^peft|^audit"
#   done
# done

# %%
rows = []
for n in WORLDS:
    for name, cfg in CONFIGS.items():
        run = results.load_run(f"notebooks/runs/09_{name}_{n}")
        s = run.summary
        e = est.run(est.parse_args(["--config", f"launch_configs/{cfg}.yaml", "--model", MODEL, "--world-size",
                                    str(n), "--micro-batch", "2", "--seq-len", "64", "--peft", LORA]))
        split, state = s["memory_split_bytes"][0], s["memory_bytes"][0]  # rank 0
        rows.append(dict(config=name, backend=s["backend"], ranks=n,
                         frozen_weights_MiB=split["frozen"]["params"] / 2**20,
                         frozen_same_on_ranks=len({r["frozen"]["params"] for r in s["memory_split_bytes"]}) == 1,
                         adapter_state_KiB=sum(split["trainable"].values()) / 2**10,
                         grads_opt_master_B=state["grads"] + state["optimizer_states"] + state["master_params"],
                         peak_MiB=s["peak_tensor_bytes"][0] / 2**20,
                         predicted_MiB=e["peak_bytes_per_rank"][0] / 2**20,
                         bucket_MiB=e["categories_per_rank"][0]["comm_buckets"] / 2**20,
                         state_exact=s["memory_bytes"] == [{k: c[k] for k in state} for c in e["categories_per_rank"]],
                         zero3_extra_MiB=(state["params"] - e["categories_per_rank"][0]["params"]) / 2**20))
table = pd.DataFrame(rows)
frozen_numel, trainable_numel = s["peft"]["frozen_params"], s["peft"]["trainable_params"]
print(f"{MODEL}: {trainable_numel:,} trainable, {frozen_numel:,} frozen parameters "
      f"({frozen_numel * 2 / 2**20:.1f} MiB in bf16)")
table.round(2)

# %%
fig, ax = plots.plt.subplots()
for name in CONFIGS:
    sub = table[table.config == name]
    ax.plot(sub.ranks, sub.frozen_weights_MiB, marker="o", label=name,
            color=plots.COLORS[sub.backend.iloc[0]], ls="--" if name == "zero2" else "-")
ax.set(xlabel="ranks", ylabel="frozen weights on rank 0 (MiB)", xticks=WORLDS, ylim=(0, None),
       title="what a rank holds of the frozen base")
ax.legend();

# %% [markdown]
# **What it means.** A frozen parameter keeps only its weight: no gradient, no Adam moments,
# no fp32 master. FSDP and ZeRO-3 shard that weight like any other, so it shrinks as ranks are
# added. ZeRO-2 keeps it whole on every rank, in bf16: its flat buffers hold only what the
# optimizer steps, so a frozen parameter stays a plain module parameter (ZeRO-1 does the same;
# `tests/test_lora.py` measures it). FSDP keeps the frozen weight in bf16: the job applies
# Accelerate's rule, which upcasts only trainable parameters
# <!-- fact: accelerate.fsdp2_upcasts_trainable_only -->. The adapter's own state (weights,
# gradients, Adam moments, master) is a small part of what a rank holds. It differs by config at
# N > 1: ZeRO-2 keeps the adapter's bf16 weights whole on every rank, and ZeRO-3 keeps its small
# parameters (here the norms and the whole adapter) whole next to their partition
# <!-- fact: deepspeed.zero3_persistent_keep_partition -->.

# %%
facts.show("accelerate.fsdp2_upcasts_trainable_only")
# for the adapter alone, gradient + Adam moments + master are at most 4 + 8 + 4 bytes per adapter element, over N
# ranks, plus Adam's 4-byte step counters; any state for a frozen tensor (even a 512-element norm) would pass that
n_tensors = 2 * sum(s["peft"]["adapted"].values())  # lora_A and lora_B per adapted module
bound = 16 * trainable_numel / table.ranks + 4 * n_tensors
claim("no job holds a gradient, an optimizer state or a master copy for a frozen parameter: on rank 0 the three "
      "together stay within 16 bytes per adapter element over N ranks (plus step counters)",
      (table.grads_opt_master_B <= bound).all(), measured_B=table.grads_opt_master_B.tolist(),
      bound_B=bound.astype(int).tolist())
z2, fs, z3 = (table[table.config == c].set_index("ranks").frozen_weights_MiB for c in ("zero2", "full_shard", "zero3"))
whole = frozen_numel * 2 / 2**20
claim("ZeRO-2 holds the whole frozen base in bf16 on every rank, at every rank count",
      all(abs(v - whole) < 1e-9 for v in z2) and table[table.config == "zero2"].frozen_same_on_ranks.all(),
      zero2_MiB=z2.round(2).tolist(), bf16_whole_MiB=round(whole, 2))
claim("FSDP holds a 1/N bf16 shard of it (within 1% for padding)",
      all(abs(fs[n] - whole / n) <= 0.01 * whole / n for n in WORLDS), fsdp_MiB=fs.round(2).tolist())
if len(WORLDS) > 1:
    claim("ZeRO-3 holds a 1/N bf16 share of it too (within 1%: its small parameters stay whole)",
          all(abs(z3[n] - whole / n) <= 0.01 * whole / n for n in WORLDS), zero3_MiB=z3.round(2).tolist())
print(f"trainable share of the parameters: {trainable_numel / (trainable_numel + frozen_numel):.2%}")
claim("the adapter's whole state is under a fifth of the frozen weights a rank holds, in every job",
      (table.adapter_state_KiB / 1024 < 0.2 * table.frozen_weights_MiB).all(),
      adapter_KiB=table.adapter_state_KiB.round(1).tolist())
exact = table[table.config != "zero3"]
claim("FSDP's and ZeRO-2's state on every rank equals the estimator's, to the byte", exact.state_exact.all(),
      exact=exact.state_exact.tolist())
print("ZeRO-3 at N > 1 holds a little more than the estimator counts: the partitions of the small parameters it also "
      "keeps whole (MiB):", table[table.config == "zero3"].set_index("ranks").zero3_extra_MiB.round(3).to_dict())

# %% [markdown]
# ## Will it fit? The estimator against these jobs
#
# `python -m helpers.estimate ... --peft FILE` counts the adapter's state and the frozen weights.
# A frozen base also keeps fewer activations: a frozen layer's input is not needed for a weight
# gradient. The estimator traces the forward with fake tensors (which compute nothing), with and
# without the adapter, and scales its activation formula by the ratio.
#
# Here DeepSpeed's peaks sit near 1 GB: a fixed gradient bucket of `reduce_bucket_size` elements in
# bf16 (DeepSpeed's default; these JSONs leave it unset) is allocated whole, on top of what the
# model needs (the estimator's `comm_buckets`, printed as `bucket_MiB`). For a model this small it
# is most of the peak, so every row is also scored without it (`error_wo_bucket`).
#
# Identical jobs can measure different CPU peaks. A job more than 10% off is run once more, and
# the smaller of its two peaks counts, as in `tests/test_estimate.py`. The cell prints both.

# %%
import subprocess  # noqa: E402


def peak_again(name: str, n: int) -> float:
    out = f"notebooks/runs/09_{name}_{n}_again"
    subprocess.run(["torchrun", "--standalone", f"--nproc_per_node={n}", "-m", "helpers.train", "--config",
                    f"launch_configs/{CONFIGS[name]}.yaml", "--out", out, "--model", MODEL, "--steps", "2",
                    "--micro-batch", "2", "--seq-len", "64", "--peft", LORA], check=True, capture_output=True)
    return results.load_run(out).summary["peak_tensor_bytes"][0] / 2**20


over = (table.predicted_MiB / table.peak_MiB - 1).abs() > 0.10
table["peak_again_MiB"] = [peak_again(r.config, r.ranks) if o else None for r, o in zip(table.itertuples(), over)]
measured = table[["peak_MiB", "peak_again_MiB"]].min(axis=1)
table["error"] = table.predicted_MiB / measured - 1
table["error_wo_bucket"] = (table.predicted_MiB - measured) / (measured - table.bucket_MiB)
print(table[["config", "ranks", "peak_MiB", "peak_again_MiB", "predicted_MiB", "bucket_MiB", "error",
             "error_wo_bucket"]].round(3).to_string(index=False))
claim("the estimator predicts every job's peak within 10%", (table.error.abs() <= 0.10).all(),
      worst=table.error.abs().max(), jobs_run_twice=int(over.sum()))
wo = table.groupby("config").error_wo_bucket.apply(lambda e: e.abs().max())
claim("without the bucket, FSDP and ZeRO-2 stay within 10%, ZeRO-3 within 20% (it misses the partitions above)",
      wo["full_shard"] <= 0.10 and wo["zero2"] <= 0.10 and wo["zero3"] <= 0.20, worst_wo_bucket=wo.round(3).to_dict())

# %% [markdown]
# ZeRO-3's peak rises from one rank to two: across ranks it gathers the model ahead of each
# forward, and the all-gather's buffers and their concatenated copy are alive together, two
# bf16 copies of the model (`benchmarks/peak_alive.py` shows them). On one rank a parameter is its
# own partition, and nothing is gathered.
#
# ## Saving the adapter, and the ZeRO-3 trap
#
# `PeftModel.save_pretrained` writes the tensors that the calling process holds. It gathers
# nothing for FSDP or ZeRO-3; it warns about empty tensors, and writes them anyway
# <!-- fact: peft.save_reads_module_tensors -->. Under ZeRO-3, a partitioned parameter is an
# empty placeholder. How many are partitioned depends on `stage3_param_persistence_threshold`:
# ZeRO-3 keeps parameters of at most that many elements whole on every rank
# <!-- fact: deepspeed.zero3_persistent_keep_partition -->.
#
# Three 2-rank jobs save a checkpoint at step 2. Each checkpoint holds the guide's `adapter/`,
# gathered in fp32, and `adapter_naive/`, what a plain `save_pretrained` on rank 0 writes (imitated:
# PEFT's state dict of the module as rank 0 holds it, handed to safetensors). The jobs are
# `zero3.yaml` (DeepSpeed's default threshold, 100,000 elements), `zero3_no_prefetch.yaml`
# (threshold 0; of its other settings none changes what is partitioned) and FSDP.

# %% language="bash"
# for CFG in fsdp/full_shard deepspeed/zero3 deepspeed/zero3_no_prefetch; do
#   NAME=$(basename $CFG)
#   torchrun --standalone --nproc_per_node 2 -m helpers.train --config launch_configs/$CFG.yaml \
#     --out notebooks/runs/09_save_$NAME --model $MODEL --steps 3 --micro-batch 2 --seq-len 64 --peft $LORA \
#     --checkpoint-dir notebooks/runs/09_ckpt_$NAME --checkpoint-every 2 --save-naive-adapter --trace-tensors \
#     | grep saved
# done
# # the check, from the command line: PEFT loads each saved adapter on a plain base model (exit 1: it cannot)
# python -m helpers.adapter notebooks/runs/09_ckpt_zero3_no_prefetch/step_2
# python -m helpers.adapter notebooks/runs/09_ckpt_zero3_no_prefetch/step_2 --adapter adapter_naive || true

# %%
from helpers.adapter import adapter_loss  # noqa: E402
from helpers.job.checkpoint import read_meta  # noqa: E402

saves = []
for name in ("full_shard", "zero3", "zero3_no_prefetch"):
    ckpt = f"notebooks/runs/09_ckpt_{name}/step_2"
    meta, job_loss = read_meta(ckpt), results.load_run(f"notebooks/runs/09_save_{name}").metrics.loss[2]
    for kind in ("adapter", "adapter_naive"):
        failed = meta[kind].get("error")  # the plain save itself failed: nothing to load
        r = {"loaded": False, "loss": None} if failed else adapter_loss(ckpt, kind)
        saves.append(dict(config=name, saved=kind, tensors=meta[kind]["tensors"], numel=meta[kind]["numel"],
                          empty_tensors=meta[kind]["empty"], save_error=failed, peft_loads=r["loaded"],
                          loss_vs_job=None if r["loss"] is None else r["loss"] - job_loss))
saves = pd.DataFrame(saves)
saves

# %%
guide, naive = saves[saves.saved == "adapter"], saves[saves.saved == "adapter_naive"].set_index("config")
claim("the guide's adapter is complete under every backend, PEFT loads it, and it gives the job's step-2 loss "
      "(within 1e-6)", (guide.empty_tensors == 0).all() and guide.peft_loads.all()
      and (guide.loss_vs_job.abs() < 1e-6).all(), loss_diff=guide.loss_vs_job.tolist())
claim("with threshold 0 a naive ZeRO-3 save writes every name and no values, and PEFT cannot load it",
      naive.loc["zero3_no_prefetch", "numel"] == 0 and not naive.loc["zero3_no_prefetch", "peft_loads"],
      numel=naive.loc["zero3_no_prefetch", "numel"])
claim("with DeepSpeed's default threshold this small adapter is kept whole, and the naive save happens to work",
      naive.loc["zero3", "empty_tensors"] == 0 and naive.loc["zero3", "peft_loads"],
      numel=naive.loc["zero3", "numel"])
fs_naive = read_meta("notebooks/runs/09_ckpt_full_shard/step_2")["adapter_naive"]
claim("under FSDP2 the default (safetensors) save fails: every value of the state dict is a DTensor holding rank 0's "
      "shard, and nothing is written", bool(fs_naive["error"]) and fs_naive["dtensors"] == fs_naive["tensors"] > 0
      and naive.loc["full_shard", "numel"] < guide.set_index("config").loc["full_shard", "numel"]
      and not os.path.exists("notebooks/runs/09_ckpt_full_shard/step_2/adapter_naive/adapter_model.safetensors"),
      error=fs_naive["error"], dtensors=fs_naive["dtensors"])

# %% [markdown]
# (For FSDP the table's `tensors` and `numel` describe rank 0's state dict in memory: no file was
# written.)
#
# **What it means.** A plain save is only safe when every adapter parameter sits whole on rank 0.
# With Accelerate's `auto` threshold a real model breaks that. Accelerate fills `auto` with 10 × the hidden size
# <!-- fact: accelerate.ds_auto_persistence_threshold -->. The cell below does that arithmetic for
# this notebook's adapter on a model of Llama-2-7B's widths (hidden 4,096, MLP 11,008). Gather
# first, as the guide does.

# %%
facts.show("accelerate.ds_auto_persistence_threshold")
hidden, mlp, rank = 4096, 11008, json.load(open(LORA))["r"]
auto = 10 * hidden
for mod, (n_in, n_out) in {"o_proj": (hidden, hidden), "down_proj": (mlp, hidden)}.items():
    for part, numel in (("lora_A", rank * n_in), ("lora_B", n_out * rank)):
        print(f"{mod}.{part}: {numel:,} elements: {'partitioned (a plain save writes it empty)' if numel > auto else 'whole'}"
              f" under auto = {auto:,}")

# %% [markdown]
# ## Do the two backends still train alike?
#
# The FSDP and ZeRO-3 runs above are the aligned pair: `fsdp/full_shard.yaml` and
# `deepspeed/zero3.yaml`, the two configs this guide keeps bit for bit alike for full training. A
# second pair targets `q_proj` and `v_proj` (`lora_qv.json`).

# %% language="bash"
# for CFG in fsdp/full_shard deepspeed/zero3; do
#   torchrun --standalone --nproc_per_node 2 -m helpers.train --config launch_configs/$CFG.yaml \
#     --out notebooks/runs/09_qv_$(basename $CFG) --model $MODEL --steps 3 --micro-batch 2 --seq-len 64 \
#     --peft launch_configs/peft/lora_qv.json --trace-tensors | grep done
# done

# %%
from helpers.compare import differing  # noqa: E402
from helpers.core.models import model_config, resolve_model  # noqa: E402

same = compare("notebooks/runs/09_save_full_shard", "notebooks/runs/09_save_zero3")
qv_layers = model_config(resolve_model(MODEL)).num_hidden_layers
qv = compare("notebooks/runs/09_qv_full_shard", "notebooks/runs/09_qv_zero3")
print(same.report(), "\n", qv.report(), sep="")
norms = qv.values["grad_norm"] if qv.values else (0.0, 0.0)
print(f"q/v pair at step {qv.first_step}: losses equal, gradient norms {norms[0]:.7f} vs {norms[1]:.7f} "
      f"(relative difference {abs(norms[0] - norms[1]) / norms[0]:.1e})")
if nb.bitwise_parity_expected(2):
    claim("LoRA on o_proj/down_proj: the aligned pair is identical for 3 steps, every adapter weight, gradient and "
          "update (the frozen weights have no gradient and are not traced)",
          same.identical and same.tensor is None and all(same.traced), untraced=same.untraced)
    parted = differing(qv.a, qv.b, 1, "grad_local")
    last = f".layers.{qv_layers - 1}."
    claim("LoRA on q_proj/v_proj parts at step 1, in the local gradients of the q/v adapters of every layer but the "
          "last; the last layer's agree",
          not qv.identical and qv.tensor.step == 1 and qv.tensor.stage == "grad_local" and parted
          and all(last not in n and ("q_proj" in n or "v_proj" in n) for n in parted)
          and {n.split(".layers.")[1].split(".")[0] for n in parted} == {str(i) for i in range(qv_layers - 1)},
          parted=len(parted), layers=qv_layers)

# %% [markdown]
# **What it means.** At step 0 the adapter's B matrix is zero, so what the adapter adds to the
# gradient of its input is exactly zero, and adding zero in any order changes nothing. From step 1
# it is not zero. `q_proj`, `k_proj` and `v_proj` read the same input, so autograd adds up several
# bf16 gradients for it. ZeRO-3 passes every module's inputs through an autograd function of its
# own <!-- fact: deepspeed.zero3_module_io_autograd_functions -->. That groups `q_proj`'s two
# gradients (base and adapter) into one sum before the others join. FSDP, which hooks whole units,
# adds all of them in one buffer. In bf16, a sum taken in another order rounds differently. That sum
# is the gradient flowing into the layers below, which is why the last layer's adapters still agree
# and every layer under it parts. An adapter whose input no other module reads, such as `o_proj` or
# `down_proj`, gets just two gradients there (base and adapter), and a sum of two is the same in
# either order: the pair stays bit for bit.
#
# ## Recap
#
# - A frozen parameter costs only its weight. FSDP and ZeRO-3 shard it; ZeRO-2 (and ZeRO-1) keep it
#   whole on every rank.
# - The estimator takes the LoRA config and predicted these peaks within 10% (without DeepSpeed's
#   fixed gradient bucket: FSDP and ZeRO-2 within 10%, ZeRO-3 within 20%).
# - Save the adapter gathered. A plain save under ZeRO-3 can be empty, depending on
#   `stage3_param_persistence_threshold`, a config setting (Accelerate's `auto` is 10 × hidden), not
#   on your save code. Under FSDP2 the default (safetensors) save fails.
# - On this CPU, for 3 steps at 2 ranks, the aligned pair trained this LoRA bit for bit. Adapters on
#   inputs that other modules also read part from step 1, by a small amount (printed above); the
#   layer pattern fits ZeRO-3's per-module functions changing the order of a bf16 sum.
