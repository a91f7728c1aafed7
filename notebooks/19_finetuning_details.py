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
# # 19 · Deep dive: where a LoRA pair parts
#
# **The question.** In notebook 09 the aligned pair (FSDP `full_shard`, DeepSpeed `zero3`) trained
# a LoRA on `o_proj` and `down_proj` bit for bit on this CPU. Put the adapter on `q_proj` and `v_proj`
# instead: where does the pair part, and why there? (A deep dive from notebook 09, the last of
# the core path.)
#
# **What we run.** The aligned pair twice, at 2 ranks for 3 steps, every trainable (adapter)
# weight, gradient and update traced (`--trace-tensors`; the frozen weights have no gradient): with `launch_configs/peft/lora.json` (`o_proj`, `down_proj`)
# and with `lora_qv.json` (`q_proj`, `v_proj`). Both are rank-8 LoRA.

# %%
import json
import os
import re
from pathlib import Path

from helpers import facts, nb
from helpers.compare import compare, differing
from helpers.core.models import model_config, resolve_model
from helpers.nb import results
from helpers.nb.claims import claim, ran

SIZE = nb.setup()  # "quick" under `make test`: the tiny model
MODEL = "tiny" if SIZE == "quick" else "small"
N = 2  # ranks: one per core here; on a GPU node one per GPU (nccl)
assert nb.world_sizes([N]), f"this notebook needs {N} ranks; this node has {nb.gpu_count()} GPU(s)"
os.environ.update(MODEL=MODEL, N=str(N))
print(f"size={SIZE}: {MODEL} at {N} ranks")

# %% language="bash"
# for LORA in lora lora_qv; do
#   for CFG in fsdp/full_shard deepspeed/zero3; do
#     torchrun --standalone --nproc_per_node $N -m helpers.train --config launch_configs/$CFG.yaml \
#       --out notebooks/runs/19_${LORA}_$(basename $CFG) --model $MODEL --steps 3 --micro-batch 2 --seq-len 64 \
#       --peft launch_configs/peft/$LORA.json --trace-tensors | grep -E "^peft|^done"
#   done
# done

# %% [markdown]
# `helpers.compare` reads both runs' traces and names the first step, stage and parameter where
# they part.

# %%
same = compare("notebooks/runs/19_lora_full_shard", "notebooks/runs/19_lora_zero3")
qv = compare("notebooks/runs/19_lora_qv_full_shard", "notebooks/runs/19_lora_qv_zero3")
print("o_proj/down_proj:", same.report(), "\nq_proj/v_proj:", qv.report(), sep="\n")
layers = model_config(resolve_model(MODEL)).num_hidden_layers
runs = [results.load_run(f"notebooks/runs/19_{lora}_{cfg}")
        for lora in ("lora", "lora_qv") for cfg in ("full_shard", "zero3")]
ran(f"the aligned pair, twice: 3 steps at {N} ranks", runs, model=MODEL, steps=3, world_size=N)
lora_tensors = [2 * sum(r.summary["peft"]["adapted"].values()) for r in runs]  # lora_A and lora_B per module
STAGES = ("weight", "grad_local", "grad_reduced", "update")


def traced_by_name(run):
    """Per parameter of run's tensor trace: recorded (a dtype) at every stage of every step, at none, or mixed."""
    steps = [json.loads(x)["params"] for x in (run.path / "tensor_trace.jsonl").read_text().splitlines()]
    seen = {n: {rec[st][1] is not None for t in steps for rec in [t[n]] for st in STAGES} for n in steps[0]}
    return {n: "all" if v == {True} else "none" if v == {False} else "mixed" for n, v in seen.items()}


def adapter_slots(names):  # (layer, module, A/B) of each LoRA tensor's name
    return sorted(tuple(m.groups()) for n in names if (m := re.search(r"\.layers\.(\d+)\..*\.(\w+)\.lora_([AB])\.", n)))


by_name = [traced_by_name(r) for r in runs]
traced = [sorted(n for n, v in t.items() if v == "all") for t in by_name]
expected = [sorted((str(i), m, ab) for i in range(layers) for m in r.summary["peft"]["adapted"] for ab in "AB")
            for r in runs]
claim("rank-8 LoRA on o_proj and down_proj, then on q_proj and v_proj, of every layer, each pair FSDP full_shard and "
      "ZeRO-3; in each run's trace, by name, every adapter tensor (lora_A and lora_B of each adapted module of each "
      "layer) is recorded at every stage of every step, and no other tensor at any",
      [r.summary["peft"]["adapted"] for r in runs] == [{"o_proj": layers, "down_proj": layers}] * 2
      + [{"q_proj": layers, "v_proj": layers}] * 2 and all(r.summary["peft"]["config"]["r"] == 8 for r in runs)
      and [r.summary["config"].split("/", 1)[1] for r in runs] == ["fsdp/full_shard.yaml", "deepspeed/zero3.yaml"] * 2
      and all(set(t.values()) <= {"all", "none"} for t in by_name)
      and all(adapter_slots(tr) == e and all(".lora_" in n for n in tr) and len(tr) == k
              for tr, e, k in zip(traced, expected, lora_tensors, strict=True)),
      traced=[len(t) for t in traced], adapter_tensors=lora_tensors,
      untraced=[sum(v == "none" for v in t.values()) for t in by_name])
norms = qv.values["grad_norm"] if qv.values else (0.0, 0.0)
loss = [json.loads(Path(f"notebooks/runs/19_lora_qv_{b}/summary.json").read_text())["losses"][qv.first_step or 0]
        for b in ("full_shard", "zero3")]
print(f"\nq/v pair at step {qv.first_step}: losses {'equal' if loss[0] == loss[1] else 'differ'} ({loss[0]} vs "
      f"{loss[1]}), gradient norms {norms[0]:.7f} vs {norms[1]:.7f} "
      f"(relative difference {abs(norms[0] - norms[1]) / norms[0]:.1e})")
parted = differing(qv.a, qv.b, 1, "grad_local")
for i in range(layers):
    names = sorted(n.split(f".layers.{i}.")[1].removesuffix(".default.weight") for n in parted
                   if f".layers.{i}." in n)
    print(f"layer {i}: step 1's local gradients differ in {names if names else 'none'}")
if nb.bitwise_parity_expected(N):
    claim("LoRA on o_proj/down_proj: the aligned pair is identical for 3 steps, every adapter weight, gradient and "
          "update (the frozen weights have no gradient and are not traced)",
          same.identical and same.tensor is None and all(same.traced)
          and same.untraced == runs[0].summary["audit"]["parameters"] - lora_tensors[0],
          untraced=same.untraced, frozen=runs[0].summary["audit"]["parameters"] - lora_tensors[0])
    parted_slots = adapter_slots(parted)  # (layer, module, A/B) of each differing local gradient
    want = sorted((str(i), m, ab) for i in range(layers - 1) for m in ("q_proj", "v_proj") for ab in "AB")
    claim("LoRA on q_proj/v_proj parts at step 1, in the local gradients of all four q/v adapter tensors (lora_A and "
          "lora_B of q_proj and v_proj) of every layer but the last, and of nothing else; the last layer's agree",
          not qv.identical and qv.tensor.step == 1 and qv.tensor.stage == "grad_local"
          and len(parted) == len(parted_slots) == 4 * (layers - 1) and parted_slots == want,
          parted=len(parted), layers=layers)
    rel = abs(norms[0] - norms[1]) / norms[0]
    claim("the q/v pair parts by a small amount: at step 1 its losses are still equal and its gradient norms differ by "
          "under 1e-3 (relative)", loss[0] == loss[1] and 0 < rel < 1e-3, relative_difference=rel)

# %% [markdown]
# **What it means.** At step 0 the adapter's B matrix is zero (the runs' `init_lora_weights: true`, PEFT's default start; step 0 is bit for bit above), so what the adapter adds to the
# gradient of its input is exactly zero, and adding zero in any order changes nothing. From step 1
# it is not zero (in both runs of the q/v pair, checked below). In Llama's attention `q_proj`, `k_proj` and `v_proj` read the same input (the model's code; not checked
# here), so autograd adds up several
# gradients for it. ZeRO-3 passes the inputs of every module it hooks (the fact below says which) through an autograd function of its
# own <!-- fact: deepspeed.zero3_module_io_autograd_functions -->. Our reading (the order of the
# sums is not traced here): that groups `q_proj`'s two
# gradients (base and adapter) into one sum before the others join. FSDP, which hooks whole units <!-- fact: torch.fsdp2_post_backward_in_autograd_node -->,
# adds all of them in one buffer (also our reading). In bf16, a sum taken in another order can round differently (shown
# below on three constants). That sum
# is the gradient flowing into the layers below, which (our reading) is why at step 1 the last layer's adapters still agree
# and every layer under it parts. An adapter whose input no other module reads, such as `o_proj` or
# `down_proj`, gets just two gradients there (base and adapter), and a sum of two is the same in
# either order (our reading): that pair stayed bit for bit here.

# %%
facts.show("deepspeed.zero3_module_io_autograd_functions")
import torch  # noqa: E402

one, tiny = torch.tensor(1.0, dtype=torch.bfloat16), torch.tensor(2.0**-8, dtype=torch.bfloat16)
orders = {"(1 + 2^-8) + 2^-8": float((one + tiny) + tiny), "1 + (2^-8 + 2^-8)": float(one + (tiny + tiny))}
claim("a demo on three constants (not the runs' numbers): in bf16 the two orders of one sum differ",
      len(set(orders.values())) == 2, left_first=orders["(1 + 2^-8) + 2^-8"], right_first=orders["1 + (2^-8 + 2^-8)"])
zero = "0" * 16  # the trace's fingerprint of an all-zero tensor
starts = {}  # per run of the q/v pair: B weights per step, A's step-0 local gradients
for side, path in (("FSDP", qv.a), ("ZeRO-3", qv.b)):
    trace = [json.loads(line) for line in (path / "tensor_trace.jsonl").read_text().splitlines()]
    starts[side] = ([[rec["weight"] for name, rec in t["params"].items() if ".lora_B." in name] for t in trace],
                    [rec["grad_local"] for name, rec in trace[0]["params"].items() if ".lora_A." in name])
ok = all(all(dt is not None for step in bw for _, dt in step) and all(dt is not None for _, dt in a0)  # None: never
         and all(h == zero for h, _ in bw[0] + a0) and all(h != zero for step in bw[1:] for h, _ in step)  # recorded
         and len(bw) == 3 and len(bw[0]) == len(a0) == 2 * layers for bw, a0 in starts.values())
init = [r.summary["peft"]["config"].get("init_lora_weights") for r in runs]
claim("in both runs of the q/v pair every B matrix is zero at step 0 (each run's init_lora_weights: true), so every A "
      "matrix gets a zero gradient there; at steps 1 and 2 no B matrix is zero (each fingerprint recorded, with its "
      "dtype)", ok and init == [True] * len(runs), b_matrices=len(starts["FSDP"][0][0]), init_lora_weights=init,
      dtypes={"B weight": sorted({str(dt) for bw, _ in starts.values() for _, dt in bw[0]}),
              "A grad_local": sorted({str(dt) for _, a0 in starts.values() for _, dt in a0})})

# %% [markdown]
# ## Recap

# %%
if nb.bitwise_parity_expected(N):
    claim(f"on this CPU, for 3 steps at {N} ranks, the aligned pair trains a LoRA on o_proj/down_proj bit for bit",
          same.identical and same.tensor is None and all(same.traced) and same.steps == 3, steps=same.steps,
          traced_tensors=len(traced[0]))
    claim("with the adapter on q_proj/v_proj it first parts at step 1, by a small amount, in the local gradients of every "
          "layer but the last", qv.first_step == qv.tensor.step == 1 and rel < 1e-3 and parted_slots == want,
          first_step=qv.first_step, relative_difference=rel,
          layers_parted=sorted({int(i) for i, _, _ in parted_slots}), of_layers=layers)

# %% [markdown]
# Why the layers part in that pattern is the reading above, not traced here.
#
# That ends the guide: the core path is `00`-`09`, the deep dives `10`-`14` and `16`-`19`.
