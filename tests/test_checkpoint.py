"""Checkpoints: exact resume on each backend, FSDP <-> DeepSpeed through helpers.convert, a killed save.

Tiny 2-rank jobs of 6 steps, shared: ZeRO-3 saves at step 3 and is the reference (FSDP and ZeRO 1-3
train bit-identically, see test_train); FSDP saves at 3 and is killed inside the save of step 6.
Then five resumes from step 3: each backend from its own checkpoint, each from the other's, converted,
and the converted FSDP checkpoint under ZeRO-2, which saves again at step 6 (the ZeRO-1/2 layout).
ZeRO-0 trains differently in bf16 (no fp32 gradient reduction), so it gets its own pair: 4 steps saving
at 2, and a resume from the converted step 2.
"""

import json
import subprocess
import sys

import pytest
import torch
from conftest import FSDP, REPO, ZERO3, job_env, run_job, summary

from helpers.convert import convert, read_consolidated
from helpers.job.checkpoint import read_meta

TINY = ("--model", "tiny", "--steps", "6")
ZERO2, ZERO0 = "launch_configs/deepspeed/zero2.yaml", "launch_configs/deepspeed/zero0.yaml"
ZERO3_16BIT = "launch_configs/deepspeed/zero3_16bit.yaml"


def losses(out):
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def ok(proc, name):
    assert proc.returncode == 0, f"{name} failed:\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpt")
    # the reference also writes DeepSpeed's consolidated 16-bit weights (zero3.json + the 16-bit flag)
    ok(run_job(ZERO3_16BIT, base / "ds", 2, *TINY, "--checkpoint-dir", str(base / "ds_ck"), "--checkpoint-every",
               "3"), "deepspeed")
    killed = run_job(FSDP, base / "fsdp", 2, *TINY, "--checkpoint-dir", str(base / "fsdp_ck"), "--checkpoint-every",
                     "3", env={"GUIDE_FAIL_RANK": "1", "GUIDE_FAIL_STEP": "6", "GUIDE_FAIL_PHASE": "save",
                               "GUIDE_FAIL_MODE": "kill"})
    convert(str(base / "fsdp_ck" / "step_3"), str(base / "to_ds"), "deepspeed")
    convert(str(base / "ds_ck" / "step_3"), str(base / "to_fsdp"), "fsdp")
    for name, cfg, src in (("fsdp_resume", FSDP, "fsdp_ck/step_3"), ("ds_resume", ZERO3, "ds_ck/step_3"),
                           ("fsdp_to_ds", ZERO3, "to_ds"), ("ds_to_fsdp", FSDP, "to_fsdp")):
        ok(run_job(cfg, base / name, 2, *TINY, "--resume", str(base / src)), name)
    ok(run_job(ZERO2, base / "fsdp_to_z2", 2, *TINY, "--resume", str(base / "to_ds"), "--checkpoint-dir",
               str(base / "z2_ck"), "--checkpoint-every", "3"), "fsdp_to_z2")
    z0 = ("--model", "tiny", "--steps", "4")
    ok(run_job(ZERO0, base / "z0", 2, *z0, "--checkpoint-dir", str(base / "z0_ck"), "--checkpoint-every", "2"), "z0")
    convert(str(base / "z0_ck" / "step_2"), str(base / "z0_to_ds"), "deepspeed")
    ok(run_job(ZERO0, base / "z0_resume", 2, *z0, "--resume", str(base / "z0_to_ds")), "z0_resume")
    return base, killed


def test_reference_saved_checkpoints(ckpt):
    base, _ = ckpt
    s = summary(base / "ds")
    assert [c["step"] for c in s["checkpoints"]] == [3, 6]
    assert all(c["format"] == "deepspeed" and c["bytes"] > 0 for c in s["checkpoints"])
    assert read_meta(base / "ds_ck" / "step_3")["step"] == 3


@pytest.mark.parametrize("name", ["fsdp_resume", "ds_resume"])
def test_resume_is_exact(ckpt, name):
    base, _ = ckpt
    ref, s = summary(base / "ds")["losses"], summary(base / name)
    assert s["resumed_from"]["step"] == 3
    assert [json.loads(x)["step"] for x in (base / name / "metrics.jsonl").read_text().splitlines()] == [3, 4, 5]
    assert s["losses"] == ref[3:]  # bitwise: 3 + resume + 3 == 6


@pytest.mark.parametrize("name,frm", [("fsdp_to_ds", "fsdp"), ("ds_to_fsdp", "deepspeed")])
def test_cross_backend_resume_is_exact(ckpt, name, frm):
    base, _ = ckpt
    s = summary(base / name)
    assert s["resumed_from"]["backend"] == frm and s["backend"] != frm
    assert s["losses"] == summary(base / "ds")["losses"][3:]


def test_zero2_and_zero0_convert_and_resume_exactly(ckpt):
    """ZeRO-2 imports converted state and continues exactly; its own layout reads back like ZeRO-3's."""
    base, _ = ckpt
    assert summary(base / "fsdp_to_z2")["losses"] == summary(base / "ds")["losses"][3:]
    z2 = read_consolidated(base / "z2_ck" / "step_6", read_meta(base / "z2_ck" / "step_6"))
    z3 = read_consolidated(base / "ds_ck" / "step_6", read_meta(base / "ds_ck" / "step_6"))
    for k in z3["model"]:
        assert torch.equal(z2["model"][k], z3["model"][k]), k
        for s in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(z2["optim"]["state"][k][s], z3["optim"]["state"][k][s]), (k, s)
    # ZeRO-0 (bf16): DeepSpeed's one-master-per-parameter wrapper, out and back in
    assert summary(base / "z0_resume")["losses"] == summary(base / "z0")["losses"][2:]


def test_converter_weights_equal_zero_to_fp32(ckpt):
    """Every ZeRO 1-3 checkpoint the conversions here read: our weights are DeepSpeed's own reader's, bit for bit."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from helpers.core import safeload

    base, _ = ckpt
    for ck in (base / "ds_ck" / "step_3", base / "z2_ck" / "step_6"):
        ours = read_consolidated(ck, read_meta(ck))["model"]
        safeload.scan(ck, "deepspeed")  # zero_to_fp32 unpickles with weights_only=False: only after the scan
        ref = get_fp32_state_dict_from_zero_checkpoint(str(ck / "ds"), tag="ds")
        assert set(ref) == set(ours), ck
        for k, t in ours.items():
            assert torch.equal(ref[k].float(), t), (ck, k)


def test_16bit_save_holds_the_bf16_weights(ckpt):
    """zero3_save_16bit_model: model_16bit.bin, every parameter whole, bf16, the fp32 master rounded."""
    base, _ = ckpt
    p = base / "ds_ck" / "step_3"
    meta = read_meta(p)
    assert meta["saved_dtypes"]["model_16bit"] == ["bfloat16"]
    sd = torch.load(p / "model_16bit.bin", map_location="cpu", weights_only=True)
    master = read_consolidated(p, meta)["model"]
    assert sd.keys() == master.keys()
    for k, w in master.items():
        assert sd[k].dtype == torch.bfloat16 and torch.equal(sd[k], w.to(torch.bfloat16)), k
    assert summary(base / "ds")["checkpoints"][0]["seconds_16bit"] is not None


def test_killed_save_leaves_last_checkpoint(ckpt):
    base, killed = ckpt
    assert killed.returncode != 0
    assert summary(base / "fsdp")["status"] == "failed"
    ck = base / "fsdp_ck"
    assert not (ck / "step_6").exists() and (ck / ".step_6.tmp").is_dir()  # never became visible
    assert read_meta(ck / "step_3")["format"] == "sharded"
    with pytest.raises(ValueError, match="partial checkpoint"):
        read_meta(ck / ".step_6.tmp")
    assert losses(base / "fsdp") == summary(base / "ds")["losses"]  # it trained all 6 steps before the kill


def test_both_backends_save_the_same_state(ckpt):
    """FSDP's DCP and DeepSpeed's ZeRO-3 partitions, read back: the same fp32 weights and Adam state."""
    base, _ = ckpt
    f = read_consolidated(base / "fsdp_ck" / "step_3", read_meta(base / "fsdp_ck" / "step_3"))
    d = read_consolidated(base / "ds_ck" / "step_3", read_meta(base / "ds_ck" / "step_3"))
    assert f["model"].keys() == d["model"].keys()
    for k in f["model"]:
        assert torch.equal(f["model"][k], d["model"][k]), k
        for s in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(f["optim"]["state"][k][s], d["optim"]["state"][k][s]), (k, s)


def test_hf_export_loads_with_transformers(ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    base, _ = ckpt
    convert(str(base / "ds_ck" / "step_3"), str(tmp_path / "hf"), "hf")
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    w = read_consolidated(base / "ds_ck" / "step_3", read_meta(base / "ds_ck" / "step_3"))["model"]
    assert all(torch.equal(p, w[n]) for n, p in m.named_parameters())


def _convert_cli(*args):
    return subprocess.run([sys.executable, "-m", "helpers.convert", *map(str, args)], cwd=REPO, env=job_env(),
                          capture_output=True, text=True, timeout=300)


def test_convert_refuses_bad_input(ckpt, tmp_path):
    base, _ = ckpt
    cases = [
        ((base / "ds", tmp_path / "a", "--to", "fsdp"), "not a checkpoint"),  # a run directory
        ((base / "fsdp_ck", tmp_path / "b", "--to", "fsdp"), "step_3: pass one of those"),
        ((base / "fsdp_ck" / ".step_6.tmp", tmp_path / "c", "--to", "fsdp"), "partial checkpoint"),
        ((base / "ds_ck" / "step_3", tmp_path / "d", "--to", "jax"), "allowed values are fsdp, deepspeed, hf"),
        ((base / "ds_ck" / "step_3", base / "to_fsdp", "--to", "fsdp"), "already exists"),
    ]
    for args, want in cases:
        proc = _convert_cli(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
        assert want in lines[0], lines[0]
    assert not (tmp_path / "d").exists()
    # a checkpoint with a file missing: partial, not a traceback
    broken = tmp_path / "broken"
    convert(str(base / "ds_ck" / "step_3"), str(broken), "deepspeed")
    (broken / "full.pt").unlink()
    proc = _convert_cli(broken, tmp_path / "e", "--to", "fsdp")
    assert proc.returncode == 2 and "partial checkpoint (full.pt is missing)" in proc.stderr


def test_resume_refuses_other_model_and_wrong_backend(ckpt, tmp_path):
    base, _ = ckpt
    # plain python (one rank): the refusal comes before any process group, exit status 2 (torchrun would say 1)
    proc = run_job(FSDP, tmp_path / "m", 0, "--model", "small", "--steps", "6", "--resume", base / "fsdp_ck" / "step_3")
    assert proc.returncode == 2 and "error: --resume" in proc.stderr and "model mismatch: vocab_size 1000" \
        in proc.stderr, proc.stderr[-2000:]
    proc = run_job(FSDP, tmp_path / "w", 0, *TINY, "--resume", base / "ds_ck" / "step_3")
    assert proc.returncode == 2 and "helpers.convert" in proc.stderr
    assert not (tmp_path / "m" / "summary.json").exists()
