"""helpers.convert on DeepSpeed layouts the guide's jobs never write, checked against DeepSpeed itself.

tests/ds_layouts.py trains a tiny Llama with tied embeddings, a frozen MLP and odd-sized biases for two
steps under ZeRO-3 (several sub-groups per rank) and ZeRO-2 (per-parameter alignment paddings), saves,
converts to FSDP and back, and resumes step 3 from the converted state. Each layout: the weights we read
equal DeepSpeed's own reader (``zero_to_fp32``) bit for bit, the Adam state equals the live engine's,
and the resumed step 3 equals the uninterrupted one.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, job_env

from helpers.convert import read_consolidated
from helpers.core import safeload
from helpers.job.checkpoint import read_meta


@pytest.fixture(scope="module", params=[3, 2], ids=["zero3_subgroups", "zero2_paddings"])
def layout(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"layout{request.param}")
    env = {**job_env(), "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
                           "--nproc_per_node", "2", str(REPO / "tests" / "ds_layouts.py"), str(out),
                           str(request.param)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, request.param


def test_the_layout_is_the_one_meant(layout):
    out, stage = layout
    files = sorted((out / "step_2" / "ds" / "ds").glob("*optim_states.pt"))
    opt = safeload.load(files[0], "deepspeed")["optimizer_state_dict"]
    if stage == 3:
        assert len(opt["fp32_flat_groups"]) >= 3  # a rank's partition in several sub-groups
    else:
        assert sum(opt["param_alignment_paddings"][0]) == 4 * 2  # each 6-element k/v bias padded to 8
    states = safeload.load(sorted((out / "step_2" / "ds" / "ds").glob("*model_states.pt"))[0], "deepspeed")  # rank 0
    assert states["shared_params"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert len(states["frozen_param_shapes"]) == 3


def test_weights_equal_deepspeeds_own_reader(layout):
    out, _ = layout
    ck = out / "step_2"
    ours = read_consolidated(ck, read_meta(ck))["model"]
    safeload.scan(ck, "deepspeed")  # zero_to_fp32 unpickles with weights_only=False: only after the scan passed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ref = get_fp32_state_dict_from_zero_checkpoint(str(ck / "ds"), tag="ds")
    assert set(ref) == set(ours) | {"lm_head.weight"}  # the tied alias, which is not a parameter of its own
    for name, t in ours.items():
        assert torch.equal(ref[name].float(), t), name


def test_adam_state_equals_the_live_engine(layout):
    out, _ = layout
    ck = out / "step_2"
    state = read_consolidated(ck, read_meta(ck))
    truth = safeload.load(out / "truth.pt", "full")
    assert state["optim"]["param_groups"][0]["params"] == list(truth)  # the frozen MLP is not stepped
    assert not any(n.startswith("model.layers.0.mlp.") for n in state["optim"]["state"])
    for name, t in truth.items():
        assert torch.equal(state["model"][name], t["w"]), name
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state["optim"]["state"][name][k], t[k]), (name, k)
        assert float(state["optim"]["state"][name]["step"]) == 2.0


def test_both_ways_and_exact_resume(layout):
    out, _ = layout
    a = read_consolidated(out / "step_2", read_meta(out / "step_2"))
    for other in ("to_fsdp", "back"):  # DeepSpeed -> FSDP (DCP) -> DeepSpeed (full.pt): nothing changes
        b = read_consolidated(out / other, read_meta(out / other))
        assert list(b["model"]) == list(a["model"]) and all(torch.equal(a["model"][k], b["model"][k])
                                                            for k in a["model"])
        for k, s in a["optim"]["state"].items():
            assert all(torch.equal(s[x], b["optim"]["state"][k][x]) for x in ("exp_avg", "exp_avg_sq", "step"))
    losses = json.loads((out / "loss3.json").read_text())
    assert losses["resume"] == losses["save"], losses


def test_deepspeeds_universal_checkpoint_agrees_with_our_reader(layout, tmp_path):
    """DeepSpeed's own ds_to_universal (helpers.convert --to universal) on the same layout: per parameter, its
    fp32 weights, Adam moments and step equal what the guide's converter reads from the native files."""
    from helpers.convert import convert

    out, _ = layout
    ck = out / "step_2"
    convert(str(ck), str(tmp_path / "univ"), "universal")
    ours, theirs = (read_consolidated(p, read_meta(p)) for p in (ck, tmp_path / "univ"))
    for name, t in ours["model"].items():
        assert torch.equal(theirs["model"][name], t), name
    assert ours["optim"]["state"].keys() == theirs["optim"]["state"].keys()
    for name, st in ours["optim"]["state"].items():
        other = theirs["optim"]["state"][name]
        assert torch.equal(st["exp_avg"], other["exp_avg"]) and torch.equal(st["exp_avg_sq"], other["exp_avg_sq"]), name
        assert float(st["step"]) == float(other["step"]), name
