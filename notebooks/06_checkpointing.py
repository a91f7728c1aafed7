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
# # 06 · Checkpointing: save, resume exactly, and switch backends mid-training
#
# **The question.** You trained for a while with FSDP. Can you stop, and carry on with
# DeepSpeed (or the other way round) *as if nothing had happened* — same loss at every
# later step, to the last bit? And what does each way of saving cost on disk and in time?
#
# **What we run.** One uninterrupted FSDP job of `3K` steps that saves a checkpoint every
# `K` steps. Then a relay: take its step-`K` checkpoint, convert it to DeepSpeed, train
# steps `K..2K` under ZeRO-3 (saving native DeepSpeed checkpoints with 16-bit weights),
# convert *that* back to FSDP and finish steps `2K..3K` under FSDP (saving one FULL
# state dict).
#
# **What we look at.** A table of every checkpoint kind — FSDP SHARDED (DCP), FSDP FULL,
# DeepSpeed ZeRO, DeepSpeed 16-bit, offline conversions — with save time, size and the
# dtypes of the tensors each save wrote (DeepSpeed's read back from its files; FSDP's and the
# conversions' from the state they saved: the bytes per parameter confirm them); the relay's
# loss curve drawn over the uninterrupted one; and DeepSpeed's own tools next to the guide's.

# %%
import json
import os
from pathlib import Path

import pandas as pd
from safetensors.torch import load_file

from helpers import facts, nb
from helpers.job import checkpoint
from helpers.nb import plots, results
from helpers.nb.claims import claim

SIZE = nb.setup()  # "quick" under `make test`: the same cells, fewer steps
MODEL, K = ("tiny", 2) if SIZE == "quick" else ("tiny", 4)
GPUS = nb.gpu_count()
NPROC = GPUS if GPUS else 2
CK = Path("notebooks/runs/06_ckpt")  # checkpoints live outside the run directories
os.environ.update(MODEL=MODEL, K=str(K), K2=str(2 * K), K3=str(3 * K), NPROC=str(NPROC), CK=str(CK))
print(f"size={SIZE}: model {MODEL}, K={K} ({3 * K} steps in all) on {NPROC} ranks")

# %% [markdown]
# ## How a checkpoint is written
#
# `--checkpoint-dir D --checkpoint-every K` saves `D/step_K`; `--resume D/step_K` starts
# the next job there (`--steps` stays the *total*). What gets saved follows the launch
# config, with Accelerate's keys:
#
# | config | what is on disk |
# |---|---|
# | FSDP `fsdp_state_dict_type: SHARDED_STATE_DICT` | `dcp/`: one file per rank (`torch.distributed.checkpoint`); any world size can load it <!-- fact: torch.dcp_file_per_rank --> |
# | FSDP `fsdp_state_dict_type: FULL_STATE_DICT` | `full.pt`: everything gathered to rank 0, model and optimizer in one file (Accelerate's `save_state` writes the model's into one file too) in the parameters' dtype (fp32 here: the model, built in bf16, is upcast to fp32 before sharding) <!-- fact: torch.full_state_dict_rank0 --> <!-- fact: accelerate.full_state_dict_one_file --> |
# | DeepSpeed | `ds/`: `engine.save_checkpoint`, two files per rank (model states, optimizer states) <!-- fact: deepspeed.zero3_checkpoint_files --> |
# | DeepSpeed `zero3_save_16bit_model: true` | also `model_16bit.bin`: the weights gathered in bf16 (no optimizer), <!-- fact: deepspeed.save_16bit_model_weights_only --> written by this guide (Accelerate's `save_state` does not) <!-- fact: accelerate.save_state_no_16bit_file --> |
#
# Besides model and optimizer, each rank saves its RNG state; the data of a step is a
# pure function of the step number, so the step counter is the data position.
#
# **Atomic saves.** Everything goes to `D/.step_K.tmp`; `meta.json` is written last and the
# directory is renamed to `D/step_K` only then. A job killed halfway leaves a `.tmp`
# directory that nothing mistakes for a checkpoint (the tests kill a rank mid-save to
# check it), and the previous `step_*` untouched.
#
# ## The uninterrupted run

# %% language="bash"
# rm -rf $CK
# torchrun --standalone --nproc_per_node $NPROC -m helpers.train \
#     --config launch_configs/fsdp/full_shard.yaml --out notebooks/runs/06_straight \
#     --model $MODEL --steps $K3 --checkpoint-dir $CK/fsdp --checkpoint-every $K

# %% [markdown]
# ## The relay: FSDP → DeepSpeed → FSDP
#
# `python -m helpers.convert SRC DST --to deepspeed|fsdp|hf` reads any of the formats (FSDP
# sharded or full, DeepSpeed ZeRO stage 0 to 3, any world size: `tests/test_resume_anywhere.py`
# and `tests/test_convert_layouts.py`; this notebook runs 2 ranks and ZeRO-3) into one consolidated fp32
# layout — per parameter name: the fp32 weight, Adam's `exp_avg`, `exp_avg_sq` and step —
# and writes it for the other side:
#
# * `--to fsdp` writes a DCP checkpoint; FSDP reshards it at load time, any world size. <!-- fact: torch.dcp_file_per_rank -->
# * `--to deepspeed` writes the consolidated file. DeepSpeed's native files resume with their
#   optimizer state only at the world size that wrote them <!-- fact: deepspeed.zero_checkpoint_fixed_world_size --> (its own ways
#   around that: `ds_to_universal` + `load_universal`, and `zero_to_fp32` for weights only), <!-- fact: deepspeed.universal_checkpoint_tools -->
#   so the import happens in the job that resumes: weights into the module
#   *before* `deepspeed.initialize`, then `safe_set_full_fp32_param` for the fp32 master
#   and `safe_set_full_optimizer_state` for Adam. <!-- fact: deepspeed.safe_set_full_state --> Torch Adam
#   creates its state lazily, at the first step <!-- fact: torch.adam_state_lazy --> (and ZeRO-1/2 link
#   each parameter to its slice of it only then), <!-- fact: deepspeed.zero12_link_state_after_step --> so the
#   job creates and links it first (ZeRO-0, with no partitions, copies into its fp32 masters
#   directly). Any world size, any ZeRO stage.
# * `--to hf` writes `config.json` + `model.safetensors`, for `from_pretrained`. <!-- fact: transformers.save_pretrained_files -->

# %%
facts.show("deepspeed.zero_checkpoint_fixed_world_size", "deepspeed.universal_checkpoint_tools")

# %% language="bash"
# python -m helpers.convert $CK/fsdp/step_$K $CK/to_ds/step_$K --to deepspeed
# torchrun --standalone --nproc_per_node $NPROC -m helpers.train \
#     --config launch_configs/deepspeed/zero3_16bit.yaml --out notebooks/runs/06_leg_ds \
#     --model $MODEL --steps $K2 --resume $CK/to_ds/step_$K --checkpoint-dir $CK/ds --checkpoint-every $K

# %% [markdown]
# DeepSpeed saved a native checkpoint at step `2K`. Back to FSDP, this time saving FULL
# state dicts:

# %% language="bash"
# python -m helpers.convert $CK/ds/step_$K2 $CK/to_fsdp/step_$K2 --to fsdp
# torchrun --standalone --nproc_per_node $NPROC -m helpers.train \
#     --config launch_configs/fsdp/full_shard_full_state_dict.yaml --out notebooks/runs/06_leg_fsdp \
#     --model $MODEL --steps $K3 --resume $CK/to_fsdp/step_$K2 --checkpoint-dir $CK/full --checkpoint-every $K
# python -m helpers.convert $CK/full/step_$K3 $CK/hf --to hf

# %% [markdown]
# ## One unbroken curve

# %%
straight, leg_ds, leg_fsdp = results.load_runs("notebooks/runs/06_straight", "notebooks/runs/06_leg_ds",
                                               "notebooks/runs/06_leg_fsdp")
relay = pd.concat([straight.metrics[straight.metrics.step < K], leg_ds.metrics, leg_fsdp.metrics])
fig, (left, right) = plots.plt.subplots(1, 2)
left.plot(straight.metrics.step, straight.metrics.loss, color="black", lw=4, alpha=0.25, label="uninterrupted FSDP")
for run, part, name in ((straight, straight.metrics[straight.metrics.step < K], "FSDP 0..K"),
                        (leg_ds, leg_ds.metrics, "DeepSpeed K..2K (converted)"),
                        (leg_fsdp, leg_fsdp.metrics, "FSDP 2K..3K (converted back)")):
    left.plot(part.step, part.loss, color=plots.COLORS[run.backend], marker="o", ms=3, lw=1.2, label=name)
for k in (K, 2 * K):
    left.axvline(k - 0.5, color="grey", ls=":", lw=1)
left.set(xlabel="step", ylabel="causal-LM loss", title="relay vs uninterrupted")
left.legend()
diff = (relay.loss.to_numpy() - straight.metrics.loss.to_numpy())
right.plot(straight.metrics.step, abs(diff), color="black", marker=".")
right.set(xlabel="step", ylabel="|difference|", title="|relay - uninterrupted| loss", ylim=(-0.05, 1))
fig.tight_layout()

# %% [markdown]
# **What it means.** The relay's points sit on the uninterrupted line, and the difference is
# zero at every step after the first switch (the first K steps are the uninterrupted run's
# own, where the relay starts). Bit-identical losses over those steps need the weights, Adam's
# moments and its step counter to have come through both conversions unchanged (the tests
# compare those tensors themselves: `tests/test_convert_layouts.py`, `tests/test_checkpoint.py`),
# and FSDP and ZeRO-3 to compute the same bits per step, as they do on CPU/gloo (notebook 00;
# on GPUs not checked). The jump at step 9 (on 2 ranks) is the loss bump notebook 00 traces to its constant
# learning rate (printed below), on both lines alike. The checks:

# %%
claim("the relay's legs ran on the backends they name, each resumed from the other",
      leg_ds.summary["resumed_from"]["backend"] == "fsdp" and leg_ds.backend == "deepspeed"
      and leg_fsdp.summary["resumed_from"]["backend"] == "deepspeed" and leg_fsdp.backend == "fsdp")
after = straight.metrics.step >= K  # the first K steps are the uninterrupted run's own (the relay starts from them)
claim(f"the relay's loss is bit-identical to the uninterrupted run's at all {2 * K} steps after the first switch",
      relay.step.tolist() == list(range(3 * K)) and relay.loss[after.to_numpy()].tolist()
      == straight.metrics.loss[after].tolist(), max_difference=float(abs(diff[after.to_numpy()]).max()))
print("learning rate at every step of the uninterrupted run:", sorted(set(straight.metrics.lr)))
if 3 * K > 10 and NPROC == 2:  # where the bump falls depends on each rank's slice of the batch (notebook 00)
    bump = straight.metrics.set_index("step").loss
    claim("the uninterrupted run's loss jumps at step 9 (by over 0.2) and falls back at step 10 (the relay's too: "
          "identical)", bump[9] > bump[8] + 0.2 and bump[10] < bump[9] - 0.2,
          steps_8_9_10=[round(bump[s], 4) for s in (8, 9, 10)])

# %% [markdown]
# Moving only the weights is not enough for this: Adam would restart with zero moments and
# step 1, <!-- fact: torch.adam_state_lazy --> so the first update after the switch would differ from the uninterrupted run's.
# That is why the converter carries the optimizer state too.
#
# ## What each kind of checkpoint costs
#
# Save time is measured in the job from the barrier before the save to the barrier after
# it; the DeepSpeed ZeRO-3 row leaves out the 16-bit file's write, which has its own row (the
# job's `saved` line counts both). Sizes are read from disk. The conversions ran offline, in
# one process.

# %%
facts.show("deepspeed.zero3_checkpoint_files", "deepspeed.zero3_checkpoint_contents",
           "deepspeed.save_16bit_model_weights_only", "accelerate.save_state_no_16bit_file")


def disk(path):
    return checkpoint.dir_bytes(path) if Path(path).is_dir() else Path(path).stat().st_size


rows = []
for run, label in ((straight, "FSDP SHARDED (DCP)"), (leg_ds, "DeepSpeed ZeRO-3"), (leg_fsdp, "FSDP FULL")):
    c = run.summary["checkpoints"][0]
    p = Path(c["path"])
    main = p / "ds" if run.backend == "deepspeed" else p
    dtypes = {k: v for k, v in c["saved_dtypes"].items() if k != "model_16bit"}
    rows.append(dict(kind=label, step=c["step"], save_s=c["seconds"] - (c["seconds_16bit"] or 0),
                     MB=disk(main) / 1e6, dtypes=dtypes))
    if c["seconds_16bit"] is not None:
        rows.append(dict(kind="DeepSpeed 16-bit weights", step=c["step"], save_s=c["seconds_16bit"],
                         MB=disk(p / "model_16bit.bin") / 1e6, dtypes={"model": c["saved_dtypes"]["model_16bit"]}))
for path, label in ((CK / "to_ds" / f"step_{K}", "convert FSDP -> DeepSpeed"),
                    (CK / "to_fsdp" / f"step_{2 * K}", "convert DeepSpeed -> FSDP")):
    m = json.loads((path / "meta.json").read_text())
    rows.append(dict(kind=label, step=m["step"], save_s=m["convert_seconds"], MB=m["bytes"] / 1e6,
                     dtypes=m["saved_dtypes"]))
m = json.loads((CK / "hf" / "conversion.json").read_text())
rows.append(dict(kind="export hf safetensors", step=m["step"], save_s=m["convert_seconds"],
                 MB=disk(CK / "hf" / "model.safetensors") / 1e6, dtypes={"model": sorted(
                     {str(v.dtype).removeprefix("torch.") for v in load_file(CK / "hf" / "model.safetensors").values()})}))
table = pd.DataFrame(rows).set_index("kind")
table.round({"save_s": 2, "MB": 2})

# %%
n = straight.summary["num_params"]
per_param = (table.MB * 1e6 / n).round(2)


def near(kind, want, tol):
    return abs(per_param[kind] - want) / want < tol


claim("a resumable checkpoint is about 12 bytes per parameter on both backends (within 10%)",
      near("FSDP FULL", 12, 0.10) and near("FSDP SHARDED (DCP)", 12, 0.10) and near("DeepSpeed ZeRO-3", 12, 0.10),
      bytes_per_param=per_param[["FSDP FULL", "FSDP SHARDED (DCP)", "DeepSpeed ZeRO-3"]].to_dict())
claim("FULL and SHARDED hold about the same bytes (within 5%), all fp32",
      abs(per_param["FSDP SHARDED (DCP)"] - per_param["FSDP FULL"]) / per_param["FSDP FULL"] < 0.05
      and all(table.loc[k, "dtypes"] == {"model": ["float32"], "optim": ["float32"]}
              for k in ("FSDP SHARDED (DCP)", "FSDP FULL")),
      bytes_per_param=per_param[["FSDP SHARDED (DCP)", "FSDP FULL"]].to_dict(),
      dtypes=table.loc[["FSDP SHARDED (DCP)", "FSDP FULL"], "dtypes"].to_dict())
smaller = per_param["DeepSpeed ZeRO-3"] / per_param["DeepSpeed 16-bit weights"]
claim("DeepSpeed's 16-bit file holds bf16 weights only (dtypes read from the file): 2 bytes per parameter, "
      "about 6x smaller than the ZeRO-3 checkpoint (5.7x to 6.3x)",
      near("DeepSpeed 16-bit weights", 2, 0.05) and 5.7 < smaller < 6.3
      and table.loc["DeepSpeed 16-bit weights", "dtypes"] == {"model": ["bfloat16"]},
      bytes_per_param=per_param["DeepSpeed 16-bit weights"], ratio=round(smaller, 2))
claim("the safetensors export holds fp32 weights only: 4 bytes per parameter", near("export hf safetensors", 4, 0.05),
      bytes_per_param=per_param["export hf safetensors"])

# %% [markdown]
# **What it means.** A checkpoint you can *resume* from is about 12 bytes per parameter for
# both backends as run here: the fp32 master weights (4) plus Adam's two fp32 moments (8)
# (under ZeRO-1/2 rank 0 also saves the bf16 module; not run here).
# DeepSpeed's ZeRO-3 optimizer files hold the fp32 partitions and moments, and its model
# files no weights at all (the table's empty `model`; the bf16 module copy is rebuilt from the
# partitions); <!-- fact: deepspeed.zero3_checkpoint_contents --> the 16-bit file is about 6x smaller (the ratio above) but holds
# weights only — good for inference, or for starting a new fine-tune (fresh optimizer) from
# these weights, not for an exact resume. <!-- fact: deepspeed.save_16bit_model_weights_only -->
# FULL and SHARDED hold about the same bytes; the difference is *who writes them*: FULL gathers
# everything into rank 0's memory and one file, <!-- fact: torch.full_state_dict_rank0 --> SHARDED lets
# every rank write its own part <!-- fact: torch.dcp_file_per_rank --> (so no rank holds the whole state;
# the save times above are one save each, not a comparison).
#
# ## The exported model loads with transformers

# %%
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

hf = AutoModelForCausalLM.from_pretrained(CK / "hf", dtype=torch.float32)
full = checkpoint.load_full(CK / "full" / f"step_{3 * K}")["model"]
claim(f"transformers loads the export as {type(hf).__name__}, every tensor equal to the last checkpoint's",
      all(torch.equal(p, full[name]) for name, p in hf.named_parameters()),
      params_M=sum(p.numel() for p in hf.parameters()) / 1e6)

# %% [markdown]
# ## DeepSpeed's own tools, next to the guide's
#
# DeepSpeed's ZeRO files resume only at the world size that wrote them. <!-- fact: deepspeed.zero_checkpoint_fixed_world_size -->
# Its own answer is the **universal checkpoint**: `helpers.convert --to universal` runs
# DeepSpeed's `ds_to_universal`, and `deepspeed/zero3_universal.yaml` sets
# `"checkpoint": {"load_universal": true}`, so DeepSpeed's loader reads it. <!-- fact: deepspeed.universal_checkpoint_tools -->
# For weights only, a ZeRO-3 checkpoint carries `zero_to_fp32.py`. <!-- fact: deepspeed.zero3_checkpoint_files --> Below, the DeepSpeed
# leg's step-`2K` checkpoint resumes on **1 rank** two ways, DeepSpeed's universal route and the
# guide's `--to deepspeed`, and FSDP resumes the uninterrupted run's step-`2K` DCP files (the
# same state: the relay is bit-identical; DCP reshards as it loads). <!-- fact: torch.dcp_file_per_rank --> Which tool to use when: [docs/checkpoints.md](../docs/checkpoints.md).

# %% language="bash"
# python -m helpers.convert $CK/ds/step_$K2 $CK/univ/step_$K2 --to universal
# python -m helpers.convert $CK/ds/step_$K2 $CK/to_ds1/step_$K2 --to deepspeed
# run1() { torchrun --standalone --nproc_per_node 1 -m helpers.train --model $MODEL --steps $K3 "$@" | tail -n 1; }
# run1 --config launch_configs/deepspeed/zero3_universal.yaml --out notebooks/runs/06_univ_1 --resume $CK/univ/step_$K2
# run1 --config launch_configs/deepspeed/zero3.yaml --out notebooks/runs/06_conv_1 --resume $CK/to_ds1/step_$K2
# run1 --config launch_configs/fsdp/full_shard.yaml --out notebooks/runs/06_dcp_1 --resume $CK/fsdp/step_$K2
# python $CK/ds/step_$K2/ds/zero_to_fp32.py $CK/ds/step_$K2/ds $CK/zero_to_fp32 --tag ds --safe_serialization \
#     > /dev/null 2>&1 && ls $CK/zero_to_fp32

# %%
from helpers import set_ds_accelerator  # noqa: E402

set_ds_accelerator()  # before DeepSpeed is imported (by the converter): CPU here, else CUDA
from helpers.convert import read_consolidated  # noqa: E402
from helpers.core import safeload  # noqa: E402

facts.show("deepspeed.universal_checkpoint_tools")
one = {name: results.load_run(f"notebooks/runs/06_{name}_1") for name in ("univ", "conv", "dcp")}
print({k: (r.summary["resumed_from"]["format"], r.summary["world_size"]) for k, r in one.items()})
claim(f"on 1 rank, DeepSpeed's universal route, the guide's conversion and FSDP's own DCP files give the same "
      f"losses over steps {2 * K}..{3 * K - 1}, bit for bit",
      [r.summary["resumed_from"]["format"] for r in one.values()] == ["universal", "full", "sharded"]
      and all(r.summary["world_size"] == 1 for r in one.values())
      and one["univ"].summary["losses"] == one["conv"].summary["losses"] == one["dcp"].summary["losses"],
      losses=one["univ"].summary["losses"])
ds_ck = CK / "ds" / f"step_{2 * K}"
ours = read_consolidated(ds_ck, checkpoint.read_meta(ds_ck))["model"]
z2f = load_file(str(CK / "zero_to_fp32" / "model.safetensors"))
b16 = safeload.load(ds_ck / "model_16bit.bin", "deepspeed")
claim("weights for inference agree: zero_to_fp32's fp32 weights equal the guide's reading of the same checkpoint, "
      "and the 16-bit file holds them rounded to bf16",
      all(torch.equal(z2f[k], t) and torch.equal(b16[k], t.bfloat16()) for k, t in ours.items()),
      tensors=len(ours))

# %% [markdown]
# (Resumed on 1 rank, the global batch is half of 2 ranks', so these losses are not the
# uninterrupted run's; they agree with each other.)
#
# ## Recap
#
# What this machine measured (the bullets after it add what the tests named there show):

# %%
same = relay.loss.tolist() == straight.summary["losses"]
print(f"relay FSDP -> DeepSpeed -> FSDP: losses {'identical to' if same else 'DIFFERENT from'} the uninterrupted "
      f"run at all {2 * K} steps after the first switch (final {straight.summary['final_loss']:.4f})")
for kind, r in table.iterrows():
    print(f"{kind:28s} {r.MB:8.2f} MB  {r.save_s:6.2f} s")

# %% [markdown]
# * A checkpoint that resumes exactly holds the model, the optimizer (moments *and* step), the
#   RNG and the data position (`tests/test_checkpoint.py` and `tests/test_resume_anywhere.py`
#   resume from each kind).
# * Another world size, same backend: FSDP's DCP files reshard as they load; for DeepSpeed,
#   its universal checkpoint and the guide's conversion give the same losses (above).
# * FSDP and DeepSpeed keep the same fp32 numbers in different layouts <!-- fact: deepspeed.zero3_checkpoint_contents -->;
#   converting through
#   one consolidated layout, with the DeepSpeed import done inside the resuming job,
#   continues training bit-identically in both directions.
# * Saves are atomic: a checkpoint directory exists only once it is complete
#   (`tests/test_checkpoint.py` kills a rank in the middle of a save).
