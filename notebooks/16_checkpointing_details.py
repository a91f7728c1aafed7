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
# # 16 · Deep dive: checkpoints in detail
#
# **The question.** Notebook 06 relayed one run between FSDP and DeepSpeed at a fixed number of
# ranks. Here: what does a save leave behind when the job dies before it finishes? Can a 2-rank
# checkpoint resume on 1 rank, and do DeepSpeed's universal checkpoint, the guide's conversion and
# FSDP's DCP files agree there? Do `zero_to_fp32`, DeepSpeed's 16-bit file and a Hugging Face
# export hold the same weights? (A deep dive from notebook 06; the core path goes on with 07.)
#
# **What we run.** On 2 CPU ranks (or one per GPU), the tiny model: an FSDP job of `3K`
# steps that saves every `K` steps and is killed inside its last save; from its step-`K`
# checkpoint, converted, a DeepSpeed ZeRO-3 job for steps `K` to `2K-1`, as in notebook 06's relay.
# Then three 1-rank jobs resume from step `2K`, and three weights-only files are written and read.

# %%
import json
import os
from pathlib import Path

from safetensors.torch import load_file

from helpers import facts, nb
from helpers.job import checkpoint
from helpers.nb import results
from helpers.nb.claims import claim

SIZE = nb.setup()  # "quick" under `make test`: the same cells, fewer steps
MODEL, K = ("tiny", 2) if SIZE == "quick" else ("tiny", 4)
GPUS = nb.gpu_count()
NPROC = GPUS if GPUS else 2
CK = Path("notebooks/runs/16_ckpt")  # checkpoints live outside the run directories
os.environ.update(MODEL=MODEL, K=str(K), K2=str(2 * K), K3=str(3 * K), NPROC=str(NPROC), CK=str(CK))
print(f"size={SIZE}: model {MODEL}, K={K} on {NPROC} ranks")

# %% [markdown]
# ## 1 · A save that dies before it finishes
#
# By design (not traced here), a save writes everything to `D/.step_K.tmp`, `meta.json` last, and only then
# renames the directory to `D/step_K`. So a job killed during a save leaves a `.tmp` directory that the guide's
# reader refuses, and the previous `step_*` complete. Below, one such kill is run: the last rank kills
# itself inside the save of step `3K`, after its files and before `meta.json` (the hook `tests/test_checkpoint.py` uses, `GUIDE_FAIL_*`;
# never set in real runs). The DeepSpeed job then resumes from the FSDP job's step `K`.

# %% language="bash"
# rm -rf $CK
# GUIDE_FAIL_RANK=$((NPROC - 1)) GUIDE_FAIL_STEP=$K3 GUIDE_FAIL_PHASE=save GUIDE_FAIL_MODE=kill \
#     torchrun --standalone --nproc_per_node $NPROC -m helpers.train \
#     --config launch_configs/fsdp/full_shard.yaml --out notebooks/runs/16_fsdp \
#     --model $MODEL --steps $K3 --checkpoint-dir $CK/fsdp --checkpoint-every $K 2>&1 | grep -E "^(saved|error)"
# echo "FSDP job: exit code ${PIPESTATUS[0]}"
# set -o pipefail
# python -m helpers.convert $CK/fsdp/step_$K $CK/to_ds/step_$K --to deepspeed
# torchrun --standalone --nproc_per_node $NPROC -m helpers.train \
#     --config launch_configs/deepspeed/zero3_16bit.yaml --out notebooks/runs/16_ds \
#     --model $MODEL --steps $K2 --resume $CK/to_ds/step_$K --checkpoint-dir $CK/ds --checkpoint-every $K | tail -n 1

# %%
fsdp_dir = CK / "fsdp"
contents = sorted(p.name for p in fsdp_dir.iterdir())
try:
    checkpoint.read_meta(fsdp_dir / f".step_{3 * K}.tmp")
    refused = None
except checkpoint.CheckpointError as e:
    refused = str(e)
failed = json.loads(Path("notebooks/runs/16_fsdp/summary.json").read_text())


def files(d):  # every file under d, by its path in d
    return {str(f.relative_to(d)) for f in d.rglob("*") if f.is_file()}


tmp_files, done_files = files(fsdp_dir / f".step_{3 * K}.tmp"), files(fsdp_dir / f"step_{2 * K}")
print("in", fsdp_dir, ":", contents)
claim(f"the job failed on the killed rank, whose save left only .step_{3 * K}.tmp (every file of a save but meta.json), which the "
      f"guide refuses as a partial checkpoint; the saves of steps {K} and {2 * K} stayed complete",
      failed["status"] == "failed" and failed["failed_rank"] == NPROC - 1
      and set(contents) == {f".step_{3 * K}.tmp", f"step_{K}", f"step_{2 * K}"}
      and refused is not None and "partial checkpoint" in refused  # (the reader refuses any .tmp by its name)
      and tmp_files == done_files - {"meta.json"}  # really partial: every file of a complete save but meta.json
      and [checkpoint.read_meta(fsdp_dir / f"step_{s}")["step"] for s in (K, 2 * K)] == [K, 2 * K],
      reason=failed["reason"], refused=refused, tmp_files=len(tmp_files), complete_save_files=len(done_files))
claim(f"that FSDP job trained {MODEL} on {NPROC} ranks for {3 * K} steps, saving every {K}",
      (failed["backend"], failed["model"], failed["world_size"], failed["steps"]) == ("fsdp", MODEL, NPROC, 3 * K)
      and [c["step"] for c in failed["checkpoints"]] == [K, 2 * K], saved=[c["step"] for c in failed["checkpoints"]])

# %%
fsdp_losses = [json.loads(x)["loss"] for x in Path("notebooks/runs/16_fsdp/metrics.jsonl").read_text().splitlines()]
ds = results.load_run("notebooks/runs/16_ds")
gap = max(abs(a - b) for a, b in zip(ds.summary["losses"], fsdp_losses[K:2 * K], strict=True))


def converted_from(ck):  # the checkpoint the converter read to write ck
    return json.loads((ck / ("conversion.json" if ck.name == "hf" else "meta.json")).read_text())["converted_from"]


claim(f"from the FSDP job's step-{K} checkpoint, converted, a ZeRO-3 job on {NPROC} ranks ran steps {K}..{2 * K - 1} "
      f"and saved at step {2 * K}",
      ds.summary["resumed_from"]["path"] == str(CK / "to_ds" / f"step_{K}")
      and converted_from(CK / "to_ds" / f"step_{K}") == str(fsdp_dir / f"step_{K}")
      and ds.summary["mode_key"] == "zero3" and ds.summary["world_size"] == NPROC
      and ds.metrics.step.tolist() == list(range(K, 2 * K)) and [c["step"] for c in ds.summary["checkpoints"]] == [2 * K],
      resumed_from=ds.summary["resumed_from"]["path"])
if nb.bitwise_parity_expected(NPROC):
    claim(f"the DeepSpeed job, resumed from FSDP's step {K}, has FSDP's losses at steps {K}..{2 * K - 1}, bit for bit",
          ds.summary["losses"] == fsdp_losses[K:2 * K], deepspeed=ds.summary["losses"], fsdp=fsdp_losses[K:2 * K])
else:
    claim(f"the DeepSpeed job, resumed from FSDP's step {K}, is within 1e-2 of FSDP's losses (nccl)", gap < 1e-2,
          max_difference=gap)

# %% [markdown]
# ## 2 · Another world size
#
# DeepSpeed's ZeRO files resume with their optimizer state only at the world size that wrote them. <!-- fact: deepspeed.zero_checkpoint_fixed_world_size -->
# Its own answer is the **universal checkpoint**: `helpers.convert --to universal` runs
# DeepSpeed's `ds_to_universal`, and `launch_configs/deepspeed/zero3_universal.json` (which its YAML names) sets
# `"checkpoint": {"load_universal": true}`, so DeepSpeed's loader reads it. <!-- fact: deepspeed.universal_checkpoint_tools -->
# The guide's `--to deepspeed` is not tied to the world size either (here 2 ranks to 1). FSDP's DCP files reshard as they
# load. <!-- fact: torch.dcp_file_per_rank --> Below, DeepSpeed's step-`2K` checkpoint resumes on
# **1 rank** both ways, and FSDP resumes its own step-`2K` DCP files (the DeepSpeed job matched
# FSDP's losses above; the three routes' losses are compared below).
#
# How the guide's import gets Adam's state into each ZeRO stage (its code path; not traced here): the resuming job puts the
# weights into the module before `deepspeed.initialize`, then sets the fp32 master and Adam's
# state through DeepSpeed's `safe_set_full_*` calls. <!-- fact: deepspeed.safe_set_full_state -->
# Torch Adam creates its state lazily, at the first step, <!-- fact: torch.adam_state_lazy --> and
# ZeRO-1/2 link each parameter to its slice of it only then, <!-- fact: deepspeed.zero12_link_state_after_step -->
# so the job creates and links that state first; ZeRO-0 (only stages 1-3 partition <!-- fact: deepspeed.zero_stage_partitions -->) copies into its
# fp32 masters directly. `tests/test_checkpoint.py` and `tests/test_resume_anywhere.py` resume
# converted checkpoints under ZeRO-0, 1, 2 and 3.

# %% language="bash"
# set -o pipefail
# python -m helpers.convert $CK/ds/step_$K2 $CK/univ/step_$K2 --to universal
# python -m helpers.convert $CK/ds/step_$K2 $CK/to_ds1/step_$K2 --to deepspeed
# run1() { torchrun --standalone --nproc_per_node 1 -m helpers.train --model $MODEL --steps $K3 "$@" | tail -n 1; }
# run1 --config launch_configs/deepspeed/zero3_universal.yaml --out notebooks/runs/16_univ_1 --resume $CK/univ/step_$K2
# run1 --config launch_configs/deepspeed/zero3.yaml --out notebooks/runs/16_conv_1 --resume $CK/to_ds1/step_$K2
# run1 --config launch_configs/fsdp/full_shard.yaml --out notebooks/runs/16_dcp_1 --resume $CK/fsdp/step_$K2

# %%
facts.show("deepspeed.zero_checkpoint_fixed_world_size", "deepspeed.universal_checkpoint_tools")
one = {name: results.load_run(f"notebooks/runs/16_{name}_1") for name in ("univ", "conv", "dcp")}
print({k: (r.summary["resumed_from"]["format"], r.summary["world_size"]) for k, r in one.items()})
routes = ([r.summary["resumed_from"]["format"] for r in one.values()] == ["universal", "full", "sharded"]
          and all(r.summary["world_size"] == 1 for r in one.values()))
src = {k: Path(r.summary["resumed_from"]["path"]) for k, r in one.items()}
claim(f"all three 1-rank jobs resumed from step {2 * K}: two from DeepSpeed's {NPROC}-rank checkpoint, converted "
      "(universal; the guide's --to deepspeed), one from FSDP's own DCP files",
      routes and all(r.summary["resumed_from"]["step"] == 2 * K for r in one.values())
      and [converted_from(src[k]) for k in ("univ", "conv")] == [str(CK / "ds" / f"step_{2 * K}")] * 2
      and all(checkpoint.read_meta(src[k])["world_size"] == NPROC for k in ("univ", "conv"))
      and src["dcp"] == fsdp_dir / f"step_{2 * K}", resumed_from={k: str(v) for k, v in src.items()})
spread = max(max(s) - min(s) for s in zip(*(r.summary["losses"] for r in one.values()), strict=True))
if nb.bitwise_parity_expected(NPROC):
    claim(f"on 1 rank, DeepSpeed's universal route, the guide's conversion and FSDP's own DCP files give the same "
          f"losses over steps {2 * K}..{3 * K - 1}, bit for bit",
          routes and one["univ"].summary["losses"] == one["conv"].summary["losses"] == one["dcp"].summary["losses"],
          losses=one["univ"].summary["losses"])
else:
    claim(f"on 1 rank, the three routes' losses over steps {2 * K}..{3 * K - 1} are within 1e-2 of each other (GPU)",
          routes and spread < 1e-2, max_difference=spread)
two = fsdp_losses[2 * K:3 * K]  # the 2-rank FSDP job of section 1 trained these steps before its killed save
first = [r.summary["losses"][0] for r in one.values()]
# step-2K loss, 1 rank vs 2: under 0.02 apart at either size; the 2-rank loss a step earlier is over 0.1 higher
claim(f"each 1-rank job started from the saved weights: its step-{2 * K} loss is within 0.05 of the 2-rank job's, "
      "over 1 below that job's step 0 (a fresh model's)",
      all(abs(x - two[0]) < 0.05 and fsdp_losses[0] - x > 1 for x in first),
      one_rank_first=[round(x, 4) for x in first], two_ranks=round(two[0], 4), step_0=round(fsdp_losses[0], 4))
claim("they train on a smaller global batch than the 2-rank job (tokens per step), and every step's loss differs "
      "from its (the first: the same weights, averaged over fewer samples)",
      len(two) == K and all(abs(a - b) > 1e-6 for a, b in zip(one["dcp"].summary["losses"], two, strict=True))
      and one["dcp"].summary["tokens_per_step"] < failed["tokens_per_step"],
      tokens_per_step=[one["dcp"].summary["tokens_per_step"], failed["tokens_per_step"]],
      one_rank=[round(x, 4) for x in one["dcp"].summary["losses"]], two_ranks=[round(x, 4) for x in two])

# %% [markdown]
# (On 1 rank the global batch is smaller than on 2, and these steps' losses differ from
# the 2-rank job's, as the last check shows; what counts is that the three routes agree.)
#
# ## 3 · Weights for inference
#
# Three files hold weights only. A ZeRO-3 checkpoint carries `zero_to_fp32.py`, which writes
# the fp32 weights; <!-- fact: deepspeed.zero3_checkpoint_files --> `zero3_save_16bit_model: true` (Accelerate's name for DeepSpeed's `stage3_gather_16bit_weights_on_model_save` <!-- fact: accelerate.save_state_no_16bit_file -->)
# makes the guide's save call `save_16bit_model` too, which adds the weights in bf16 (`save_checkpoint` alone never writes them); <!-- fact: deepspeed.save_16bit_model_weights_only --> <!-- fact: deepspeed.save_checkpoint_no_16bit --> and
# `helpers.convert --to hf` writes `config.json` + `model.safetensors`, for `from_pretrained`. <!-- fact: transformers.save_pretrained_files -->
# All three come from DeepSpeed's step-`2K` checkpoint, next to the guide's own reading of it.
# Which tool to use when: [docs/checkpoints.md](../docs/checkpoints.md).

# %% language="bash"
# set -o pipefail
# python $CK/ds/step_$K2/ds/zero_to_fp32.py $CK/ds/step_$K2/ds $CK/zero_to_fp32 --tag ds --safe_serialization \
#     > /dev/null 2>&1 && ls $CK/zero_to_fp32
# python -m helpers.convert $CK/ds/step_$K2 $CK/hf --to hf

# %%
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from helpers import set_ds_accelerator  # noqa: E402

set_ds_accelerator()  # before DeepSpeed is imported (by the converter): CPU here, else CUDA
from helpers.convert import read_consolidated  # noqa: E402
from helpers.core import safeload  # noqa: E402

facts.show("deepspeed.zero3_checkpoint_files", "deepspeed.save_16bit_model_weights_only")
ds_ck = CK / "ds" / f"step_{2 * K}"
ours = read_consolidated(ds_ck, checkpoint.read_meta(ds_ck))["model"]
z2f = load_file(str(CK / "zero_to_fp32" / "model.safetensors"))
b16 = safeload.load(ds_ck / "model_16bit.bin", "deepspeed")
dtypes = {name: sorted({str(t.dtype) for t in sd.values()}) for name, sd in (("ours", ours), ("zero_to_fp32", z2f),
                                                                             ("16bit", b16))}
claim("weights for inference agree: zero_to_fp32's file holds the same tensor names as the guide's reading of the "
      "same checkpoint, all fp32 and equal to it, and the 16-bit file the same names, all bf16, equal to them rounded "
      "to bf16",
      ours.keys() == z2f.keys() == b16.keys() and dtypes["zero_to_fp32"] == dtypes["ours"] == ["torch.float32"]
      and dtypes["16bit"] == ["torch.bfloat16"]
      and all(torch.equal(z2f[k], t) and torch.equal(b16[k], t.bfloat16()) for k, t in ours.items()),
      tensors={"ours": len(ours), "zero_to_fp32": len(z2f), "16bit": len(b16)}, dtypes=dtypes)
hf = AutoModelForCausalLM.from_pretrained(CK / "hf", dtype=torch.float32)
claim(f"transformers loads the export (written from step {2 * K}'s DeepSpeed checkpoint) as {type(hf).__name__}, "
      "every tensor equal to the guide's reading",
      converted_from(CK / "hf") == str(ds_ck) and {name for name, _ in hf.named_parameters()} == ours.keys()
      and all(torch.equal(p, ours[name]) for name, p in hf.named_parameters()),
      tensors=len(list(hf.parameters())), params_M=sum(p.numel() for p in hf.parameters()) / 1e6)
export = load_file(CK / "hf" / "model.safetensors")
per_param = (CK / "hf" / "model.safetensors").stat().st_size / ds.summary["num_params"]
claim("the safetensors export holds fp32 weights only: 4 bytes per parameter",
      {str(t.dtype) for t in export.values()} == {"torch.float32"} and abs(per_param - 4) / 4 < 0.05,
      bytes_per_param=round(per_param, 2))

# %% [markdown]
# ## Recap
#
# * A save killed before it finished left a `.tmp` directory that the guide refuses, and the checkpoints
#   before it complete.
# * On 1 rank, a 2-rank checkpoint resumed through DeepSpeed's universal checkpoint, through the
#   guide's conversion and, for FSDP, from its own DCP files, with the same losses (on this CPU,
#   bit for bit).
# * `zero_to_fp32`, the guide's reading and the Hugging Face export hold the same fp32 weights;
#   the 16-bit file holds them rounded to bf16.
#
# Back to the path: `07_throughput`.
