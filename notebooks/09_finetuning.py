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
# **What we run.** Real jobs at 2 ranks with `--peft launch_configs/peft/lora.json`: rank-8 LoRA
# on the attention output and MLP down projections (`o_proj`, `down_proj`; the file also names
# GPT-2's `c_proj`, which matches nothing in this Llama: each job's log line lists what was
# adapted). The job injects it with PEFT, which freezes everything else <!-- fact: peft.adapter_dtype -->.
# Both backends hand only the adapter to the optimizer. Details: [docs/finetuning.md](../docs/finetuning.md).

# %%
import json
import math
import os

import pandas as pd
from safetensors import safe_open

from helpers import estimate as est
from helpers import facts, nb
from helpers.compare import compare
from helpers.core.models import model_config, resolve_model
from helpers.job.checkpoint import read_meta
from helpers.nb import plots, results
from helpers.nb.claims import claim, ran

SIZE = nb.setup()  # "quick" under `make test`: the tiny model
MODEL = "tiny" if SIZE == "quick" else "small"
N = 2  # ranks: one per core here; on a GPU node one per GPU (nccl)
assert nb.world_sizes([N]), f"this notebook needs {N} ranks; this node has {nb.gpu_count()} GPU(s)"
CONFIGS = {"full_shard": "fsdp/full_shard", "zero2": "deepspeed/zero2", "zero3": "deepspeed/zero3"}
LORA = "launch_configs/peft/lora.json"
os.environ.update(MODEL=MODEL, N=str(N), LORA=LORA, CONFIGS=" ".join(CONFIGS.values()))
print(f"size={SIZE}: {MODEL} at {N} ranks;", json.load(open(LORA)))

# %% [markdown]
# ## What each rank holds
#
# Three configs, 3 steps each. Every job splits its state into a trainable part and a frozen
# part (`memory_split_bytes` in `summary.json`) and measures its peak. Each also saves a
# checkpoint at step 2, and the FSDP and ZeRO-3 jobs trace their tensors (the tracer reads
# FSDP or ZeRO-3 shards only), for the sections below.

# %% language="bash"
# set -o pipefail
# for CFG in $CONFIGS; do
#   NAME=$(basename $CFG)
#   TRACE=--trace-tensors; [ $NAME = zero2 ] && TRACE=
#   torchrun --standalone --nproc_per_node $N -m helpers.train --config launch_configs/$CFG.yaml \
#     --out notebooks/runs/09_$NAME --model $MODEL --steps 3 --micro-batch 2 --seq-len 64 --peft $LORA \
#     --checkpoint-dir notebooks/runs/09_ckpt_$NAME --checkpoint-every 2 --save-naive-adapter $TRACE \
#     | grep -E "^peft|^audit|^saved"
# done

# %%
rows, runs = [], {name: results.load_run(f"notebooks/runs/09_{name}") for name in CONFIGS}
for name, cfg in CONFIGS.items():
    s = runs[name].summary
    e = est.run(est.parse_args(["--config", f"launch_configs/{cfg}.yaml", "--model", MODEL, "--world-size",
                                str(N), "--micro-batch", "2", "--seq-len", "64", "--peft", LORA]))
    split, state = s["memory_split_bytes"][0], s["memory_bytes"][0]  # rank 0
    rows.append(dict(config=name, backend=s["backend"],
                     frozen_weights_MiB=split["frozen"]["params"] / 2**20,
                     frozen_same_on_ranks=len({r["frozen"]["params"] for r in s["memory_split_bytes"]}) == 1,
                     adapter_state_KiB=sum(split["trainable"].values()) / 2**10,
                     peak_MiB=s["peak_tensor_bytes"][0] / 2**20,
                     predicted_MiB=e["peak_bytes_per_rank"][0] / 2**20,
                     bucket_MiB=e["categories_per_rank"][0]["comm_buckets"] / 2**20,
                     state_exact=s["memory_bytes"] == [{k: c[k] for k in state} for c in e["categories_per_rank"]],
                     zero3_extra_MiB=(state["params"] - e["categories_per_rank"][0]["params"]) / 2**20))
table = pd.DataFrame(rows).set_index("config")
frozen_numel, trainable_numel = s["peft"]["frozen_params"], s["peft"]["trainable_params"]
whole = frozen_numel * 2 / 2**20  # the frozen base in bf16
print(f"{MODEL}: {trainable_numel:,} trainable, {frozen_numel:,} frozen parameters ({whole:.1f} MiB in bf16)")
ran(f"the three configs run 3 steps each at {N} ranks (micro-batch 2, 64 tokens)", runs.values(), model=MODEL, steps=3,
    world_size=N, micro_batch=2, seq_len=64)
layers, peft = model_config(resolve_model(MODEL)).num_hidden_layers, [r.summary["peft"] for r in runs.values()]
shapes = read_meta("notebooks/runs/09_ckpt_zero3/step_2")["param_shapes"]  # every parameter's full shape
lora_numel = sum(math.prod(shape) for n, shape in shapes.items() if "lora_" in n)
claim("each job put a rank-8 LoRA on o_proj and down_proj of every layer (c_proj, also named, matched nothing) and "
      "trains only it: its trainable elements are the adapter's, all else is frozen",
      all(p["config"]["r"] == 8 and "c_proj" in p["config"]["target_modules"] and p["trainable_params"] == lora_numel
          and p["adapted"] == {"o_proj": layers, "down_proj": layers} for p in peft)
      and all(r.summary["audit"]["trainable_numel"] == lora_numel for r in runs.values()),
      adapted=peft[0]["adapted"], trainable=lora_numel)
split = {n: r.summary["memory_split_bytes"] for n, r in runs.items()}  # per rank: trainable and frozen parts
claim("each job split every rank's state into a trainable and a frozen part that add up to its total, saved a "
      "checkpoint at step 2, and FSDP and ZeRO-3 (not ZeRO-2) traced their tensors",
      all({c: sp["trainable"][c] + sp["frozen"][c] for c in m} == m for r in runs.values()
          for sp, m in zip(r.summary["memory_split_bytes"], r.summary["memory_bytes"], strict=True))
      and all([c["step"] for c in r.summary["checkpoints"]] == [2] for r in runs.values())
      and [(r.path / "tensor_trace.jsonl").is_file() for r in runs.values()] == [True, False, True])
table.round(2)

# %%
fig, ax = plots.plt.subplots()
ax.bar(table.index, table.frozen_weights_MiB, color=[plots.COLORS[b] for b in table.backend],
       hatch=["//" if c == "zero2" else None for c in table.index], edgecolor="white")
ax.axhline(whole, color="k", ls="--", lw=1, label="whole frozen base (bf16)")
ax.axhline(whole / N, color="k", ls=":", lw=1, label=f"1/{N} of it")
ax.set(ylabel="frozen weights on rank 0 (MiB)", ylim=(0, 1.35 * whole),
       title=f"what a rank holds of the frozen base, {N} ranks")
ax.legend(loc="upper right", ncol=2);

# %% [markdown]
# **What it means.** A frozen parameter keeps only its weight: no gradient, no Adam moments,
# no fp32 master. FSDP shards that weight like any other (each rank holds 1/N of it), and so does
# ZeRO-3, which also keeps whole copies of the small parameters next to their 1/N (below).
# ZeRO-2 keeps it whole on every rank, in bf16: by design its flat buffers hold only what the optimizer
# steps, <!-- fact: deepspeed.zero12_flat_buffer_per_group --> so a frozen parameter stays a plain module parameter (ZeRO-1 too, not run here:
# `tests/test_lora.py`). FSDP keeps the frozen weight in bf16: the job applies
# Accelerate's rule, which upcasts only trainable parameters
# <!-- fact: accelerate.fsdp2_upcasts_trainable_only -->. The adapter's own state (weights,
# gradients, Adam moments, DeepSpeed's master) is a small part of what a rank holds. It differs by config:
# ZeRO-2 keeps the adapter's bf16 weights whole on every rank, and ZeRO-3 keeps its small
# parameters (the adapter's among them) whole next to their partition
# <!-- fact: deepspeed.zero3_persistent_keep_partition -->.

# %%
facts.show("accelerate.fsdp2_upcasts_trainable_only")
frozen_state = {n: sum(sp["frozen"][c] for sp in spl for c in ("grads", "optimizer_states", "master_params"))
                for n, spl in split.items()}  # all ranks
weight_only = all(b == 0 for b in frozen_state.values()) and all(
    sp["trainable"]["grads"] > 0 and sp["trainable"]["optimizer_states"] > 0 for spl in split.values() for sp in spl)
claim("a frozen parameter keeps only its weight: on every rank of every job its gradient, Adam moments and master "
      "take 0 bytes; the adapter's gradients and Adam moments do not (it alone reaches the optimizer)", weight_only,
      frozen_grads_opt_master_B=frozen_state)
z2, z3 = table.frozen_weights_MiB[["zero2", "zero3"]]
weights = {part: {n: {sp[part]["params"] for sp in spl} for n, spl in split.items()}  # the set over ranks
           for part in ("frozen", "trainable")}
placed = {"zero2": {2 * frozen_numel}, "full_shard": {2 * frozen_numel // N}}  # filled in for ZeRO-3 below
claim("ZeRO-2 holds the whole frozen base in bf16 on every rank, to the byte",
      weights["frozen"]["zero2"] == placed["zero2"], zero2_B=weights["frozen"]["zero2"], bf16_whole_B=2 * frozen_numel)
claim("FSDP holds a 1/N bf16 shard of it (not upcast), to the byte",
      weights["frozen"]["full_shard"] == placed["full_shard"],
      fsdp_B=weights["frozen"]["full_shard"], bf16_one_Nth_B=2 * frozen_numel // N)
# ZeRO-3's small parameters: at most DeepSpeed's default stage3_param_persistence_threshold (100,000) elements
# fact: deepspeed.zero3_persistent_small_params
small = {n: math.prod(shape) for n, shape in shapes.items() if "lora_" not in n and math.prod(shape) <= 100_000}
placed["zero3"] = {2 * frozen_numel // N + 2 * sum(small.values())}
claim("ZeRO-3 holds a 1/N bf16 share of it too, plus its small frozen parameters whole, to the byte",
      weights["frozen"]["zero3"] == placed["zero3"], zero3_B=weights["frozen"]["zero3"],
      small_whole_B=2 * sum(small.values()), small=sorted({n.split(".")[-2] for n in small}))
n_lora = sum("lora_" in n for n in shapes)  # the adapter's tensors
kept_as = {n: r.summary["dtypes"]["stored_param"] for n, r in runs.items()}  # the job's probe: its first adapter matrix
held = {n: {b // {"fp32": 4, "bf16": 2}[kept_as[n]] for b in bs} for n, bs in weights["trainable"].items()}  # elements
claim("the adapter's weights differ by config: FSDP holds a 1/N fp32 shard, ZeRO-2 the whole bf16 adapter, ZeRO-3 "
      "the whole bf16 adapter next to its 1/N bf16 partition (elements held = bytes / the stored dtype's size)",
      kept_as == {"full_shard": "fp32", "zero2": "bf16", "zero3": "bf16"}
      and all("lora_" in r.summary["dtypes"]["param"] for r in runs.values())
      and runs["full_shard"].summary["audit"]["dtypes"].get("float32") == n_lora
      and held == {"full_shard": {trainable_numel // N}, "zero2": {trainable_numel},
                   "zero3": {trainable_numel + trainable_numel // N}},
      stored_dtype=kept_as, elements_held=held, adapter_elements=trainable_numel,
      fsdp_fp32_tensors=runs["full_shard"].summary["audit"]["dtypes"].get("float32"), adapter_tensors=n_lora)
print(f"trainable share of the parameters: {trainable_numel / (trainable_numel + frozen_numel):.2%}")
CATS = ("params", "grads", "optimizer_states", "master_params")
# seen: all exact but FSDP's Adam bytes, 4.001 (full) and 4.003 (quick) per element; share of the frozen weights
# at most 0.045 (full) and 0.14 (quick)
per_param = {n: [spl[0]["trainable"][c] / trainable_numel for c in CATS] for n, spl in split.items()}  # rank 0
want = {"full_shard": [4 / N, 4 / N, 8 / N, 0], "zero2": [2, 2 / N, 8 / N, 4 / N],  # bytes per adapter element
        "zero3": [2 + 2 / N, 2 / N, 8 / N, 4 / N]}
claim(f"per adapter parameter, rank 0 holds {sum(want['full_shard']):g} bytes of adapter state under FSDP, "
      f"{sum(want['zero2']):g} under ZeRO-2 and {sum(want['zero3']):g} under ZeRO-3: the weights above plus 1/N of the "
      "gradient (4 bytes under FSDP, 2 under DeepSpeed), of the Adam moments (8) and of DeepSpeed's fp32 master (4), "
      "each within 1%; under a fifth of the frozen weights it holds",
      all(abs(g - w) <= 0.01 * w if w else g == 0 for n in want for g, w in zip(per_param[n], want[n], strict=True))
      and (table.adapter_state_KiB / 1024 < 0.2 * table.frozen_weights_MiB).all(),
      bytes_per_adapter_param={n: [round(x, 3) for x in v] for n, v in per_param.items()}, order=list(CATS),
      share_of_frozen=(table.adapter_state_KiB / 1024 / table.frozen_weights_MiB).round(3).to_dict())
exact = table.state_exact[["full_shard", "zero2"]]
claim("FSDP's and ZeRO-2's state on every rank equals the estimator's, to the byte", exact.all(), exact=exact.tolist())
extra_B, partitions_B = round(table.zero3_extra_MiB["zero3"] * 2**20), 2 * (trainable_numel + sum(small.values())) // N
claim(f"ZeRO-3's rank 0 holds {extra_B / 2**20:.3f} MiB more params than the estimator counts: exactly the 1/N partitions of the small "
      "parameters it also keeps whole (the adapter's and the small frozen ones)", extra_B == partitions_B,
      extra_B=extra_B, partitions_B=partitions_B)

# %% [markdown]
# ## Will it fit? The estimator against these jobs
#
# `python -m helpers.estimate ... --peft FILE` counts the adapter's state and the frozen weights.
# A frozen base also keeps fewer activations: a frozen layer's input is not needed for a weight
# gradient (our reading; not measured here). The estimator traces the forward with fake tensors
# (which compute nothing), with and without the adapter, and scales its activation formula by the
# ratio (how it works; not checked here). Two of its terms come from listings of this setup (`helpers/estimate.py`).
#
# Here DeepSpeed's peaks sit near 1 GB: a fixed gradient bucket of `reduce_bucket_size` elements in
# bf16 (DeepSpeed's default; these JSONs leave it unset) <!-- fact: deepspeed.zero_bucket_defaults --> is allocated whole <!-- fact: deepspeed.zero3_bucket_allocated_whole -->, on top of what the
# model needs (the estimator's `comm_buckets`, printed as `bucket_MiB`). For a model this small it
# is most of the peak, so every row is also scored without it (`error_wo_bucket`).
#
# ZeRO-3 peaks above ZeRO-2, though it holds half as much of the frozen base. Our reading
# (a `benchmarks/peak_alive.py` listing, not run here; the size is checked below): ahead of each forward it
# gathers the model, and the all-gather's buffers and their concatenated copy are alive together.
#
# Identical jobs can measure different CPU peaks (not run twice here; `18_fit_details` shows it). A job more than 10% off
# is trained again (two steps, no saves), and the smaller of its two peaks counts (`tests/test_estimate.py` does the same at 2%). The next
# cells print both columns (`peak_again_MiB` stays empty when no job was that far off).

# %%
import subprocess  # noqa: E402


def peak_again(name: str) -> float:
    out = f"notebooks/runs/09_{name}_again"
    subprocess.run(["torchrun", "--standalone", f"--nproc_per_node={N}", "-m", "helpers.train", "--config",
                    f"launch_configs/{CONFIGS[name]}.yaml", "--out", out, "--model", MODEL, "--steps", "2",
                    "--micro-batch", "2", "--seq-len", "64", "--peft", LORA], check=True, capture_output=True)
    return results.load_run(out).summary["peak_tensor_bytes"][0] / 2**20


over = (table.predicted_MiB / table.peak_MiB - 1).abs() > 0.10
table["peak_again_MiB"] = [peak_again(name) if o else None for name, o in over.items()]

# %%
measured = table.filter(["peak_MiB", "peak_again_MiB"]).min(axis=1)  # (a dry run that skips the cell above: one peak)
table["error"] = table.predicted_MiB / measured - 1
table["error_wo_bucket"] = (table.predicted_MiB - measured) / (measured - table.bucket_MiB)
print(table.filter(["peak_MiB", "peak_again_MiB", "predicted_MiB", "bucket_MiB", "error", "error_wo_bucket"]).round(3))
ds = ["zero2", "zero3"]
# DeepSpeed's peak above FSDP's, over 5e8 x 2 bytes: within 7% of 1 over runs at either size (printed below)
above = {n: (measured[n] - measured["full_shard"]) / (5e8 * 2 / 2**20) for n in ds}
claim("DeepSpeed's peaks sit near 1 GB (0.95-1.2 GB), each above FSDP's by 5e8 elements of 2 bytes within 10% "
      "(DeepSpeed's default gradient bucket: these JSONs leave reduce_bucket_size unset)",
      all("reduce_bucket_size" not in runs[n].config["deepspeed"]["json"]["zero_optimization"] for n in ds)
      and all(0.95e9 <= measured[n] * 2**20 <= 1.2e9 and abs(above[n] - 1) < 0.10 for n in ds),
      peak_GB=(measured[ds] * 2**20 / 1e9).round(3).to_dict(), above_fsdp_over_5e8x2B=above)
print("the estimator's bucket_MiB (its default, 5e8 elements x 2 bytes):", table.bucket_MiB[ds].round(1).to_dict())
wo = table.error_wo_bucket.abs()
fits = {"with": (table.error.abs() <= 0.10).all(), "without": wo["full_shard"] <= 0.10 and wo["zero2"] <= 0.10
        and wo["zero3"] <= 0.20}
bucket_share = (table.bucket_MiB[ds] / measured[ds]).round(3).to_dict()
claim("the estimator predicts the peak of each job in the table within 10% (on DeepSpeed's rows over half of that peak "
      "is the bucket: the next line scores them without it)", fits["with"] and min(bucket_share.values()) > 0.5,
      bucket_share=bucket_share,
      error=table.error.round(4).to_dict(), jobs_run_twice=int(table.filter(["peak_again_MiB"]).notna().sum().sum()))
claim("without the bucket, FSDP and ZeRO-2 stay within 10%, ZeRO-3 within 20%", fits["without"],
      worst_wo_bucket=wo.round(3).to_dict())
# our reading: what lifts ZeRO-3's peak above ZeRO-2's, net of what it holds less of the frozen base, is memory in flight
model_MiB = (frozen_numel + trainable_numel) * 2 / 2**20
in_flight = measured["zero3"] - measured["zero2"] + (z2 - z3)
claim("ZeRO-3 peaks above ZeRO-2: the gap plus the frozen weights ZeRO-2 holds beyond ZeRO-3 is over one bf16 copy "
      "of the model", measured["zero3"] > measured["zero2"] and in_flight > model_MiB,
      zero3_MiB=measured["zero3"], zero2_MiB=measured["zero2"], in_flight_MiB=in_flight, model_bf16_MiB=model_MiB)
if SIZE == "full":  # checked at full size only (the quick size runs `tiny`: not checked there)
    claim("though ZeRO-3 holds half as much of the frozen base as ZeRO-2 (within 1%)", abs(z3 / z2 - 0.5) <= 0.005,
          ratio=z3 / z2)
    claim("that memory in flight is about two bf16 copies of the model (1.5x to 2.5x; in our reading, from a "
          "peak_alive.py listing not run here: the gathered buffers and their concatenated copy)",
          1.5 < in_flight / model_MiB < 2.5, copies=in_flight / model_MiB)

# %% [markdown]
# ## Saving the adapter, and the ZeRO-3 trap
#
# `PeftModel.save_pretrained` writes the tensors that the calling process holds. It gathers
# nothing for FSDP or ZeRO-3; given empty tensors, it warns and writes them anyway
# <!-- fact: peft.save_reads_module_tensors --> (under FSDP2 the imitated save fails instead and writes no file: below). Under ZeRO-3, a partitioned parameter is an
# empty placeholder. How many are partitioned depends on `stage3_param_persistence_threshold`:
# ZeRO-3 keeps parameters of at most that many elements whole on every rank
# <!-- fact: deepspeed.zero3_persistent_keep_partition -->.
#
# Each checkpoint holds the guide's `adapter/`, gathered in fp32, and `adapter_naive/`,
# what a plain `save_pretrained` on rank 0 writes (no file under FSDP, where it fails; imitated: PEFT's state dict of the module as
# rank 0 holds it, handed to safetensors). `zero3.yaml` keeps DeepSpeed's default threshold
# (100,000 elements). One more job runs `zero3_no_prefetch.yaml`: threshold 0 (our reading: none
# of its other settings changes what is partitioned). <!-- fact: deepspeed.zero3_persistence_threshold_zero -->

# %% language="bash"
# torchrun --standalone --nproc_per_node $N -m helpers.train --config launch_configs/deepspeed/zero3_no_prefetch.yaml \
#   --out notebooks/runs/09_zero3_no_prefetch --model $MODEL --steps 3 --micro-batch 2 --seq-len 64 --peft $LORA \
#   --checkpoint-dir notebooks/runs/09_ckpt_zero3_no_prefetch --checkpoint-every 2 --save-naive-adapter | grep saved
# # the check, from the command line: PEFT loads each saved adapter on a plain base model (exit 1: it cannot)
# python -m helpers.adapter notebooks/runs/09_ckpt_zero3_no_prefetch/step_2
# python -m helpers.adapter notebooks/runs/09_ckpt_zero3_no_prefetch/step_2 --adapter adapter_naive || true

# %%
from helpers.adapter import adapter_loss  # noqa: E402

saves = []
for name in ("full_shard", "zero2", "zero3", "zero3_no_prefetch"):
    ckpt = f"notebooks/runs/09_ckpt_{name}/step_2"
    meta, job_loss = read_meta(ckpt), results.load_run(f"notebooks/runs/09_{name}").metrics.loss[2]
    for kind in ("adapter", "adapter_naive"):
        failed = meta[kind].get("error")  # the plain save itself failed: nothing to load
        r = {"loaded": False, "loss": None} if failed else adapter_loss(ckpt, kind)
        saves.append(dict(config=name, saved=kind, tensors=meta[kind]["tensors"], numel=meta[kind]["numel"],
                          empty_tensors=meta[kind]["empty"], save_error=failed, peft_loads=r["loaded"],
                          loss_vs_job=None if r["loss"] is None else r["loss"] - job_loss))
saves = pd.DataFrame(saves)
print(saves.to_string(index=False))
guide, naive = saves[saves.saved == "adapter"], saves[saves.saved == "adapter_naive"].set_index("config")
claim("the guide's adapter is complete under every backend, PEFT loads it, and it gives the job's step-2 loss "
      "(within 1e-6)", (guide.empty_tensors == 0).all() and guide.peft_loads.all()
      and (guide.loss_vs_job.abs() < 1e-6).all(), loss_diff=guide.loss_vs_job.tolist())
runs["zero3_no_prefetch"] = results.load_run("notebooks/runs/09_zero3_no_prefetch")
z3_json = {n: runs[n].config["deepspeed"]["json"]["zero_optimization"] for n in ("zero3", "zero3_no_prefetch")}
npf = runs["zero3_no_prefetch"].summary["memory_split_bytes"]
claim("zero3.yaml leaves stage3_param_persistence_threshold unset (DeepSpeed's default); zero3_no_prefetch.yaml "
      "sets 0, and that job keeps nothing whole: every rank holds exactly 1/N of each bf16 weight, frozen and adapter",
      "stage3_param_persistence_threshold" not in z3_json["zero3"]
      and z3_json["zero3_no_prefetch"].get("stage3_param_persistence_threshold") == 0
      and all(sp["frozen"]["params"] == 2 * frozen_numel // N and sp["trainable"]["params"] == 2 * trainable_numel // N
              for sp in npf), threshold=z3_json["zero3_no_prefetch"].get("stage3_param_persistence_threshold"))
dtypes = set()
for name in ("full_shard", "zero2", "zero3", "zero3_no_prefetch"):
    with safe_open(f"notebooks/runs/09_ckpt_{name}/step_2/adapter/adapter_model.safetensors", "pt") as f:
        dtypes |= {str(f.get_slice(k).get_dtype()) for k in f.keys()}
claim("the guide's adapter/ is saved in fp32 under every backend", dtypes == {"F32"}, dtypes=sorted(dtypes))
npf_naive = naive.loc["zero3_no_prefetch"]
shapes_saved = {}
for kind in ("adapter", "adapter_naive"):
    with safe_open(f"notebooks/runs/09_ckpt_zero3_no_prefetch/step_2/{kind}/adapter_model.safetensors", "pt") as f:
        shapes_saved[kind] = {k: f.get_slice(k).get_shape() for k in f.keys()}
plain = {"threshold 0": npf_naive.numel == 0 and not npf_naive.peft_loads
         and set(shapes_saved["adapter_naive"]) == set(shapes_saved["adapter"])
         and all(math.prod(sh) == 0 for sh in shapes_saved["adapter_naive"].values())}
claim("with threshold 0 a naive ZeRO-3 save writes every name the guide's adapter/ has, each with no values, and "
      "PEFT cannot load it", plain["threshold 0"], names=len(shapes_saved["adapter_naive"]),
      guide_names=len(shapes_saved["adapter"]), numel=naive.loc["zero3_no_prefetch", "numel"])
kept = naive.loc[["zero2", "zero3"]]
plain["default"] = (kept.empty_tensors == 0).all() and kept.peft_loads.all()
claim("ZeRO-2, and ZeRO-3 at DeepSpeed's default threshold, keep this small adapter whole: the naive save happens "
      "to work", plain["default"], numel=kept.numel.tolist())
fs_naive = read_meta("notebooks/runs/09_ckpt_full_shard/step_2")["adapter_naive"]
plain["fsdp2"] = (bool(fs_naive["error"]) and fs_naive["dtensors"] == fs_naive["tensors"] > 0
                  and naive.loc["full_shard", "numel"] < guide.set_index("config").loc["full_shard", "numel"]
                  and not os.path.exists("notebooks/runs/09_ckpt_full_shard/step_2/adapter_naive/adapter_model.safetensors"))
claim("under FSDP2 the plain save (imitated: PEFT's state dict to safetensors) fails: every value of the state dict is a DTensor holding rank 0's "
      "shard, and nothing is written", plain["fsdp2"],
      error=fs_naive["error"], dtensors=fs_naive["dtensors"])

# %% [markdown]
# (For FSDP the table's `tensors` and `numel` describe rank 0's state dict in memory: no file was
# written.)
#
# **What it means.** Of these cases (FSDP2; ZeRO-3 at threshold 0; ZeRO-2 and ZeRO-3 at the default), the plain save was right only where every adapter parameter sat whole on rank 0.
# Accelerate fills `auto` with 10 × the hidden size
# <!-- fact: accelerate.ds_auto_persistence_threshold -->. The cell below does that arithmetic for
# this notebook's adapter on a model of Llama-2-7B's widths (hidden 4,096, MLP 11,008). Gather
# first, as the guide does.

# %%
facts.show("accelerate.ds_auto_persistence_threshold")
hidden, mlp, rank = 4096, 11008, json.load(open(LORA))["r"]
auto, over_auto = 10 * hidden, []
for mod, (n_in, n_out) in {"o_proj": (hidden, hidden), "down_proj": (mlp, hidden)}.items():
    for part, numel in (("lora_A", rank * n_in), ("lora_B", n_out * rank)):
        print(f"{mod}.{part}: {numel:,} elements: {'partitioned, by the threshold rule (not run)' if numel > auto else 'whole'}"
              f" under auto = {auto:,}")
        over_auto += [f"{mod}.{part}"] if numel > auto else []
claim("with Accelerate's auto threshold, a model of these widths (not run) would break that for this adapter: ZeRO-3 "
      "would partition part of it (by the threshold rule)", bool(over_auto), partitioned=over_auto, auto=auto)

# %% [markdown]
# ## Do the two backends still train alike?
#
# The FSDP and ZeRO-3 jobs above are the aligned pair: `fsdp/full_shard.yaml` and
# `deepspeed/zero3.yaml`, the two configs this guide keeps bit for bit alike for full training
# on this CPU (`02_precision`).

# %%
same = compare("notebooks/runs/09_full_shard", "notebooks/runs/09_zero3")
frozen_tensors = runs["full_shard"].summary["audit"]["parameters"] - n_lora  # traced: the adapter's tensors only
print(same.report())
claim("the FSDP and ZeRO-3 jobs above ran fsdp/full_shard.yaml and deepspeed/zero3.yaml",
      [runs[n].summary["config"] for n in ("full_shard", "zero3")]
      == ["launch_configs/fsdp/full_shard.yaml", "launch_configs/deepspeed/zero3.yaml"])
if nb.bitwise_parity_expected(N):
    claim("LoRA on o_proj/down_proj: the aligned pair is identical for 3 steps, every adapter weight, gradient and "
          "update (the frozen weights have no gradient and are not traced)",
          same.identical and same.tensor is None and all(same.traced) and same.untraced == frozen_tensors,
          untraced=same.untraced, frozen_tensors=frozen_tensors)

# %% [markdown]
# On this CPU, with this adapter, yes. Not every target trains alike: the deep dive `19_finetuning_details`
# moves the adapter to `q_proj` and `v_proj`, shows where that pair parts, and our reading of why.
#
# ## Recap
#
# Save the adapter gathered. What these runs showed:

# %%
claim("a frozen parameter keeps only its weight in the state; FSDP and ZeRO-3 shard it (ZeRO-3 keeps its small ones whole too), "
      "ZeRO-2 keeps it whole on every rank", weight_only and weights["frozen"] == placed,
      frozen_weights_MiB=table.frozen_weights_MiB.round(2).to_dict(), whole_MiB=round(whole, 2))
claim("the estimator takes the LoRA config and predicted these peaks within 10% (without DeepSpeed's fixed gradient "
      "bucket: FSDP and ZeRO-2 within 10%, ZeRO-3 within 20%)", fits["with"] and fits["without"],
      error=table.error.round(3).to_dict(), error_wo_bucket=table.error_wo_bucket.round(3).to_dict())
claim("a plain save under ZeRO-3 was empty at threshold 0 and whole at the default, and Accelerate's auto would "
      "partition part of this adapter on a 7B-width model (by the threshold rule): under ZeRO-3 the config "
      "decides, not the save code; under FSDP2 "
      "the plain save (imitated) failed", all(plain.values()) and bool(over_auto),
      **{k: bool(v) for k, v in plain.items()})
if nb.bitwise_parity_expected(N):
    claim(f"on this CPU, for 3 steps at {N} ranks, the aligned pair trained this LoRA bit for bit",
          same.identical and same.tensor is None and all(same.traced) and same.untraced == frozen_tensors
          and same.steps == 3, steps=same.steps, traced_tensors=n_lora)

# %% [markdown]
# That is the core path. The deep dives (`10`-`14`, `16`-`19`) go further into the core notebooks.
