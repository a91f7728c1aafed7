"""A checkpoint never runs code: every file the guide reads, replaced by a pickle that would write a marker
file when unpickled, is refused by `helpers.convert` and by `--resume` with one line, exit 2, no marker.

Real tiny checkpoints (1 step, 2 ranks) of each kind: FSDP DCP (sharded), FSDP full, DeepSpeed ZeRO-3 with
16-bit weights, DeepSpeed ZeRO-0. Each test copies one, poisons one file, and runs the two commands.
"""

import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import FSDP, REPO, job_env, run_job

from helpers.core import safeload
from helpers.job.checkpoint import read_meta

ONE = ("--model", "tiny", "--steps", "2", "--checkpoint-every", "1")
KINDS = {  # name -> (config that saves it, config that resumes it)
    "sharded": (FSDP, FSDP),
    "full": ("launch_configs/fsdp/full_shard_full_state_dict.yaml", FSDP),
    "zero3": ("launch_configs/deepspeed/zero3_16bit.yaml", "launch_configs/deepspeed/zero3_16bit.yaml"),
    "zero0": ("launch_configs/deepspeed/zero0.yaml", "launch_configs/deepspeed/zero0.yaml"),
}


class Poison:
    """Unpickling this runs ``touch MARKER`` (what a malicious checkpoint would do, less harmlessly)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("safe")
    out = {}
    for name, (cfg, _) in KINDS.items():
        proc = run_job(cfg, base / f"run_{name}", 2, *ONE, "--checkpoint-dir", str(base / name))
        assert proc.returncode == 0, f"{name} failed:\n{proc.stderr[-3000:]}"
        out[name] = base / name / "step_1"
    return out


def poisoned_copy(src, tmp_path, rel, plain=False):
    """A copy of checkpoint ``src`` whose file ``rel`` (a glob) now holds a Poison pickle; returns (dir, marker)."""
    dst, marker = tmp_path / "ckpt", tmp_path / "MARKER"
    shutil.copytree(src, dst)
    target = sorted(dst.glob(rel))[0]
    if plain:  # a bare pickle, not torch.save's zip format
        target.write_bytes(pickle.dumps({"model": Poison(marker)}))
    else:
        torch.save({"model": {"w": torch.zeros(2)}, "extra": Poison(marker)}, target)
    return dst, marker


def refuses(proc, marker, needle):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, f"exit {proc.returncode}:\n{proc.stderr[-2000:]}"
    assert not marker.exists(), "the poisoned pickle ran"
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr[-2000:]
    err = [x for x in lines if x.startswith("error:")]
    assert len(err) == 1 and "refused to load" in err[0] and needle in err[0], proc.stderr[-2000:]
    assert "system" in err[0], err[0]  # names what the file asked for (posix.system / os.system)


def resume(cfg, tmp_path, ckpt):
    """--resume in one process (plain python: the exit status is the job's own, not torchrun's)."""
    return run_job(cfg, tmp_path / "run", 0, "--model", "tiny", "--steps", "3", "--resume", str(ckpt), timeout=300)


def convert(src, dst):
    return subprocess.run([sys.executable, "-m", "helpers.convert", str(src), str(dst), "--to", "deepspeed"],
                          cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=300)


CASES = [  # kind, file inside the checkpoint, plain pickle instead of torch.save
    ("full", "full.pt", False),
    ("full", "full.pt", True),
    ("full", "rng/rank0.pt", False),
    ("sharded", "rng/rank1.pt", True),
    ("zero3", "ds/ds/zero_pp_rank_0_mp_rank_00_model_states.pt", False),
    ("zero3", "ds/ds/*optim_states.pt", False),
    ("zero3", "model_16bit.bin", False),
    ("zero0", "ds/ds/mp_rank_00_model_states.pt", True),
]


@pytest.mark.parametrize("kind,rel,plain", CASES, ids=[f"{k}:{r.split('/')[-1]}{':plain' * p}" for k, r, p in CASES])
def test_poisoned_file_is_refused_by_convert_and_resume(saved, tmp_path, kind, rel, plain):
    ckpt, marker = poisoned_copy(saved[kind], tmp_path, rel, plain)
    name = sorted(ckpt.glob(rel))[0].name
    refuses(convert(ckpt, tmp_path / "out"), marker, name)
    assert not (tmp_path / "out").exists()
    resume_cfg = KINDS[kind][1]
    refuses(resume(resume_cfg, tmp_path, ckpt), marker, name)
    assert not (tmp_path / "run").exists()  # refused before the job started


def test_dcp_metadata_is_read_without_pickle_load(saved, tmp_path):
    """DCP's .metadata is a plain pickle that torch reads with pickle.load: ours allows DCP's classes only."""
    ckpt, marker = tmp_path / "ckpt", tmp_path / "MARKER"
    shutil.copytree(saved["sharded"], ckpt)
    meta = safeload.read_dcp_metadata(ckpt / "dcp")  # the real one reads
    assert meta.state_dict_metadata
    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(Poison(marker)))
    refuses(convert(ckpt, tmp_path / "out"), marker, ".metadata")
    refuses(resume(FSDP, tmp_path, ckpt), marker, ".metadata")


def test_dcp_non_tensor_item_is_read_with_weights_only(saved, tmp_path):
    """The optimizer's hyper-parameters are pickled items inside the .distcp files (torch reads them with
    weights_only=False): a checkpoint whose lr item would run code is refused."""
    import torch.distributed.checkpoint as dcp

    from helpers.convert import read_consolidated

    good = read_consolidated(saved["sharded"], read_meta(saved["sharded"]))
    ckpt, marker = tmp_path / "ckpt", tmp_path / "MARKER"
    shutil.copytree(saved["sharded"], ckpt, ignore=shutil.ignore_patterns("dcp"))
    good["optim"]["param_groups"][0]["lr"] = Poison(marker)
    dcp.save(good, checkpoint_id=str(ckpt / "dcp"), no_dist=True)
    assert not marker.exists()
    refuses(convert(ckpt, tmp_path / "out"), marker, "lr")
    refuses(resume(FSDP, tmp_path, ckpt), marker, "lr")


@pytest.mark.parametrize("kind", list(KINDS))
def test_untouched_checkpoints_read_safely(saved, kind, tmp_path):
    """Every file of a real checkpoint passes the scan, and the safe reader returns all parameters."""
    from helpers.convert import read_consolidated

    meta = read_meta(saved[kind])
    safeload.scan(saved[kind], meta["format"])
    state = read_consolidated(saved[kind], meta)
    assert sorted(state["model"]) == sorted(meta["param_shapes"])
    assert all(set(s) >= {"step", "exp_avg", "exp_avg_sq"} for s in state["optim"]["state"].values())


def test_poisoned_pretrained_bin_is_refused(tmp_path):
    """--model DIR: a pickled pytorch_model.bin that would run code is refused before the job starts;
    a clean one passes the same scan (transformers then reads it with weights_only=True)."""
    from helpers.core.models import model_config, resolve_model

    d, marker = tmp_path / "model", tmp_path / "MARKER"
    model_config(resolve_model("tiny")).save_pretrained(d)
    torch.save({"lm_head.weight": torch.zeros(2)}, d / "pytorch_model.bin")
    assert resolve_model(str(d)).kind == "pretrained"
    torch.save({"lm_head.weight": torch.zeros(2), "x": Poison(marker)}, d / "pytorch_model.bin")
    proc = run_job(FSDP, tmp_path / "run", 0, "--model", str(d), "--steps", "1", timeout=300)
    refuses(proc, marker, "pytorch_model.bin")
    assert not (tmp_path / "run").exists()
