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
# **The question.** You trained with FSDP. Can you stop and carry on with
# DeepSpeed (or the other way round) *as if nothing had happened*: the same loss at every
# later step, to the last bit? And what does each way of saving cost?
#
# **What we run.** One uninterrupted FSDP job of `3K` steps that saves a checkpoint every
# `K` steps. Then a relay: its step-`K` checkpoint, converted, resumes under ZeRO-3 for steps
# `K` to `2K-1` (saving DeepSpeed's native checkpoint and 16-bit weights at `2K`); that one,
# converted back, resumes under FSDP for steps `2K` to `3K-1` (saving one FULL state dict).

# %%
import json
import os
from pathlib import Path

import pandas as pd

from helpers import facts, nb
from helpers.job import checkpoint
from helpers.nb import plots, results
from helpers.nb.claims import claim, ran

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
# the next job there (`--steps` stays the *total*). What is saved follows the launch config,
# with Accelerate's keys:
#
# | config | what is on disk |
# |---|---|
# | FSDP `fsdp_state_dict_type: SHARDED_STATE_DICT` | `dcp/`: one file per rank (`torch.distributed.checkpoint`); any world size can load it <!-- fact: torch.dcp_file_per_rank --> |
# | FSDP `fsdp_state_dict_type: FULL_STATE_DICT` | `full.pt`: model and optimizer gathered to rank 0, in one file (Accelerate's `save_fsdp_model` writes the model's in one file too), in the parameters' dtype (fp32 here) <!-- fact: torch.full_state_dict_rank0 --> <!-- fact: accelerate.full_state_dict_one_file --> |
# | DeepSpeed | `ds/`: `engine.save_checkpoint`, two files per rank (model states, optimizer states) <!-- fact: deepspeed.zero3_checkpoint_files --> |
# | DeepSpeed `stage3_gather_16bit_weights_on_model_save: true` (Accelerate: `zero3_save_16bit_model`) | also `model_16bit.bin`: the weights gathered in bf16 (no optimizer), <!-- fact: deepspeed.save_16bit_model_weights_only --> written by this guide (Accelerate's `save_state` does not) <!-- fact: accelerate.save_state_no_16bit_file --> |
#
# Each rank also saves its RNG state; a step's data is a pure function of the step number,
# so the step counter is the data position (by design; not checked here). (A killed save leaves nothing that passes
# for a checkpoint: the deep dive `16_checkpointing_details` kills one.)
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
# `python -m helpers.convert SRC DST --to deepspeed|fsdp` reads each format (FSDP's
# sharded files, DeepSpeed ZeRO stage 0 to 3, another world size: `tests/test_resume_anywhere.py`,
# `tests/test_convert_layouts.py`) into one consolidated fp32 layout (per parameter: the fp32
# weight, Adam's `exp_avg`, `exp_avg_sq` and step) and writes it for the other side:
#
# * `--to fsdp` writes a DCP checkpoint, which FSDP reshards as it loads. <!-- fact: torch.dcp_file_per_rank -->
# * `--to deepspeed` writes the consolidated file. DeepSpeed's native files resume with their
#   optimizer state only at the world size that wrote them, <!-- fact: deepspeed.zero_checkpoint_fixed_world_size -->
#   so the resuming job imports it (its code path; not traced here): weights into the module *before* `deepspeed.initialize`,
#   then `safe_set_full_fp32_param` for the fp32 master and `safe_set_full_optimizer_state`
#   for Adam. <!-- fact: deepspeed.safe_set_full_state -->
#
# Other world sizes, each ZeRO stage's import (described there) and DeepSpeed's own tools: the deep dive
# `16_checkpointing_details`.

# %%
facts.show("deepspeed.zero_checkpoint_fixed_world_size")

# %% language="bash"
# python -m helpers.convert $CK/fsdp/step_$K $CK/to_ds/step_$K --to deepspeed
# torchrun --standalone --nproc_per_node $NPROC -m helpers.train \
#     --config launch_configs/deepspeed/zero3_16bit.yaml --out notebooks/runs/06_leg_ds \
#     --model $MODEL --steps $K2 --resume $CK/to_ds/step_$K --checkpoint-dir $CK/ds --checkpoint-every $K

# %% [markdown]
# DeepSpeed saved a native checkpoint at step `2K`. Back to FSDP, this time saving a FULL
# state dict:

# %% language="bash"
# python -m helpers.convert $CK/ds/step_$K2 $CK/to_fsdp/step_$K2 --to fsdp
# torchrun --standalone --nproc_per_node $NPROC -m helpers.train \
#     --config launch_configs/fsdp/full_shard_full_state_dict.yaml --out notebooks/runs/06_leg_fsdp \
#     --model $MODEL --steps $K3 --resume $CK/to_fsdp/step_$K2 --checkpoint-dir $CK/full --checkpoint-every $K

# %% [markdown]
# ## One unbroken curve

# %%
straight, leg_ds, leg_fsdp = results.load_runs("notebooks/runs/06_straight", "notebooks/runs/06_leg_ds",
                                               "notebooks/runs/06_leg_fsdp")
ran(f"one uninterrupted FSDP job of {3 * K} steps ({MODEL}, {NPROC} ranks)", [straight], backend="fsdp", model=MODEL,
    steps=3 * K, world_size=NPROC, resumed_from=None)


def saved(run):
    return [(c["step"], c["format"]) for c in run.summary["checkpoints"]]


def resumed(run, ck, src):  # resumed from CK/ck, which the converter wrote from CK/src
    meta = json.loads((CK / ck / "meta.json").read_text())
    return run.summary["resumed_from"]["path"] == str(CK / ck) and meta["converted_from"] == str(CK / src)


claim(f"it saved a SHARDED checkpoint every {K} steps", saved(straight) == [(k, "sharded") for k in (K, 2 * K, 3 * K)],
      saved=saved(straight))
claim(f"its step-{K} checkpoint, converted, resumed under ZeRO-3 for steps {K}..{2 * K - 1}, which saved a native "
      f"checkpoint with 16-bit weights at step {2 * K}",
      resumed(leg_ds, f"to_ds/step_{K}", f"fsdp/step_{K}") and leg_ds.summary["mode_key"] == "zero3"
      and leg_ds.metrics.step.tolist() == list(range(K, 2 * K)) and saved(leg_ds) == [(2 * K, "deepspeed")]
      and leg_ds.summary["checkpoints"][0]["saved_dtypes"]["model_16bit"] == ["bfloat16"], saved=saved(leg_ds))
claim(f"that one, converted back, resumed under FSDP for steps {2 * K}..{3 * K - 1}, which saved one FULL state dict",
      resumed(leg_fsdp, f"to_fsdp/step_{2 * K}", f"ds/step_{2 * K}") and leg_fsdp.backend == "fsdp"
      and leg_fsdp.metrics.step.tolist() == list(range(2 * K, 3 * K)) and saved(leg_fsdp) == [(3 * K, "full")],
      saved=saved(leg_fsdp))
wrote = {d: sorted(f.name for f in (CK / d).rglob("*") if f.is_file() and "rng" not in f.parts)
         for d in (f"to_ds/step_{K}", f"to_fsdp/step_{2 * K}")}
claim("the converter wrote DeepSpeed one consolidated file (full.pt) and FSDP a DCP checkpoint (.metadata and "
      "its .distcp data)", wrote[f"to_ds/step_{K}"] == ["full.pt", "meta.json"]
      and {".metadata", "meta.json"} < set(wrote[f"to_fsdp/step_{2 * K}"])
      and all(n.endswith(".distcp") for n in set(wrote[f"to_fsdp/step_{2 * K}"]) - {".metadata", "meta.json"}),
      files=wrote)
relay = pd.concat([straight.metrics[straight.metrics.step < K], leg_ds.metrics, leg_fsdp.metrics])
fig, (left, right) = plots.plt.subplots(1, 2)
left.plot(straight.metrics.step, straight.metrics.loss, color="black", lw=4, alpha=0.25, label="uninterrupted FSDP")
for run, part, name in ((straight, straight.metrics[straight.metrics.step < K], "FSDP 0 to K-1"),
                        (leg_ds, leg_ds.metrics, "DeepSpeed K to 2K-1 (converted)"),
                        (leg_fsdp, leg_fsdp.metrics, "FSDP 2K to 3K-1 (converted back)")):
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
# **What it means.** The relay's points sit on the uninterrupted line; on this CPU the
# difference is zero at every step after the first switch. The state agrees too: at step `2K` the
# relay's converted checkpoint holds the uninterrupted run's weights, Adam's moments and step
# counters bit for bit (checked below; other layouts: `tests/test_convert_layouts.py`). An exact relay
# also needs FSDP and ZeRO-3 to compute the same bits per step, as they did on CPU/gloo in notebook 00
# (on GPUs the check allows 1e-2). The jump at step 9 (on 2 ranks) is the loss bump the deep dive
# `10_launching_details` looks at (our rate is printed below), on both lines alike. The checks:

# %%
after = straight.metrics.step >= K  # the first K steps are the uninterrupted run's own (the relay starts from them)
gap = float(abs(diff[after.to_numpy()]).max())
relay_same = relay.loss[after.to_numpy()].tolist() == straight.metrics.loss[after].tolist()
if nb.bitwise_parity_expected(NPROC):
    claim(f"the relay's loss is bit-identical to the uninterrupted run's at all {2 * K} steps after the first switch",
          relay.step.tolist() == list(range(3 * K)) and relay_same, max_difference=gap)
else:
    claim(f"the relay's loss is within 1e-2 of the uninterrupted run's at all {2 * K} steps after the first switch "
          "(nccl)", relay.step.tolist() == list(range(3 * K)) and gap < 1e-2, max_difference=gap)
print("learning rates used: uninterrupted run", sorted(set(straight.metrics.lr)), "relay", sorted(set(relay.lr)))
import torch  # noqa: E402

from helpers.convert import read_consolidated  # noqa: E402


def leaves(x, at=()):
    """(path, value) of every tensor and setting in a checkpoint's consolidated state."""
    if isinstance(x, dict | list | tuple):
        for k, v in (x.items() if isinstance(x, dict) else enumerate(x)):
            yield from leaves(v, (*at, str(k)))
    else:
        yield at, x


own, relayed = (dict(leaves(read_consolidated(step, checkpoint.read_meta(step))))
                for step in (CK / d / f"step_{2 * K}" for d in ("fsdp", "to_fsdp")))
tensors = [k for k, v in own.items() if torch.is_tensor(v)]
model_t = [k for k in tensors if k[0] == "model"]
kinds = sorted({k[-1] for k in tensors if k[0] == "optim"})
# a reading that lost the optimizer state on both sides would still compare equal: count what was compared
same_state = own.keys() == relayed.keys() and all(
    torch.equal(own[k], relayed[k]) if k in tensors else own[k] == relayed[k] for k in own) and len(model_t) > 0 \
    and kinds == ["exp_avg", "exp_avg_sq", "step"] and len(tensors) == 4 * len(model_t)
if nb.bitwise_parity_expected(NPROC):
    claim(f"at step {2 * K} the relay's converted checkpoint equals the uninterrupted run's own, bit for bit: weights, "
          "Adam's moments and steps (three per weight), and the optimizer's settings", same_state, tensors=len(tensors),
          weights=len(model_t), other_values=len(own) - len(tensors), kinds=kinds)
if 3 * K > 10 and NPROC == 2 and not GPUS:  # the step checked on CPU/gloo at 2 ranks (as notebook 10 does)
    bump, relayed = straight.metrics.set_index("step").loss, relay.set_index("step").loss
    claim("at notebook 10's rate (3e-3) the loss jumps at step 9 (by over 0.2) and falls back at step 10 (within 0.05 "
          "of step 8), in the uninterrupted run and in the relay", set(straight.metrics.lr) == set(relay.lr) == {3e-3}
          and all(b[9] > b[8] + 0.2 and abs(b[10] - b[8]) < 0.05 for b in (bump, relayed)),
          steps_8_9_10={name: [round(b[s], 4) for s in (8, 9, 10)] for name, b in (("uninterrupted", bump),
                                                                                   ("relay", relayed))},
          lr={"uninterrupted": sorted(set(straight.metrics.lr)), "relay": sorted(set(relay.lr))})

# %% [markdown]
# Weights alone would not do: Adam would restart with zero moments at step 1, <!-- fact: torch.adam_state_lazy -->
# and the first update after the switch would differ (not run here). So the converter carries
# the optimizer state too (the table's `convert` rows: fp32 `optim`, checked below it).
#
# ## What each kind of checkpoint costs
#
# How the table is made (not checked here): save time is from the barrier before the save to
# the barrier after it (the ZeRO-3 row leaves out the 16-bit file's write, which has its own row);
# sizes are read from disk; dtypes from DeepSpeed's files, and from the state FSDP and the
# converter saved. The conversions are the offline cells between the jobs.

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
table = pd.DataFrame(rows).set_index("kind")
table.round({"save_s": 2, "MB": 2})

# %%
n = straight.summary["num_params"]
per_param = (table.MB * 1e6 / n).round(2)


def near(kind, want, tol):
    return abs(per_param[kind] - want) / want < tol


claim("a resumable checkpoint is about 12 bytes per parameter under FSDP and ZeRO-3 (within 10%), its optimizer state "
      "all fp32; DeepSpeed's ZeRO-3 model files hold no weights (no dtype in the table's `model`)",
      near("FSDP FULL", 12, 0.10) and near("FSDP SHARDED (DCP)", 12, 0.10) and near("DeepSpeed ZeRO-3", 12, 0.10)
      and table.loc["DeepSpeed ZeRO-3", "dtypes"] == {"model": [], "optim": ["float32"]}
      and all(table.loc[k, "dtypes"]["optim"] == ["float32"] for k in ("FSDP FULL", "FSDP SHARDED (DCP)")),
      bytes_per_param=per_param[["FSDP FULL", "FSDP SHARDED (DCP)", "DeepSpeed ZeRO-3"]].to_dict(),
      zero3_dtypes=table.loc["DeepSpeed ZeRO-3", "dtypes"])
claim("both conversions wrote the model and the optimizer state, all fp32, about 12 bytes per parameter (within 10%)",
      all(table.loc[k, "dtypes"] == {"model": ["float32"], "optim": ["float32"]} and near(k, 12, 0.10)
          for k in ("convert FSDP -> DeepSpeed", "convert DeepSpeed -> FSDP")),
      bytes_per_param=per_param[["convert FSDP -> DeepSpeed", "convert DeepSpeed -> FSDP"]].to_dict())
claim("FULL and SHARDED hold about the same bytes (within 5%), all fp32",
      abs(per_param["FSDP SHARDED (DCP)"] - per_param["FSDP FULL"]) / per_param["FSDP FULL"] < 0.05
      and all(table.loc[k, "dtypes"] == {"model": ["float32"], "optim": ["float32"]}
              for k in ("FSDP SHARDED (DCP)", "FSDP FULL")),
      bytes_per_param=per_param[["FSDP SHARDED (DCP)", "FSDP FULL"]].to_dict(),
      dtypes=table.loc[["FSDP SHARDED (DCP)", "FSDP FULL"], "dtypes"].to_dict())
smaller = per_param["DeepSpeed ZeRO-3"] / per_param["DeepSpeed 16-bit weights"]
ds_ck = Path(leg_ds.summary["checkpoints"][0]["path"])
file16 = torch.load(ds_ck / "model_16bit.bin", map_location="cpu", weights_only=True)  # read back here
shapes16 = {k: list(v.shape) for k, v in file16.items()}
claim("DeepSpeed's 16-bit file holds the model's weights and nothing else (the names and shapes the checkpoint's "
      "meta.json lists for the model), all bf16: 2 bytes per parameter (within 5%), about 6x smaller than the ZeRO-3 "
      "checkpoint (5.7x to 6.3x)",
      shapes16 == checkpoint.read_meta(ds_ck)["param_shapes"] and {str(v.dtype) for v in file16.values()}
      == {"torch.bfloat16"} and sum(v.numel() for v in file16.values()) == n
      and near("DeepSpeed 16-bit weights", 2, 0.05) and 5.7 < smaller < 6.3,
      tensors=len(file16), dtypes=sorted({str(v.dtype) for v in file16.values()}),
      numel=sum(v.numel() for v in file16.values()), num_params=n,
      bytes_per_param=per_param["DeepSpeed 16-bit weights"], ratio=round(smaller, 2))

# %% [markdown]
# **What it means.** Here (AdamW, fp32 state) a checkpoint you can *resume* from is about 12 bytes per parameter under
# FSDP and ZeRO-3: fp32 master weights (4) plus Adam's two fp32 moments (8). DeepSpeed's ZeRO-3 optimizer files
# hold the fp32 partitions and moments, its model files no weights (the table's empty `model`). <!-- fact: deepspeed.zero3_checkpoint_contents --> The
# 16-bit file is about 6x smaller but holds weights only: it suits inference or a fresh
# fine-tune (not run here), not an exact resume. <!-- fact: deepspeed.save_16bit_model_weights_only -->
# FULL and SHARDED hold about the same bytes; by design the difference is *who writes them*: FULL gathers
# everything into rank 0's memory and one file, <!-- fact: torch.full_state_dict_rank0 --> SHARDED
# lets every rank write its own part <!-- fact: torch.dcp_file_per_rank --> (the save
# times: one save each, not a comparison).
#
# ## Recap
#
# What this machine measured; the bullets after it sum up, naming the tests that show more:

# %%
print(f"relay FSDP -> DeepSpeed -> FSDP vs the uninterrupted run, {2 * K} steps after the first switch: "
      f"max |loss difference| {gap:.3g} (checked above); final loss {straight.summary['final_loss']:.4f}")
for kind, r in table.iterrows():
    print(f"{kind:28s} {r.MB:8.2f} MB  {r.save_s:6.2f} s")

# %% [markdown]
# * A checkpoint that resumes exactly holds the model, the optimizer (moments *and* step), the
#   RNG and the data position (by design; tests: `tests/test_checkpoint.py`, `tests/test_resume_anywhere.py`).
# * FSDP and DeepSpeed keep the same fp32 state kinds, laid out differently; <!-- fact: deepspeed.zero3_checkpoint_contents -->
#   converting through one consolidated layout, imported inside the
#   resuming job, gave bit-identical losses in both directions (on this CPU).
# * Here a resumable checkpoint is about 12 bytes per parameter under FSDP and ZeRO-3; DeepSpeed's 16-bit
#   file, about 6x smaller, holds weights only.
# * More in the deep dive `16_checkpointing_details`: atomic saves, another world size,
#   DeepSpeed's own tools, weights for inference and each ZeRO stage's import (described there).
#
# Next: `07_throughput`.
