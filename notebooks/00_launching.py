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
# # 00 · Launching a job: one model, two backends, the same losses
#
# **The question.** You have a training job under PyTorch FSDP and want to move it to
# DeepSpeed ZeRO (or back). Before anything else: can the two backends train *the same
# model on the same data* and produce *the same losses*? If they can, later notebooks compare
# memory and checkpoints of jobs that trained alike; a speed difference counts only once
# repeated step times show it above this machine's noise (notebook 07).
#
# **What we run.** Two real distributed jobs, launched with `torchrun` from `%%bash` cells:
#
# * FSDP2 `fully_shard`, FULL_SHARD, bf16 compute on fp32 shards (`launch_configs/fsdp/full_shard.yaml`) <!-- fact: accelerate.fsdp2_bf16_fp32_shards -->
# * DeepSpeed ZeRO-3, bf16 compute with fp32 master weights (`launch_configs/deepspeed/zero3.yaml`) <!-- fact: deepspeed.zero3_bf16_dtypes -->
#
# **What we look at.** The run directory each job writes, the two loss curves side by
# side, and a check that they are equal step for step.

# %%
import math
import os
import subprocess
import sys
from pathlib import Path

import yaml

from helpers import facts, nb
from helpers.nb import plots, results
from helpers.nb.claims import claim, ran

SIZE = nb.setup()  # "quick" under `make test`: the same cells, fewer steps
STEPS = 12 if SIZE == "quick" else 40
GPUS = nb.gpu_count()
NPROC = nb.nproc()  # every GPU of the node (NCCL needs one GPU per rank; not checked here); on CPU, 2 gloo ranks
# fact: torch.nccl_one_gpu_per_rank
os.environ.update(STEPS=str(STEPS), NPROC=str(NPROC))
print(f"size={SIZE}: {STEPS} steps on {NPROC} ranks ({'nccl on ' + str(GPUS) + ' GPU(s)' if GPUS else 'gloo on the CPU'})")

# %% [markdown]
# ## The configs are Accelerate's own files
#
# Both files use the keys `accelerate launch --config_file` reads, so you can take them to a GPU
# node (set `num_processes` to its GPU count; not run here). <!-- fact: accelerate.launch_config_keys --> Our jobs (by design; not checked here) read the same keys and call the native
# `fully_shard` and `deepspeed.initialize` APIs themselves (on a CPU, Accelerate's own FSDP path
# falls back to no sharding, and `use_cpu: true` turns its DeepSpeed path off). <!-- fact: accelerate.cpu_fsdp_falls_back --> <!-- fact: accelerate.cpu_flag_skips_deepspeed -->

# %%
facts.show("accelerate.cpu_fsdp_falls_back", "accelerate.cpu_flag_skips_deepspeed")
# the file's comments rest on:
# fact: accelerate.fsdp2_bf16_fp32_shards
# fact: accelerate.fsdp2_keeps_root_tail_gathered
# fact: torch.fsdp2_root_reshard
print(Path("launch_configs/fsdp/full_shard.yaml").read_text())

# %% [markdown]
# The DeepSpeed YAML points at a JSON file. That is where we set what a pair needs to train
# identically (notebook 12 runs pairs without it and shows where they part; the linear setting
# matters for layers with biases, which this tiny Llama, by its config, has none of): **`gradient_clipping: 0.0`** (DeepSpeed clips at 1.0 when
# you say nothing, and Accelerate drops a `0.0` written in the YAML), bf16 on, and <!-- fact: deepspeed.gradient_clipping_default --> <!-- fact: accelerate.yaml_clip_zero_dropped -->
# **`memory_efficient_linear: false`** (ZeRO-3 otherwise swaps torch's linear for its own,
# which rounds layers with biases differently on batch x sequence inputs, e.g. Qwen2's: notebook 12). <!-- fact: deepspeed.zero3_swaps_linear --> <!-- fact: deepspeed.zero3_linear_rounds_bias --> <!-- fact: transformers.qwen2_qkv_bias -->

# %%
facts.show("deepspeed.gradient_clipping_default", "accelerate.yaml_clip_zero_dropped", "deepspeed.zero3_swaps_linear",
           "deepspeed.zero3_linear_rounds_bias")
# fact: accelerate.ds_config_file_refuses_keys
print(Path("launch_configs/deepspeed/zero3.yaml").read_text())
print(Path("launch_configs/deepspeed/zero3.json").read_text())

# %% [markdown]
# A config is checked before training starts. `python -m helpers.config` runs the
# same check on its own, so you can validate an edited file first. Its `note:` lines name the
# keys that have no effect here (the three that only `accelerate launch` reads, to start the
# processes, are in every shipped YAML): <!-- fact: accelerate.launch_only_keys -->

# %% language="bash"
# python -m helpers.config launch_configs/fsdp/full_shard.yaml --world-size $NPROC
# python -m helpers.config launch_configs/deepspeed/zero3.yaml --world-size $NPROC

# %% [markdown]
# ## Launching
#
# `torchrun` starts `NPROC` copies of `helpers.train`; each learns its `RANK` and
# `WORLD_SIZE` from the environment. <!-- fact: torch.torchrun_sets_rank_env --> `--standalone` picks a free local port, so two
# notebooks can launch at once (not run here). <!-- fact: torch.standalone_free_port --> With no GPU visible the job uses gloo on the CPU (and
# tells DeepSpeed `DS_ACCELERATOR=cpu`, in `helpers.set_ds_accelerator`: the code, not checked here <!-- fact: deepspeed.ds_accelerator_env -->); with GPUs it uses nccl on CUDA, and nothing in the
# command changes (not run here).

# %% language="bash"
# torchrun --standalone --nproc_per_node $NPROC -m helpers.train \
#     --config launch_configs/fsdp/full_shard.yaml --out notebooks/runs/00_fsdp \
#     --model tiny --steps $STEPS

# %% language="bash"
# torchrun --standalone --nproc_per_node $NPROC -m helpers.train \
#     --config launch_configs/deepspeed/zero3.yaml --out notebooks/runs/00_deepspeed \
#     --model tiny --steps $STEPS

# %% [markdown]
# On more than one machine the same command takes `--nnodes`, a `--node_rank` and a
# rendezvous address instead of `--standalone`; the job code does not change (not run here). <!-- fact: torch.multinode_static_rdzv -->
#
# ## What a run directory holds
#
# The cells in this section read the files, never the printed output (a statement about their code).

# %%
fsdp, ds = results.load_runs("notebooks/runs/00_fsdp", "notebooks/runs/00_deepspeed")
ran(f"both jobs trained the tiny model for {STEPS} steps on {NPROC} ranks ({'nccl' if GPUS else 'gloo on the CPU'}), "
    "bf16, without --deterministic", [fsdp, ds], model="tiny", steps=STEPS, world_size=NPROC, mixed_precision="bf16",
    deterministic=False,
    **({"dist_backend": "nccl"} if GPUS else {"dist_backend": "gloo", "device": "cpu"}))
files = {r.name: sorted(p.name for p in r.path.iterdir()) for r in (fsdp, ds)}
claim("each run directory holds config.json, log.txt, metrics.jsonl and summary.json, nothing else",
      all(f == ["config.json", "log.txt", "metrics.jsonl", "summary.json"] for f in files.values()), **files)
logs = {r.name: (r.path / "log.txt").read_text() for r in (fsdp, ds)}
launch_only = {"compute_environment", "num_machines", "num_processes"}
shipped = sorted(Path("launch_configs").glob("*/*.yaml"))
claim("both jobs noted (in their log.txt) the same three launch-only keys, and every shipped YAML has them",
      all(set(r.config["unapplied"]) == launch_only
          and all(f"note: {k} = " in logs[r.name] for k in launch_only) for r in (fsdp, ds))
      and all(launch_only <= set(yaml.safe_load(f.read_text())) for f in shipped),
      noted=sorted(fsdp.config["unapplied"]), yamls=len(shipped))
empty = [c for c in ("updated_fraction", "updated_fraction_compute") if all(r.metrics[c].isna().all() for r in (fsdp, ds))]
claim("the updated_fraction columns stay empty: both logs say the jobs ran without --track-updates (notebook 02 "
      "uses it)", len(empty) == 2 and all("pass --track-updates" in log for log in logs.values()),
      empty=empty)
fsdp.metrics.head()

# %%
fd, dd = fsdp.summary["dtypes"], ds.summary["dtypes"]
claim("the jobs ran FSDP FULL_SHARD on fp32 shards and ZeRO-3 on bf16 partitions with fp32 master weights, "
      "both computing in bf16", (fsdp.summary["mode"], ds.summary["mode"]) == ("FULL_SHARD", "ZeRO-3")
      and (fd["stored_param"], fd["forward_weight"]) == ("fp32", "bf16")
      and (dd["stored_param"], dd["master_param"], dd["forward_weight"]) == ("bf16", "fp32", "bf16"),
      fsdp=[fd["stored_param"], fd["forward_weight"]], ds=[dd["stored_param"], dd["master_param"], dd["forward_weight"]])
results.summary_table([fsdp, ds])

# %% [markdown]
# ## The two backends, side by side

# %%
fig, (left, right) = plots.plt.subplots(1, 2)
plots.loss_curves([fsdp, ds], ax=left, title="loss per step"
                  + (" (the lines overlap)" if nb.bitwise_parity_expected(NPROC) else ""))
plots.loss_difference(fsdp, ds, ax=right)
fig.tight_layout()

# %% [markdown]
# **What it means.** The curves lie on top of each other and the difference is zero at
# every step: FSDP with `mixed_precision: bf16` (fp32 shards, bf16 compute) and ZeRO-3
# (bf16 module, fp32 master partitions) do the same arithmetic (our reading of the identical
# losses, and of the same dtype at the six compute stages checked below; what each stores differs:
# its shards, printed above; the deep dive
# `12_parity` traces the tensors of pairs that part). <!-- fact: accelerate.fsdp2_bf16_fp32_shards --> <!-- fact: deepspeed.zero3_bf16_dtypes -->
# The cell below checks
# this, so the claim fails loudly if it ever stops being true. (Measured on the CPU with
# gloo. On a GPU these jobs run without `--deterministic`, so the cell checks that the losses
# agree within 1e-2 instead; bit for bit there would need `--deterministic` on at most 2 GPUs
# (beyond 2, nccl may sum in another order). Written for, not yet run on, GPUs:
# `nb.bitwise_parity_expected`.) <!-- fact: torch.nccl_sum_order -->
#
# A one-step bump in the loss curves? The deep dive `10_launching_details` ties it to the learning rate, in its runs.

# %%
facts.show("accelerate.fsdp2_bf16_fp32_shards", "deepspeed.zero3_bf16_dtypes")
losses = fsdp.summary["losses"]
gap = max(abs(a - b) for a, b in zip(losses, ds.summary["losses"], strict=True))
exact = nb.bitwise_parity_expected(NPROC)
same = len(losses) == STEPS and (losses == ds.summary["losses"] if exact else gap < 1e-2)
agree = "give identical losses" if exact else "losses agree within 1e-2"
claim(f"FSDP and ZeRO-3 {agree} at all {STEPS} steps", same, max_gap=gap)
STAGES = ("forward_weight", "grad_before_reduce", "reduce_dtype", "optimizer_param", "optimizer_grad", "optimizer_states")
claim("the jobs' probes (one weight of decoder layer 0) record the same dtype at each of these six stages of the "
      "computation, and FSDP's shard is in the dtype of ZeRO-3's master, fp32", all(fd[k] == dd[k] for k in STAGES) and fd["stored_param"] == dd["master_param"] == "fp32",
      **{k: fd[k] for k in STAGES}, fsdp_shard=fd["stored_param"], ds_master=dd["master_param"])
if SIZE == "full":  # 40 steps: past ln 97, the loss of a uniform guess among the 97 token ids the data uses
    claim("the model learns: its final loss is over 1 below ln 97, a uniform guess among the data's 97 token ids",
          fsdp.summary["final_loss"] <
          math.log(97) - 1, first=losses[0], ln_97=math.log(97), final=fsdp.summary["final_loss"])
else:
    claim("the model learns: the final loss is over 0.5 below the first", fsdp.summary["final_loss"] <
          losses[0] - 0.5, first=losses[0], final=fsdp.summary["final_loss"])
rises = [i for i in range(1, len(losses)) if losses[i] > losses[i - 1] + 0.1]
b = rises[0] if rises else 1
if NPROC == 2 and not GPUS:  # measured on CPU/gloo at 2 ranks (notebook 10 ties it to the rate there)
    claim(f"the loss curves have one one-step bump: step {b} rises over 0.1 above step {b - 1}, step {b + 1} is back "
          f"within 0.05 of step {b - 1}", len(rises) == 1 and b + 1 < len(losses)
          and abs(losses[b + 1] - losses[b - 1]) < 0.05, rises=rises, losses=losses[b - 1:b + 2])

# %% [markdown]
# ## When the config is wrong
#
# A typo in a key is refused before the job starts (no run directory, nothing else printed), with one line naming the file and the key,
# and what was meant when a known key is near. (Under `torchrun` the launcher then adds its own failure report; not run here.) <!-- fact: torch.torchrun_failure_report -->

# %%
Path("notebooks/runs").mkdir(parents=True, exist_ok=True)
_ = Path("notebooks/runs/typo.yaml").write_text(
    "distributed_type: FSDP\nmixed_precision: bf16\nfsdp_config:\n  fsdp_reshard_after_foward: true\n"
)
typo = subprocess.run([sys.executable, "-m", "helpers.train", "--config", "notebooks/runs/typo.yaml",
                       "--out", "notebooks/runs/00_typo"], capture_output=True, text=True, timeout=120)
claim("the typo is refused before the job starts: exit status 2, no run directory, one line naming the file, "
      "the key and what was meant", typo.returncode == 2 and not Path("notebooks/runs/00_typo").exists()
      and not typo.stdout and typo.stderr.count("\n") == 1 and all(w in typo.stderr for w in (
          "notebooks/runs/typo.yaml", "fsdp_reshard_after_foward", "did you mean fsdp_reshard_after_forward")),
      exit_status=typo.returncode, lines=typo.stderr.count("\n"))
alone = subprocess.run([sys.executable, "-m", "helpers.config", "notebooks/runs/typo.yaml"], capture_output=True,
                       text=True, timeout=120)
claim("python -m helpers.config, run on its own, gives the same refusal: same line, same exit status",
      (alone.returncode, alone.stderr + alone.stdout) == (typo.returncode, typo.stderr), exit_status=alone.returncode)

# %% language="bash"
# python -m helpers.train --config notebooks/runs/typo.yaml --out notebooks/runs/00_typo || echo "exit status $?"

# %% [markdown]
# ## Recap
#
# What this machine measured (pulled from the run directories):

# %%
for r in (fsdp, ds):
    s = r.summary
    print(f"{r.label:28s} loss {s['losses'][0]:.3f} -> {s['final_loss']:.3f}   "
          f"median step {s['step_time_s'] * 1e3:6.1f} ms   {s['tokens_per_s_per_rank']:7.0f} tokens/s/rank   on {s['device']}")
kinds = {Path(r.summary["config"]).name: (yaml.safe_load(Path(r.summary["config"]).read_text())["distributed_type"],
                                          r.backend) for r in (fsdp, ds)}
print("launch config: (its distributed_type, the backend the job ran; helpers.train picks it from that key)", kinds)
print(f"with the precision settings aligned, FSDP FULL_SHARD and ZeRO-3 {agree} at every step (checked above, "
      f"largest gap {gap})")
print("each job's peak (MFU's denominator), as it recorded it (GFLOP/s):",
      [(r.summary["peak_flops_source"], round(r.summary["peak_flops"] / 1e9, 3)) for r in (fsdp, ds)])

# %% [markdown]
# * Later notebooks read run directories like this one (how their code works; not checked here).
# * The step times above are one run each (the commands above): not a speed comparison of the
#   backends (notebook 07 compares them with repeated steps and says when a difference is
#   above the noise). Nor is MFU, which divides by each job's own peak (printed above).
# * More in the deep dive `10_launching_details`: a bump in the loss, and the learning rate it comes with.
#
# Next: `01_sharding` — what each rank actually holds under each FSDP strategy and ZeRO stage.

# %% [markdown]
# ## Optional: try other settings
#
# Nothing below is part of the story above, and nothing runs until you click **Run**. The
# panel launches the same `torchrun -m helpers.train` jobs into its own run directories
# (`notebooks/runs/panel_00_*`), shows their progress, and redraws the side-by-side plot from
# them. Try another learning rate, the `small` model, or 1 and 4 ranks.

# %%
from helpers.nb import widgets

widgets.ControlPanel("00", {"FSDP FULL_SHARD": "launch_configs/fsdp/full_shard.yaml",
                            "DeepSpeed ZeRO-3": "launch_configs/deepspeed/zero3.yaml"},
                     args="--model tiny --steps $STEPS")
