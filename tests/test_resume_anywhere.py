"""What docs/checkpoints.md promises of a resume, each run for real: the RNG continues, any world size, every stage.

* RNG: a tiny model with attention dropout on, so training draws random numbers every step; a resume
  that skipped the RNG restore would drop other activations and change the losses. The RNG files of a
  straight run and of a resumed one are compared too.
* World size: fp32 jobs (no bf16 rounding of the gradient reductions) save at 2 ranks and resume at 1 and
  4, with the same global batch (8 sequences: micro-batch 8, 4, 2), so the losses agree to float rounding.
  FSDP resumes its own DCP files; DeepSpeed refuses its own files at another world size (the message is
  tested) and resumes them converted; FSDP resumes the converted ``full.pt`` (the full-state path).
* ZeRO-1 (bf16) and ZeRO-0 in fp32: each saves, the converter reads its layout, and the job resumes
  exactly from the converter's output (written back into that stage's own partitions).
"""

import json

import pytest
import torch
from conftest import REPO, run_job, summary

from helpers.convert import convert, read_consolidated
from helpers.core.models import PRESETS
from helpers.job.checkpoint import read_meta

FSDP = "launch_configs/fsdp/full_shard.yaml"
FSDP_FP32 = ("launch_configs/fsdp/full_shard_low_precision.yaml", "--model-dtype", "fp32")
DS_FP32 = ("launch_configs/deepspeed/zero3_fp32.yaml",)
ZERO1 = "launch_configs/deepspeed/zero1.yaml"
MICRO = {1: "8", 2: "4", 4: "2"}  # one global batch of 8 sequences at every world size


def ok(proc, name):
    assert proc.returncode == 0, f"{name} failed:\n{proc.stderr[-3000:]}"


def job(cfg: tuple, out, ws: int, *extra):
    """A tiny fp32 job of 4 steps at ``ws`` ranks (0 = plain python, one rank)."""
    return run_job(cfg[0], out, ws, *cfg[1:], "--model", "tiny", "--steps", "4", "--micro-batch",
                   MICRO[max(ws, 1)], *extra)


SAVE = ("--checkpoint-every", "2", "--checkpoint-dir")


@pytest.fixture(scope="session")
def fsdp_anywhere(tmp_path_factory):
    b = tmp_path_factory.mktemp("fsdp_anywhere")
    ok(job(FSDP_FP32, b / "fsdp", 2, *SAVE, str(b / "fsdp_ck")), "fsdp at 2")
    for name, ws in (("fsdp_1", 0), ("fsdp_4", 4)):
        ok(job(FSDP_FP32, b / name, ws, "--resume", str(b / "fsdp_ck" / "step_2")), name)
    return b


@pytest.fixture(scope="session")
def ds_saved(tmp_path_factory):
    b = tmp_path_factory.mktemp("ds_anywhere")
    ok(job(DS_FP32, b / "ds", 2, *SAVE, str(b / "ds_ck")), "deepspeed at 2")
    return b


@pytest.fixture(scope="session")
def ds_anywhere(ds_saved):
    b = ds_saved
    convert(str(b / "ds_ck" / "step_2"), str(b / "ds_full"), "deepspeed")  # full.pt, any world size
    for name, cfg, ws in (("ds_1", DS_FP32, 0), ("ds_4", DS_FP32, 4), ("fsdp_full_2", FSDP_FP32, 2)):
        ok(job(cfg, b / name, ws, "--resume", str(b / "ds_full")), name)
    return b


def close(got: list, want: list, rel=1e-4) -> bool:
    return len(got) == len(want) and all(g == pytest.approx(w, rel=rel) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("name", ["fsdp_1", "fsdp_4"])
def test_fsdp_resumes_its_dcp_files_at_another_world_size(fsdp_anywhere, name):
    b = fsdp_anywhere
    ref, s = summary(b / "fsdp")["losses"], summary(b / name)
    assert s["world_size"] == int(name[-1]) and s["resumed_from"] == {
        "path": str(b / "fsdp_ck" / "step_2"), "step": 2, "format": "sharded", "backend": "fsdp"}
    assert close(s["losses"], ref[2:]), (s["losses"], ref)


@pytest.mark.parametrize("name", ["ds_1", "ds_4"])
def test_deepspeed_resumes_converted_files_at_another_world_size(ds_anywhere, name):
    b = ds_anywhere
    ref, s = summary(b / "ds")["losses"], summary(b / name)
    assert s["world_size"] == int(name[-1]) and s["resumed_from"]["format"] == "full"
    assert close(s["losses"], ref[2:]), (s["losses"], ref)


def test_fsdp_resumes_a_full_state_dict(ds_anywhere):
    """FSDP's FULL_STATE_DICT path (DeepSpeed's state, converted): rank 0 reads full.pt and broadcasts each
    rank its shard."""
    b = ds_anywhere
    s = summary(b / "fsdp_full_2")
    assert s["backend"] == "fsdp" and s["resumed_from"]["format"] == "full"
    assert close(s["losses"], summary(b / "ds")["losses"][2:]), s["losses"]


def test_deepspeed_refuses_its_own_files_at_another_world_size(ds_saved):
    b = ds_saved
    refused = job(DS_FP32, b / "ds_refused", 0, "--resume", str(b / "ds_ck" / "step_2"))
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and lines == [
        f"error: --resume {b / 'ds_ck' / 'step_2'}: DeepSpeed checkpoint saved by 2 ranks, this job has 1; "
        "convert it (--to deepspeed) to change world size"], refused.stderr[-2000:]
    assert not (b / "ds_refused" / "summary.json").exists()


def test_fp32_backends_agree(fsdp_anywhere, ds_saved):
    """The two fp32 references: FSDP resuming DeepSpeed's state is compared with DeepSpeed's own losses."""
    assert close(summary(fsdp_anywhere / "fsdp")["losses"], summary(ds_saved / "ds")["losses"])


# --------------------------------------------------------------------------- the RNG, with dropout on


@pytest.fixture(scope="session")
def dropout(tmp_path_factory):
    b = tmp_path_factory.mktemp("dropout")
    cfg = dict(PRESETS["tiny"], model_type="llama", attention_dropout=0.1, tie_word_embeddings=False)
    (b / "config.json").write_text(json.dumps(cfg))
    common = ("--model", str(b / "config.json"), "--steps", "4", "--checkpoint-every", "2")
    ok(run_job(FSDP, b / "ref", 2, *common, "--checkpoint-dir", str(b / "ref_ck")), "dropout ref")
    ok(run_job(FSDP, b / "resumed", 2, *common, "--checkpoint-dir", str(b / "res_ck"),
               "--resume", str(b / "ref_ck" / "step_2")), "dropout resume")
    return b


def _rng(path, rank):
    return torch.load(path / "rng" / f"rank{rank}.pt", weights_only=False)


def test_training_draws_random_numbers(dropout):
    """Without this, an RNG restore could not show in any loss: the RNG moves from step 2 to step 4."""
    for rank in (0, 1):
        a, b = _rng(dropout / "ref_ck" / "step_2", rank), _rng(dropout / "ref_ck" / "step_4", rank)
        assert not torch.equal(a["torch"], b["torch"]), rank


def test_resume_continues_the_rng_exactly(dropout):
    ref, res = summary(dropout / "ref"), summary(dropout / "resumed")
    assert res["resumed_from"]["step"] == 2
    assert res["losses"] == ref["losses"][2:]  # bitwise: the same dropout masks
    for rank in (0, 1):
        a, b = _rng(dropout / "ref_ck" / "step_4", rank), _rng(dropout / "res_ck" / "step_4", rank)
        assert torch.equal(a["torch"], b["torch"]) and a["python"] == b["python"], rank


# --------------------------------------------------------------------------- ZeRO-1 and fp32 ZeRO-0


@pytest.fixture(scope="session")
def stages(tmp_path_factory):
    b = tmp_path_factory.mktemp("stages")
    js = json.loads((REPO / "launch_configs/deepspeed/zero0.json").read_text())
    js["bf16"]["enabled"] = False
    (b / "zero0_fp32.json").write_text(json.dumps(js))
    (b / "zero0_fp32.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                       f"  deepspeed_config_file: {b / 'zero0_fp32.json'}\n")
    tiny = ("--model", "tiny", "--steps", "4")
    for name, cfg in (("z1", ZERO1), ("z0", str(b / "zero0_fp32.yaml"))):
        ok(run_job(cfg, b / name, 2, *tiny, "--checkpoint-dir", str(b / f"{name}_ck"), "--checkpoint-every", "2"),
           name)
        convert(str(b / f"{name}_ck" / "step_2"), str(b / f"{name}_full"), "deepspeed")
        ok(run_job(cfg, b / f"{name}_conv", 2, *tiny, "--resume", str(b / f"{name}_full")), f"{name} converted")
    return b


@pytest.mark.parametrize("name", ["z1_conv", "z0_conv"])
def test_zero1_and_fp32_zero0_resume_exactly(stages, name):
    s, ref = summary(stages / name), summary(stages / name.split("_")[0])
    assert s["resumed_from"]["step"] == 2 and s["losses"] == ref["losses"][2:], (s["losses"], ref["losses"])


def test_fp32_zero0_checkpoint_holds_fp32_state(stages):
    meta = read_meta(stages / "z0_ck" / "step_2")
    assert meta["saved_dtypes"] == {"model": ["float32"], "optim": ["float32"]}
    assert summary(stages / "z0")["mixed_precision"] == "no"
    state = read_consolidated(stages / "z0_ck" / "step_2", meta)
    assert {float(s["step"]) for s in state["optim"]["state"].values()} == {2.0}
    assert all(t.dtype == torch.float32 for t in state["model"].values())


# --------------------------------------------------------------------------- DeepSpeed's universal checkpoint
def with_universal(base_json: str, out) -> str:
    """A launch config: ``base_json`` plus ``"checkpoint": {"load_universal": true}`` (DeepSpeed's own key)."""
    js = json.loads((REPO / base_json).read_text())
    js["checkpoint"] = {"load_universal": True}
    name = out / f"{(REPO / base_json).stem}_universal"
    name.with_suffix(".json").write_text(json.dumps(js))
    name.with_suffix(".yaml").write_text(f"distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                         f"  deepspeed_config_file: {name.with_suffix('.json')}\n")
    return str(name.with_suffix(".yaml"))


@pytest.fixture(scope="session")
def universal(ds_anywhere, stages):
    """ZeRO-3 (fp32, saved at 2 ranks) and ZeRO-1 (bf16) checkpoints through DeepSpeed's ds_to_universal
    (helpers.convert --to universal); resumed by DeepSpeed's own loader at 1 and 4 ranks, and at 2."""
    b, s = ds_anywhere, stages
    convert(str(b / "ds_ck" / "step_2"), str(b / "ds_univ"), "universal")
    cfg = with_universal("launch_configs/deepspeed/zero3_fp32.json", b)
    for name, ws in (("univ_1", 0), ("univ_4", 4)):
        ok(job((cfg,), b / name, ws, "--resume", str(b / "ds_univ")), name)
    # the other direction: from the guide's own converted file (full.pt), through DeepSpeed's files at one rank
    convert(str(b / "ds_full"), str(b / "full_univ"), "universal")
    ok(job((cfg,), b / "full_univ_2", 2, "--resume", str(b / "full_univ")), "universal from full.pt")
    convert(str(s / "z1_ck" / "step_2"), str(s / "z1_univ"), "universal")
    ok(run_job(with_universal("launch_configs/deepspeed/zero1.json", s), s / "z1_univ_2", 2, "--model", "tiny",
               "--steps", "4", "--resume", str(s / "z1_univ")), "zero1 universal")
    return b, s


@pytest.mark.parametrize("ws", [1, 4])
def test_universal_checkpoint_resumes_at_another_world_size_as_the_guides_conversion(universal, ws):
    """DeepSpeed's route (ds_to_universal + load_universal) and the guide's (convert --to deepspeed + import)
    restore the same state: the same losses, bit for bit, at 1 and at 4 ranks."""
    b, _ = universal
    s = summary(b / f"univ_{ws}")
    assert s["world_size"] == ws and s["resumed_from"]["format"] == "universal"
    assert s["losses"] == summary(b / f"ds_{ws}")["losses"], (s["losses"], summary(b / f"ds_{ws}")["losses"])


def test_zero1_universal_checkpoint_resumes_exactly(universal):
    _, s = universal
    assert summary(s / "z1_univ_2")["losses"] == summary(s / "z1")["losses"][2:]


@pytest.mark.parametrize("which", ["zero3", "zero1"])
def test_universal_files_hold_the_same_weights_and_adam_state_as_deepspeeds(universal, which):
    """The universal checkpoint's per-parameter fp32 weights, Adam moments and step, against the guide's own
    reader of the native ZeRO files: equal, tensor for tensor."""
    b, s = universal
    native, univ = {"zero3": (b / "ds_ck" / "step_2", b / "ds_univ"), "zero1": (s / "z1_ck" / "step_2",
                                                                             s / "z1_univ")}[which]
    a, u = (read_consolidated(p, read_meta(p)) for p in (native, univ))
    assert a["model"].keys() == u["model"].keys() and a["optim"]["state"].keys() == u["optim"]["state"].keys()
    assert all(torch.equal(a["model"][k], u["model"][k]) for k in a["model"])
    for k, st in a["optim"]["state"].items():
        assert all(torch.equal(st[x], u["optim"]["state"][k][x]) for x in ("exp_avg", "exp_avg_sq"))
        assert float(st["step"]) == float(u["optim"]["state"][k]["step"]) == 2.0


def test_universal_needs_its_key_and_a_deepspeed_source(universal, tmp_path):
    b, _ = universal
    proc = job(DS_FP32, tmp_path / "r", 0, "--resume", str(b / "ds_univ"))
    assert proc.returncode == 2 and "a DeepSpeed universal checkpoint; DeepSpeed reads it when its JSON says " \
        "\"checkpoint\": {\"load_universal\": true}" in proc.stderr
    cfg = with_universal("launch_configs/deepspeed/zero3_fp32.json", tmp_path)
    proc = job((cfg,), tmp_path / "r2", 0, "--resume", str(b / "ds_full"))
    assert proc.returncode == 2 and "checkpoint.load_universal is true in the DeepSpeed JSON, but this is a full " \
        "checkpoint" in proc.stderr
    with pytest.raises(Exception, match="--to universal: .* is a universal checkpoint already"):
        convert(str(b / "ds_univ"), str(tmp_path / "u"), "universal")


def test_a_universal_checkpoint_made_from_the_guides_files_resumes_in_deepspeed(universal):
    """full.pt (the guide's converter output) -> DeepSpeed's ZeRO-3 files at one rank -> ds_to_universal: DeepSpeed's
    loader resumes it at 2 ranks exactly where the straight run was, and it holds the same state as its source."""
    b, _ = universal
    assert summary(b / "full_univ_2")["losses"] == summary(b / "ds")["losses"][2:]
    a, u = (read_consolidated(p, read_meta(p)) for p in (b / "ds_full", b / "full_univ"))
    assert all(torch.equal(a["model"][k], u["model"][k]) for k in a["model"])
    assert all(torch.equal(st[x], u["optim"]["state"][k][x]) for k, st in a["optim"]["state"].items()
               for x in ("exp_avg", "exp_avg_sq"))


def test_dcp_reader_agrees_with_torchs_dcp_to_torch_save(fsdp_anywhere, tmp_path):
    """The converter's DCP reader against torch's own offline tool (format_utils.dcp_to_torch_save): every
    weight and Adam tensor equal."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ck = fsdp_anywhere / "fsdp_ck" / "step_2"
    ours = read_consolidated(ck, read_meta(ck))
    dcp_to_torch_save(str(ck / "dcp"), str(tmp_path / "t.pt"))  # our own checkpoint: trusted, unpickled in full
    theirs = torch.load(tmp_path / "t.pt", weights_only=False)
    assert ours["model"].keys() == theirs["model"].keys() and ours["model"]
    assert all(torch.equal(t, theirs["model"][k]) for k, t in ours["model"].items())
    for k, st in ours["optim"]["state"].items():
        assert all(torch.equal(st[x], theirs["optim"]["state"][k][x]) for x in ("exp_avg", "exp_avg_sq", "step"))
