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
# # 14 · Deep dive: FSDP units, compute during collectives, and compile
#
# **The question.** Notebook 04 showed when each backend's gathers move with prefetch on and off.
# Here: which modules become FSDP units, and what does each choice do to the gathers (DeepSpeed
# asks for no units)? How much of the time a rank both computes and communicates on gloo is only
# inside a collective call? And what does `--compile` do under each backend? (A deep dive from notebook 04; the
# core path goes on with 05.)
#
# **What we run.** Notebook 04's four prefetch settings again and three other FSDP unit choices,
# each a short job with `--profile` (a `torch.profiler` trace of two steps per rank, read by
# `helpers.nb.traces`), into `notebooks/runs/14_*`; at full size also a compiled pair. With
# `--reuse`, a job notebook 04 already ran here (same flags, ranks and code) is copied from its
# run directory instead of trained again, and its line says `reused`; otherwise it runs.
#
# | setting | config in `launch_configs/` |
# |---|---|
# | FSDP, transformer blocks, without and with prefetch | `fsdp/full_shard_no_prefetch.yaml`, `fsdp/full_shard_prefetch.yaml` |
# | ZeRO-3, without and with prefetch | `deepspeed/zero3_no_prefetch.yaml`, `deepspeed/zero3_prefetch.yaml` |
# | FSDP units: size-based, no policy units, no reshard | `fsdp/full_shard_size_wrap.yaml`, `fsdp/full_shard_no_wrap.yaml`, `fsdp/shard_grad_op.yaml` |
# | compiled FSDP and ZeRO-3 (full size only) | `fsdp/full_shard.yaml`, `deepspeed/zero3.yaml` |

# %%
import os
import re
from pathlib import Path

from helpers import facts, nb
from helpers.core.config import load_job_config
from helpers.core.models import resolve_model
from helpers.job import wrap
from helpers.nb import plots, results, traces
from helpers.nb.claims import claim, ran, reused

SIZE = nb.setup()  # "quick" under `make test`: the same cells, smaller batches, no compile section
GPUS = nb.gpu_count()
NPROC = GPUS if GPUS else 2
MODEL = "small" if GPUS and SIZE == "full" else "tiny"  # on a CPU, tiny keeps the profiled jobs short
BATCH = "--micro-batch 4 --seq-len 32" if SIZE == "quick" else "--micro-batch 8 --seq-len 64"
STEPS = 4
ARGS = f"--model {MODEL} --steps {STEPS} {BATCH} --profile"  # --profile records steps 2 and 3
os.environ.update(NPROC=str(NPROC), ARGS=ARGS, SIZE=SIZE)
print(f"size={SIZE}: model {MODEL} on {NPROC} ranks ({'GPU' if GPUS else 'CPU, gloo'}); {ARGS}")

# %% language="bash"
# for cfg in fsdp/full_shard_no_prefetch fsdp/full_shard_prefetch deepspeed/zero3_no_prefetch deepspeed/zero3_prefetch; do
#     torchrun --standalone --nproc_per_node $NPROC -m helpers.train --config launch_configs/$cfg.yaml \
#         --out notebooks/runs/14_$(basename $cfg) $ARGS --reuse notebooks/runs/04_$(basename $cfg) | tail -n 1
# done

# %%
PF = {"FSDP no prefetch": "14_full_shard_no_prefetch", "FSDP prefetch": "14_full_shard_prefetch",
      "ZeRO-3 no prefetch": "14_zero3_no_prefetch", "ZeRO-3 prefetch": "14_zero3_prefetch"}
PF_CONFIG = {"FSDP no prefetch": "fsdp/full_shard_no_prefetch", "FSDP prefetch": "fsdp/full_shard_prefetch",
             "ZeRO-3 no prefetch": "deepspeed/zero3_no_prefetch", "ZeRO-3 prefetch": "deepspeed/zero3_prefetch"}  # the table
pf = {k: results.load_run(f"notebooks/runs/{v}") for k, v in PF.items()}


def profiled(runs, configs, what):
    """Claim the jobs' setup: short, profiled (a trace per rank of steps 2 and 3), and each label's config in the
    table ({label: config}), as the job recorded it."""
    ran(f"{what}: {STEPS} steps of {MODEL}, each rank tracing steps 2 and 3", runs.values(), model=MODEL,
        steps=STEPS, world_size=NPROC, dist_backend="nccl" if GPUS else "gloo", profiled_steps=[2, 3])
    claim(f"{what}: every rank wrote its trace, and each run's recorded config is the one the table gives its label",
          all((r.path / f"trace_rank{i}.json").exists() for r in runs.values() for i in range(NPROC))
          and all(r.summary["config"] == f"launch_configs/{configs[k]}.yaml" for k, r in runs.items()),
          configs={k: r.summary["config"].split("/", 1)[1] for k, r in runs.items()})


profiled(pf, PF_CONFIG, "notebook 04's four settings")
reused("a job reused from notebook 04 is its twin there, with the same config (all but --out), job key and losses; "
       "the others ran here", pf.values(), lambda r: f"notebooks/runs/04{r.name[2:]}")

# %% [markdown]
# ## 1 · The unit choice: what FSDP asks you and DeepSpeed does not
#
# `fsdp_auto_wrap_policy` decides which modules become units, as `accelerate launch` decides with
# `fsdp_version: 2` (`helpers.job.wrap` calls Accelerate's own policy function):
# `TRANSFORMER_BASED_WRAP` one per decoder block (the class comes from the model's
# `_no_split_modules` unless `fsdp_transformer_layer_cls_to_wrap` names it), <!-- fact: accelerate.fsdp2_transformer_policy_units -->
# `SIZE_BASED_WRAP` every module holding *more than* `fsdp_min_num_params` parameters in total,
# children included (so a block and `model.model` become units too, around the smaller units
# inside them), <!-- fact: accelerate.fsdp2_size_policy_counts_children --> `NO_WRAP` no policy units.
# Whatever the policy, Accelerate then gives the input embedding a unit (with tied embeddings it
# joins the tail) and the final norm + head one more, which stays gathered from forward to
# backward, unless the policy has already made them units (`SIZE_BASED_WRAP` here makes
# `lm_head` a unit that reshards like any other); the root takes what is left. <!-- fact: accelerate.fsdp2_embedding_and_tail_units -->
# `fsdp_reshard_after_forward: false` (`shard_grad_op.yaml`) keeps gathered blocks from forward
# to backward. <!-- fact: torch.fsdp2_reshard_after_forward --> DeepSpeed asks for no units: it gathers
# each module's parameters as it runs (`set_z3_leaf_modules` can merge a subtree); thresholds
# decide the rest (with notebook 04's default bucket, one gather for the whole model). <!-- fact: deepspeed.zero3_leaf_modules --> <!-- fact: deepspeed.zero3_gathers_per_module --> <!-- fact: deepspeed.zero3_bucket_gathers_once -->
#
# The "transformer blocks" row is notebook 04's prefetch setting (`full_shard_prefetch.yaml`); the
# other three configs do not set forward prefetch, so their step times and peaks are not a
# like-for-like comparison with it (FSDP's gather and reduce-scatter counts are: prefetch changes neither, checked below).
#
# Where the guide differs from `accelerate launch`, on purpose, the job log says so in a `note:`
# line: with `SIZE_BASED_WRAP` the policy also picks `model.layers` (a `ModuleList`), which
# torch's `fully_shard` refuses (there `accelerate launch` stops with an error), <!-- fact: torch.fsdp2_refuses_modulelist --> <!-- fact: accelerate.size_wrap_picks_module_list -->
# and the final norm sits inside the `model.model` unit, where a unit of its own fails at
# forward; <!-- fact: torch.fsdp2_unit_inside_unit_fails --> the guide
# leaves both to the unit around them.

# %% language="bash"
# for cfg in full_shard_size_wrap full_shard_no_wrap shard_grad_op; do
#     torchrun --standalone --nproc_per_node $NPROC -m helpers.train --config launch_configs/fsdp/$cfg.yaml \
#         --out notebooks/runs/14_$cfg $ARGS | tail -n 1
# done

# %%
WRAP = {"transformer blocks": ("fsdp/full_shard_prefetch", "14_full_shard_prefetch"),
        "size-based": ("fsdp/full_shard_size_wrap", "14_full_shard_size_wrap"),
        "no wrap": ("fsdp/full_shard_no_wrap", "14_full_shard_no_wrap"),
        "blocks, no reshard": ("fsdp/shard_grad_op", "14_shard_grad_op")}
wr = {k: results.load_run(f"notebooks/runs/{d}") for k, (_, d) in WRAP.items()}
units = {k: wrap.check_wrap_policy(load_job_config(f"launch_configs/{c}.yaml"), resolve_model(MODEL))
         for k, (c, _) in WRAP.items()}
utab = traces.collective_table([*wr.values(), pf["ZeRO-3 prefetch"], pf["ZeRO-3 no prefetch"]],
                               labels=[*wr, "ZeRO-3 prefetch", "ZeRO-3 no prefetch"])
utab.insert(1, "units", [len(u) for u in units.values()] + [None, None])
utab.insert(2, "expected_all_gathers", [wrap.expected_collectives(
    u, wr[k].config["fsdp"]["reshard_after_forward"])["all_gathers"] for k, u in units.items()] + [None, None])
utab.insert(3, "expected_reduce_scatters", [wrap.expected_collectives(u, True)["reduce_scatters"]
                                           for u in units.values()] + [None, None])
utab = utab.astype({c: "Int64" for c in ("units", "expected_all_gathers", "expected_reduce_scatters")})  # counts
utab["MB_per_all_gather"] = utab.all_gather_MB / utab.all_gathers
profiled({k: r for k, r in wr.items() if k != "transformer blocks"}, {k: c for k, (c, _) in WRAP.items()},
         "the three other FSDP unit choices")
fwd = {k: r.config["fsdp"]["forward_prefetch"] for k, r in wr.items()}
claim("of the four unit choices only the transformer-blocks row (04's prefetch config) sets forward prefetch",
      fwd == {k: k == "transformer blocks" for k in wr}, forward_prefetch=fwd)


per_unit = {k: traces.fsdp_gathers_per_step(r) for k, r in wr.items()}
claim("in the size-based job's trace lm_head is a unit of its own, gathered twice per step "
      "like every other unit gathered there; in the blocks row the norm + head unit is gathered once per step",
      per_unit["size-based"].get("lm_head") == 2 and set(per_unit["size-based"].values()) == {2}
      and per_unit["transformer blocks"].get("model.norm, lm_head") == 1,
      size_based=per_unit["size-based"], blocks=per_unit["transformer blocks"])
print("\n".join(ln for ln in (wr["size-based"].path / "log.txt").read_text().splitlines()
                if ln.startswith("note: fsdp_auto_wrap_policy")))  # where the guide differs, the job said so
utab.round(3)

# %%
fig, (left, right) = plots.plt.subplots(1, 2)
plots.collective_bars(utab, ax=left)
plots.backend_bars(right, list(utab.index), list(utab.peak_allocated_MB), ["fsdp"] * len(wr) + ["deepspeed"] * 2,
                   zero=False)
right.tick_params(axis="x", rotation=20, labelsize=8)
right.set(ylabel="MB", title="peak allocated, rank 0 (profiled steps)")
fig.tight_layout()

# %% [markdown]
# **Reading it.** Smaller units mean more, smaller all-gathers; without policy units the root
# gathers every decoder block at once (`largest_all_gather_MB`) and, during forward and
# backward, every rank holds all of them (by design: not measured). <!-- fact: torch.fsdp2_root_takes_the_rest --> <!-- fact: accelerate.fsdp2_keeps_root_tail_gathered --> Not resharding
# after forward saves the backward gathers and (by design) keeps the blocks gathered in between. <!-- fact: torch.fsdp2_reshard_after_forward --> We claim nothing from the allocator's peak between unit choices (one job each, and
# identical jobs' peaks differ: `18_fit_details`). The counts and sizes are exactly what the units predict:

# %%
rows = utab.loc[list(wr)]
want_mb = {k: wrap.expected_collectives(u, wr[k].config["fsdp"]["reshard_after_forward"])["all_gather_bytes"] / 1e6
           for k, u in units.items()}
exact = ((rows.all_gathers == rows.expected_all_gathers).all()
         and (rows.reduce_scatters == rows.expected_reduce_scatters).all()
         and all(abs(rows.all_gather_MB[k] - want_mb[k]) * 1e6 < 1 for k in rows.index))  # bytes: to the byte
claim("every unit choice's collectives are exactly what its units predict, in count and in bytes gathered (to the "
      "byte)", exact, all_gathers=rows.all_gathers.astype(int).to_dict(),
      expected=rows.expected_all_gathers.astype(int).to_dict(),
      all_gather_bytes=(rows.all_gather_MB * 1e6).round().astype(int).to_dict(),
      expected_bytes={k: round(v * 1e6) for k, v in want_mb.items()})
smaller = (utab.loc["size-based", "units"] > utab.loc["transformer blocks", "units"]
           and utab.loc["size-based", "all_gathers"] > utab.loc["transformer blocks", "all_gathers"]
           and utab.loc["size-based", "MB_per_all_gather"] < utab.loc["transformer blocks", "MB_per_all_gather"])
claim("smaller units mean more, smaller all-gathers (size-based against transformer blocks)", smaller,
      units=utab.units[:2].to_dict(), all_gathers=utab.all_gathers[:2].astype(int).to_dict(),
      MB_per_gather=utab.MB_per_all_gather[:2].round(4).to_dict())
blocks_mb = units["no wrap"][-1].num_params * 2 / 1e6  # the root: all decoder blocks
model_mb = sum(u.num_params for u in units["transformer blocks"]) * 2 / 1e6  # the whole model in bf16
root_all = (utab.loc["no wrap", "units"] == 3
            and abs(utab.loc["no wrap", "largest_all_gather_MB"] - blocks_mb) < 1e-3 and blocks_mb > 0.5 * model_mb)
claim("without policy units there are 3 units (embedding, norm + head, the root) and the root gathers every "
      "decoder block at once", root_all,
      largest_gather_MB=utab.loc["no wrap", "largest_all_gather_MB"], blocks_MB=blocks_mb)
pft = traces.collective_table([pf["FSDP no prefetch"], pf["FSDP prefetch"]], labels=["no prefetch", "prefetch"])
claim("FSDP's counts do not depend on prefetch (so the other unit choices' counts compare with the blocks row)",
      (pft.all_gathers.nunique(), pft.reduce_scatters.nunique()) == (1, 1),
      all_gathers=pft.all_gathers.astype(int).to_dict(), reduce_scatters=pft.reduce_scatters.astype(int).to_dict())
regathered = sum(v - 1 for v in per_unit["transformer blocks"].values())  # units gathered again in backward
saved = int(utab.loc["transformer blocks", "all_gathers"] - utab.loc["blocks, no reshard", "all_gathers"])
no_reshard = saved == regathered > 0 and set(per_unit["blocks, no reshard"].values()) == {1}
claim("not resharding after forward saves exactly the backward gathers: the no-reshard job gathers each unit once "
      "per step, and its saving equals the units the blocks row gathers a second time", no_reshard,
      no_reshard=int(utab.loc["blocks, no reshard", "all_gathers"]),
      reshard=int(utab.loc["transformer blocks", "all_gathers"]), gathered_again_with_reshard=regathered,
      per_unit_no_reshard=per_unit["blocks, no reshard"])
log = (wr["size-based"].path / "log.txt").read_text()
claim("the size-based job's log says where the guide differs from accelerate launch",
      "model.layers (ModuleList) passes Accelerate's policy" in log and "model.norm is inside a unit" in log)

# %% [markdown]
# ## 2 · Computing and communicating at the same time
#
# The time a rank was both computing and communicating (`traces.overlap_ms`). On gloo, do not
# read all of it as overlap: FSDP2 reduces gradients from the backward of an autograd node,
# `RegisterPostBackwardFunction`, <!-- fact: torch.fsdp2_post_backward_in_autograd_node -->
# and ZeRO-3 gathers for backward from another, `PreBackwardFunctionForModule`; <!-- fact: deepspeed.zero3_backward_gather_in_autograd_node -->
# the compute lane counts such a node as compute for as long as the training thread is in it.
# `traces.overlap_in_calls_ms` is the part of "both at once" inside any compute-lane operator
# in which the training thread itself called a collective (the trace nests the call in it),
# and the cell splits it off from the rest.
# (ZeRO-3's gathers are asynchronous, FSDP2's synchronous.) <!-- fact: deepspeed.zero3_async_all_gather --> <!-- fact: torch.fsdp2_gathers_synchronous -->
# So the check is on ZeRO-3's rows; FSDP's are printed as context.
# On a GPU (not checked here) it is the overlap prefetch buys. <!-- fact: torch.gpu_collectives_own_stream -->

# %%
facts.show("torch.fsdp2_post_backward_in_autograd_node", "deepspeed.zero3_backward_gather_in_autograd_node")
in_calls = {}
for name, r in pf.items():
    busy, both = traces.busy_ms(r), traces.overlap_ms(r)
    inside = None if GPUS else traces.overlap_in_calls_ms(r)  # CPU traces only (a GPU's compute lane is kernels)
    if both > 1 and inside is not None:
        in_calls[name] = round(inside / both, 3)
    print(f"{name:20s} comm {busy['comm']:7.1f} ms, compute {busy['compute']:7.1f} ms, both at once "
          f"{both:7.1f} ms (rank 0, {len(r.summary['profiled_steps'])} steps), of it inside an operator that "
          f"called a collective: {'-' if inside is None else f'{inside:.1f} ms'}")
zero_in = {k: v for k, v in in_calls.items() if k.startswith("ZeRO-3")}
waiting = bool(zero_in) and all(v > 0.75 for v in zero_in.values())  # a share of timings: 0.89 to over 0.99 in runs so far
if not GPUS:
    print("FSDP rows, context, not a test (FSDP2's gathers are synchronous: the thread waits in each):",
          {k: v for k, v in in_calls.items() if k not in zero_in})
    claim("ZeRO-3 rows with over 1 ms of both at once (here: " + ", ".join(zero_in) + "): over 75% of "
          "that time fell inside an operator in which the training thread itself called a collective (our reading: "
          "mostly waiting, not compute beside a transfer)", waiting, share_inside=zero_in,
          rows_under_1ms=[k for k in pf if k.startswith("ZeRO-3") and k not in zero_in])

# %% [markdown]
# ## 3 · `--compile`
#
# `helpers.train --compile` compiles each decoder block in place *before* `fully_shard` (FSDP2; the code, not checked here);
# FSDP's hooks (gather before, reshard after) then run inside the compiled call, but torch marks
# them dynamo-disabled, so they stay out of the graph. <!-- fact: torch.fsdp2_hooks_not_compiled --> On
# DeepSpeed it calls the engine's `compile()`, which compiles the wrapped module. <!-- fact: deepspeed.engine_compile_module -->
# ZeRO-3 keeps two per-module hooks out of dynamo (the pre-forward gather and the post-backward
# release); its other hooks, the backward gather's setup among them, are traced: <!-- fact: deepspeed.zero3_hooks_and_dynamo -->
# they change from call to call (each warning names the guard that failed), so dynamo recompiles until its recompile limit (the fact
# printed below) and then leaves them eager, <!-- fact: torch.dynamo_recompile_limit --> with a warning the cells count.
#
# Why FSDP1 needed `fsdp_use_orig_params: true` for this: FSDP1 flattened a unit's parameters
# into one `FlatParameter`; `use_orig_params=True` kept the original `nn.Parameter`s visible,
# and torch requires it to use `torch.compile` with FSDP1. <!-- fact: torch.fsdp1_use_orig_params_for_compile -->
# FSDP2 never flattens: every parameter stays itself (a `DTensor` shard), so there is nothing to
# ask for, <!-- fact: torch.fsdp2_params_stay_dtensors --> and Accelerate ignores the key under
# `fsdp_version: 2`. <!-- fact: accelerate.fsdp2_ignores_use_orig_params -->
#
# Compiling costs a long first step (the first call traces and compiles: <!-- fact: torch.compile_on_first_call -->
# the first step's time is printed below), so this section runs at full size only (`GUIDE_SIZE=quick` skips it; the
# committed notebook shows the full run, on the tiny model). On this CPU we check that
# compiled training trains, that the two backends stay close, that the first step carries the
# compile time, and which functions dynamo gave up on.

# %% language="bash"
# if [ "$SIZE" = full ]; then
#   for cfg in fsdp/full_shard deepspeed/zero3; do
#     out=notebooks/runs/14_compile_$(basename $cfg)
#     torchrun --standalone --nproc_per_node $NPROC -m helpers.train --config launch_configs/$cfg.yaml \
#         --out $out --model tiny --steps 6 --compile 2> $out.stderr | tail -n 1
#     grep '^error' $out.stderr  # a failed job says why here
#     echo "  dynamo recompile-limit warnings (all ranks): $(grep -c 'recompile_limit' $out.stderr)"
#   done
# else
#   echo "GUIDE_SIZE=quick: compile section skipped (it runs at the full size)"
# fi

# %%
if SIZE == "full":
    comp = {k: results.load_run(f"notebooks/runs/14_compile_{k}") for k in ("full_shard", "zero3")}
    ran("the compiled pair: 6 steps of the tiny model each, compiled", comp.values(), model="tiny", steps=6,
        compile=True, world_size=NPROC)
    claim("the compiled pair ran the table's two configs", [r.summary["config"] for r in comp.values()]
          == ["launch_configs/fsdp/full_shard.yaml", "launch_configs/deepspeed/zero3.yaml"],
          configs=[r.summary["config"] for r in comp.values()])
    for k, r in comp.items():
        t = r.metrics.step_time_s
        print(f"{k:10s} compiled: first step {t.iloc[0]:6.1f} s (compiling), then median {t.iloc[1:].median():.2f} s (steps 1-5); "
              f"final loss {r.summary['final_loss']:.4f}")
    f, d = (comp[k].summary["losses"] for k in ("full_shard", "zero3"))
    gap = max(abs(a - b) for a, b in zip(f, d))
    alike = gap < 5e-3  # under 1e-3 in runs so far (the compiled pair runs at full size only)
    claim("compiled FSDP and DeepSpeed train alike (within 0.005 per step; uncompiled they are bit-identical, "
          "notebook 02; compiled, each side runs its own graphs: per block vs the whole wrapped model)",
          alike, max_gap=gap)
    learn = all(x[-1] < x[0] - 0.5 for x in (f, d))
    claim("both compiled runs learn (loss down by over 0.5)", learn, fsdp=[f[0], f[-1]], deepspeed=[d[0], d[-1]])
    def first(r):
        """step 0's time over step 1's."""
        return r.metrics.step_time_s.iloc[0] / r.metrics.step_time_s.iloc[1]

    plain = {"full_shard": pf["FSDP prefetch"], "zero3": pf["ZeRO-3 prefetch"]}  # uncompiled; profiled from step 2
    ratio = {k: (round(first(comp[k]), 1), round(first(plain[k]), 2)) for k in comp}
    # step 0 / step 1: compiled several times over 3, uncompiled under 2 in runs so far (full size only)
    slow_first = (all(c > 3 and u < 2 for c, u in ratio.values())
                  and all(comp[k].summary["tokens_per_step"] == plain[k].summary["tokens_per_step"] for k in comp))
    claim("the first step carries the compile time: compiled, step 0 takes over 3x step 1; uncompiled (this "
          "notebook's prefetch jobs, same model and tokens per step), under 2x", slow_first,
          step0_over_step1_compiled_uncompiled=ratio)
    facts.show("torch.dynamo_recompile_limit")
    # each warning names the function dynamo gave up on on its next line: "function: 'NAME' (FILE:LINE)"
    gave_up = {k: re.findall(r"recompile_limit.*\n.*function: '(\w+)' \(([^:]+)",
                             Path(f"notebooks/runs/14_compile_{k}.stderr").read_text()) for k in comp}
    print({k: sorted({f"{name} ({Path(f).parent.name}/{Path(f).name})" for name, f in v}) for k, v in gave_up.items()})
    only_zero = (bool(gave_up["zero3"]) and all("deepspeed/runtime/zero/" in f for _, f in gave_up["zero3"])
                 and not gave_up["full_shard"])
    raw = {k: Path(f"notebooks/runs/14_compile_{k}.stderr").read_text().count("recompile_limit") for k in comp}
    claim("ZeRO-3's per-module hooks (DeepSpeed's zero/ code) hit dynamo's recompile limit, and nothing else did; "
          "FSDP's run never hit it (every warning line parsed)", only_zero
          and raw == {k: len(v) for k, v in gave_up.items()}, warnings={k: len(v) for k, v in gave_up.items()},
          warning_lines=raw)
    # the line after "function:" is the guard that failed on the last call: a value the previous calls did not have
    why = re.findall(r"recompile_limit.*\n.*function: '\w+'.*\n.*last reason: [\d/]+: (.+?)\s{2,}#",
                     Path("notebooks/runs/14_compile_zero3.stderr").read_text())
    claim("each of those warnings names the guard that failed on its last call (printed)",
          len(why) == len(gave_up["zero3"]) > 0, warnings=len(gave_up["zero3"]), guard_lines=len(why),
          guards=sorted({re.sub(r"\d{6,}", "ID", g) for g in why}))
else:
    print("skipped at GUIDE_SIZE=quick")

# %% [markdown]
# ## Recap: measured on this machine

# %%
ran(f"model {MODEL}, {NPROC} ranks, {'GPU (nccl)' if GPUS else 'CPU (gloo)'}",
    [*pf.values(), *(r for k, r in wr.items() if k != "transformer blocks")],  # that one is pf's "FSDP prefetch"
    model=MODEL, world_size=NPROC, dist_backend="nccl" if GPUS else "gloo")
print("units: " + ", ".join(f"{k} {len(units[k])} units -> {int(utab.loc[k, 'all_gathers'])} gathers" for k in wr))
claim("each FSDP unit choice's collectives are exactly what its units predict: smaller units mean more, smaller "
      "gathers; without policy units the root gathers every block at once; not resharding after forward saves the "
      "backward gathers", exact and smaller and root_all and no_reshard,
      all_gathers=rows.all_gathers.astype(int).to_dict(), MB_per_gather=utab.MB_per_all_gather[:2].round(4).to_dict(),
      no_wrap_largest_MB=utab.loc["no wrap", "largest_all_gather_MB"], blocks_MB=blocks_mb)
if not GPUS:
    claim(f"on gloo, in ZeRO-3's rows with over 1 ms of both at once ({', '.join(zero_in)}), over 75% of that time was "
          "inside an operator in which the training thread called a collective (our reading: mostly not overlap)", waiting,
          share_inside=zero_in)
if SIZE == "full":
    claim("compiled, both backends train and stay close; the first step carries the compile time, and only ZeRO-3's "
          "hooks hit dynamo's recompile limit", alike and learn and slow_first and only_zero,
          max_gap=gap, step0_over_step1_compiled_uncompiled=ratio, recompile_warnings={k: len(v) for k, v in gave_up.items()})
else:
    print("compiled pair: skipped at GUIDE_SIZE=quick")

# %% [markdown]
# Back to the path: `05_loading`.
