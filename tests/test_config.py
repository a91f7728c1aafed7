"""Every shipped config parses; every kind of bad input gets one clear line and exit 2."""

import json
import subprocess
import sys

import pytest
from conftest import FSDP, REPO, ZERO3, job_env, run_job

from helpers.core.config import ConfigError, load_job_config

SHIPPED = sorted(str(p.relative_to(REPO)) for p in (REPO / "launch_configs").rglob("*.yaml"))


def world_size_for(path: str) -> int:
    """Hybrid configs say in their header how many ranks they need."""
    return 4 if "hybrid" in path or "hpz" in path else 2


@pytest.mark.parametrize("path", SHIPPED)
def test_every_shipped_config_parses(path):
    job = load_job_config(str(REPO / path), world_size=world_size_for(path))
    assert job.backend in ("fsdp", "deepspeed")
    first = (REPO / path).read_text().splitlines()[0]
    assert first.startswith("#"), f"{path} must open with a comment giving its launch command"
    assert "torchrun" in (REPO / path).read_text()


def test_aligned_pair_is_what_the_parity_test_needs():
    f, d = load_job_config(str(REPO / FSDP)), load_job_config(str(REPO / ZERO3))
    assert f.fsdp.sharding == "FULL_SHARD" and f.mixed_precision == "bf16"
    assert d.deepspeed.zero_stage == 3 and d.mixed_precision == "bf16"
    assert d.train.grad_clip == 0.0  # explicit in zero3.json: DeepSpeed would clip at 1.0


def check(tmp_path, text: str, *args: str, name="bad.yaml", extra_files=None):
    """Run `python -m helpers.config` on a YAML text; return (exit code, stderr lines)."""
    path = tmp_path / name
    path.write_text(text)
    for fname, content in (extra_files or {}).items():
        (tmp_path / fname).write_text(content)
    proc = subprocess.run([sys.executable, "-m", "helpers.config", str(path), *args], cwd=REPO,
                          env=job_env(), capture_output=True, text=True)
    return proc.returncode, proc.stderr.strip().splitlines()


FSDP_BASE = "distributed_type: FSDP\nmixed_precision: bf16\nfsdp_config:\n  fsdp_version: 2\n"
BAD = {
    "unknown top-level key": ("distributed_type: FSDP\nmixed_precison: bf16\n", ["mixed_precison", "did you mean mixed_precision"]),
    "unknown fsdp key": (FSDP_BASE + "  fsdp_reshard_after_foward: true\n", ["fsdp_config.fsdp_reshard_after_foward", "did you mean fsdp_reshard_after_forward"]),
    "bad enum": ("distributed_type: DEEPSPEED\nmixed_precision: bf16\ndeepspeed_config:\n  zero_stage: 5\n", ["deepspeed_config.zero_stage = 5", "0, 1, 2, 3"]),
    "wrong type": (FSDP_BASE + "  fsdp_offload_params: maybe\n", ["fsdp_config.fsdp_offload_params = 'maybe'", "true or false"]),
    "bad distributed_type": ("distributed_type: MULTI_GPU\n", ["distributed_type = 'MULTI_GPU'", "FSDP, DEEPSPEED"]),
    "bad mixed precision": ("distributed_type: FSDP\nmixed_precision: fp8\n", ["mixed_precision = 'fp8'", "no, bf16"]),
    "malformed yaml": ("distributed_type: FSDP\nfsdp_config: [unclosed\n", ["not valid YAML", "line"]),
    "not a mapping": ("- just\n- a list\n", ["expected a YAML mapping"]),
    "both sharding spellings": (FSDP_BASE + "  fsdp_reshard_after_forward: true\n  fsdp_sharding_strategy: FULL_SHARD\n", ["either fsdp_sharding_strategy or"]),
    "ds file beside inline keys": ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n  zero_stage: 3\n", ["zero_stage must be in the DeepSpeed JSON"]),
    "ds file missing": ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: nowhere.json\n", ["deepspeed_config_file = 'nowhere.json'", "no such file"]),
    "nvme without path": ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n  offload_param_device: nvme\n", ["offload_param_nvme_path"]),
    "wrong section for backend": ("distributed_type: DEEPSPEED\nfsdp_config:\n  fsdp_version: 2\n", ["fsdp_config is given but distributed_type is DEEPSPEED"]),
    "tensor parallel asked": (FSDP_BASE + "parallelism_config:\n  parallelism_config_tp_size: 2\n", ["parallelism_config_tp_size = 2", "allowed: 1"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_one_line_exit_2(tmp_path, case):
    text, needles = BAD[case]
    code, lines = check(tmp_path, text)
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "bad.yaml" in lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_missing_file(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "helpers.config", str(tmp_path / "nope.yaml")],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {tmp_path / 'nope.yaml'}: no such config file"


def test_invalid_json_and_conflicts(tmp_path):
    yaml = "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n"
    code, lines = check(tmp_path, yaml, extra_files={"ds.json": "{\"bf16\": {\"enabled\": true},}"})
    assert code == 2 and "not valid JSON" in lines[0] and "line 1" in lines[0]
    code, lines = check(tmp_path, yaml, extra_files={"ds.json": json.dumps({"bf16": {"enabled": True}, "fp16": {"enabled": True}})})
    assert code == 2 and "fp16.enabled" in lines[0]


def test_hybrid_group_must_divide_world_size(tmp_path):
    text = FSDP_BASE + "  fsdp_reshard_after_forward: true\nparallelism_config:\n  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 2\n"
    assert check(tmp_path, text, "--world-size", "4")[0] == 0
    code, lines = check(tmp_path, text, "--world-size", "6")
    assert code == 2 and "dp_replicate_size (2) x dp_shard_size (2) = 4" in lines[0] and "6 ranks" in lines[0]


def test_cli_override_conflicting_with_deepspeed_json(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 2}}))
    (tmp_path / "c.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n")
    with pytest.raises(ConfigError, match="--grad-accum 2 conflicts with gradient_accumulation_steps = 4"):
        load_job_config(str(tmp_path / "c.yaml"), {"grad_accum": 2})
    assert load_job_config(str(tmp_path / "c.yaml")).train.grad_accum == 4


def test_yaml_clipping_zero_is_dropped_like_accelerate(tmp_path):
    (tmp_path / "c.yaml").write_text("distributed_type: DEEPSPEED\nmixed_precision: bf16\ndeepspeed_config:\n  zero_stage: 3\n  gradient_clipping: 0.0\n")
    job = load_job_config(str(tmp_path / "c.yaml"))
    assert job.train.grad_clip == 1.0 and any("clips at its default 1.0" in n for n in job.notes)


@pytest.mark.parametrize("args,needle", [
    (["--steps", "0"], "--steps = 0: must be >= 1"),
    (["--lr", "-1"], "--lr = -1.0: must be >= 0"),
    (["--model", "huge"], "--model 'huge'"),
    (["--seq-len", "1"], "--seq-len = 1"),
])
def test_train_refuses_bad_overrides_before_starting(tmp_path, args, needle):
    out = tmp_path / "run"
    proc = run_job(FSDP, out, 0, *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines
    assert not out.exists()


def test_torchrun_bad_config_message_once_from_rank_0(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(FSDP_BASE + "  fsdp_offload_params: maybe\n")
    out = tmp_path / "run"
    proc = run_job(str(bad), out, 2)
    assert proc.returncode != 0
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert ours == [f"error: {bad}: fsdp_config.fsdp_offload_params = 'maybe': expected true or false"]
    assert proc.stderr.index("error: ") < (proc.stderr.find("Traceback") % (len(proc.stderr) + 1))
    assert "helpers/" not in proc.stderr  # no traceback through our code
    assert not out.exists()


def test_key_sets_are_accelerates_own():
    """The keys helpers.config reads from Accelerate's source are its ClusterConfig fields and launch options;
    each one is either applied here (a value rule) or has a reason it has no effect. Fails when they drift."""
    import dataclasses

    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    from helpers.core import config_keys as config  # its key tables

    keys = config.accelerate_keys()
    assert keys[""] == {f.name for f in dataclasses.fields(ClusterConfig)}
    groups = {g.title: {a.dest for a in g._group_actions} for g in launch_command_parser()._action_groups}
    for section, (title, prefix) in config._SECTIONS.items():
        want = groups[title] if title else {d for ds in groups.values() for d in ds if d.startswith(prefix)}
        assert keys[section] == want, section
    rules = {"fsdp_config": config._FSDP_KEYS, "deepspeed_config": config._DS_KEYS,
             "parallelism_config": config._PAR_KEYS}
    for section, names in keys.items():
        for k in names:  # every Accelerate key: applied, or a reason to give
            applied = k in config._TOP_READ | set(config._SECTIONS) if section == "" else k in rules.get(section, {})
            assert applied or config.no_effect_reason(section, k), f"{section}.{k}: neither applied nor explained"
        assert set(rules.get(section, {})) <= names, section  # no rule for a key Accelerate does not have
    assert config._TOP_READ <= keys[""] and set(config._NO_EFFECT_KEY) <= set().union(*keys.values())


LISTED = """distributed_type: FSDP
mixed_precision: bf16
tpu_name: my-tpu
fp8_config:
  backend: TE
  fp8_format: E4M3
megatron_lm_config:
  megatron_lm_tp_degree: 2
mpirun_config:
  mpirun_hostfile: hosts
fsdp_config:
  fsdp_version: 2
  fsdp_use_orig_params: true
parallelism_config:
  parallelism_config_cp_backend: torch
  parallelism_config_cp_comm_strategy: allgather
  parallelism_config_sp_backend: deepspeed
  parallelism_config_sp_seq_length: 128
  parallelism_config_sp_seq_length_is_variable: true
  parallelism_config_sp_attn_implementation: sdpa
  parallelism_config_sp_size: 1
"""


def test_every_accelerate_key_is_accepted_with_one_note(tmp_path):
    (tmp_path / "c.yaml").write_text(LISTED)
    job = load_job_config(str(tmp_path / "c.yaml"))
    from helpers.core.config import unapplied_notes

    notes = unapplied_notes(job)
    named = [n.split(" = ")[0] for n in notes]
    assert named == ["tpu_name", "fp8_config.fp8_backend", "fp8_config.fp8_format",
                     "megatron_lm_config.megatron_lm_tp_degree", "mpirun_config.mpirun_hostfile",
                     "fsdp_config.fsdp_use_orig_params",
                     "parallelism_config.parallelism_config_cp_backend",
                     "parallelism_config.parallelism_config_cp_comm_strategy",
                     "parallelism_config.parallelism_config_sp_backend",
                     "parallelism_config.parallelism_config_sp_seq_length",
                     "parallelism_config.parallelism_config_sp_seq_length_is_variable",
                     "parallelism_config.parallelism_config_sp_attn_implementation"]  # sp_size 1: applied
    assert all("no effect here: " in n for n in notes)
    code, lines = check(tmp_path, LISTED.replace("sp_size: 1", "sp_size: 2"))
    assert code == 2 and "parallelism_config_sp_size = 2" in lines[0] and "allowed: 1" in lines[0]
    code, lines = check(tmp_path, LISTED.replace("fp8_format", "fp8_fromat"))
    assert code == 2 and "fp8_config.fp8_fromat (did you mean fp8_format?)" in lines[0], lines


def test_job_log_has_one_note_per_unapplied_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text((REPO / FSDP).read_text() + "  fsdp_sync_module_states: true\n")
    out = tmp_path / "run"
    proc = run_job(str(cfg), out, 0, "--model", "tiny", "--steps", "1")
    assert proc.returncode == 0, proc.stderr
    log = (out / "log.txt").read_text().splitlines()
    want = ["compute_environment", "num_machines", "num_processes", "fsdp_config.fsdp_sync_module_states"]
    assert [ln.split(" = ")[0] for ln in log if "no effect here" in ln] == [f"note: {k}" for k in want]
