"""Bad input through the real entry point: one `error:` line naming the problem, exit 2, no traceback.

Run with `python -m helpers.train` (the job itself: exactly 2) and, for the
cases that need a real world size or only rank 0 checks, under torchrun (the
launcher turns the 2 into 1 and adds its own failed-worker report, which is
fine; our line comes once, from rank 0, before it).
"""

import json

import pytest
from conftest import FSDP, run_job
from test_config import BAD, FSDP_BASE

DS_FILE = "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n"
HYBRID_2x2 = (FSDP_BASE + "  fsdp_reshard_after_forward: true\nparallelism_config:\n"
              "  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 2\n")


def ds_json(**kw) -> str:
    return json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, **kw})


# name: (launcher, YAML text or None for the shipped FSDP config, {extra file: text}, CLI args, needles)
CASES = {
    **{name: ("python", BAD[name][0], {}, [], BAD[name][1]) for name in (
        "unknown top-level key", "wrong type", "bad enum", "malformed yaml", "not a mapping",
        "ds file beside inline keys")},
    "negative steps": ("python", None, {}, ["--steps", "-3"], ["--steps = -3: must be >= 1"]),
    "steps not an integer": ("python", None, {}, ["--steps", "1.5"], ["argument --steps: invalid int value: '1.5'"]),
    "lr not a number": ("python", None, {}, ["--lr", "abc"], ["argument --lr: invalid float value: 'abc'"]),
    "unknown flag": ("python", None, {}, ["--stepz", "3"], ["unrecognized arguments: --stepz 3"]),
    "negative timeout": ("python", None, {}, ["--timeout", "-5"], ["--timeout = -5.0: must be", "> 0"]),
    "missing config file": ("python", None, {}, ["--config", "{tmp}/nowhere.yaml"],
                            ["{tmp}/nowhere.yaml: no such config file"]),
    "hybrid on one rank": ("python", FSDP_BASE + "  fsdp_sharding_strategy: HYBRID_SHARD\n", {}, [],
                           ["HYBRID_SHARD needs a shard group", "world size 1"]),
    "ds json batch size conflict": ("python", DS_FILE, {"ds.json": ds_json(train_batch_size=7)}, [],
                                    ["train_batch_size = 7", "micro-batch 8 x accumulation 1 x 1 ranks = 8"]),
    "ds json vs cli": ("python", DS_FILE, {"ds.json": ds_json(gradient_accumulation_steps=4)},
                       ["--grad-accum", "2"], ["--grad-accum 2 conflicts with gradient_accumulation_steps = 4"]),
    "ds json fp16": ("python", DS_FILE, {"ds.json": ds_json(fp16={"enabled": True})}, [],
                     ["fp16.enabled = True", "allowed: false"]),
    "ds json zero key typo": ("python", DS_FILE, {"ds.json": ds_json(zero_optimization={
        "stage": 3, "reduce_bucket_sise": 1000})}, [],
        ["DeepSpeed refuses zero_optimization.reduce_bucket_sise = 1000: Extra inputs are not permitted"]),
    "ds json zero value": ("python", DS_FILE, {"ds.json": ds_json(zero_optimization={
        "stage": 3, "reduce_bucket_size": -1})}, [],
        ["DeepSpeed refuses zero_optimization.reduce_bucket_size = -1: Input should be greater than 0"]),
    "ds json scheduler": ("python", DS_FILE, {"ds.json": ds_json(optimizer={"type": "AdamW"}, scheduler={
        "type": "WarmupLR", "params": {"warmup_steps": 5}})}, [],
        ["scheduler.params.warmup_steps: WarmupLR takes warmup_min_lr, warmup_max_lr, warmup_num_steps"]),
    "ds json malformed": ("python", DS_FILE, {"ds.json": '{"bf16": {"enabled": true},}'}, [],
                          ["ds.json: not valid JSON (line 1"]),
    "unknown model": ("python", None, {}, ["--model", "huge"], ["--model 'huge'", "tiny, small, medium"]),
    "model config unreadable": ("python", None, {"m.json": '{"model_type": "gpt2",'}, ["--model", "{tmp}/m.json"],
                                ["--model '{tmp}/m.json': cannot read"]),
    "out is a file": ("python", None, {"afile": "x"}, ["--out", "{tmp}/afile"],
                      ["--out {tmp}/afile: is a file, not a directory"]),
    "out is someone's directory": ("python", None, {"mine/notes.md": "keep me"}, ["--out", "{tmp}/mine"],
                                   ["--out {tmp}/mine: directory exists, is not empty and is not a run directory"]),
    "torchrun: hybrid does not divide": ("torchrun", HYBRID_2x2, {}, [],
                                         ["dp_replicate_size (2) x dp_shard_size (2) = 4", "the job has 2 ranks"]),
    "torchrun: out is a file": ("torchrun", None, {"afile": "x"}, ["--out", "{tmp}/afile"],
                                ["--out {tmp}/afile: is a file, not a directory"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_in_one_line(tmp_path, case):
    launcher, yaml_text, files, args, needles = CASES[case]
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    config = FSDP
    if yaml_text is not None:
        config = str(tmp_path / "bad.yaml")
        (tmp_path / "bad.yaml").write_text(yaml_text)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    needles = [n.replace("{tmp}", str(tmp_path)) for n in needles]
    if "--config" in args:  # the case names its own config
        i = args.index("--config")
        config, args = args[i + 1], args[:i] + args[i + 2:]
    out = tmp_path / "run"
    before = {p: p.read_text() for p in tmp_path.rglob("*") if p.is_file()}

    proc = run_job(config, out, 2 if launcher == "torchrun" else 0, *args, timeout=300)

    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(ours) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in ours[0], (needle, ours[0])
    if launcher == "python":
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines() == ours  # nothing else: no usage, no traceback
        assert "Traceback" not in proc.stdout + proc.stderr
    else:
        assert proc.returncode != 0
        assert "helpers/" not in proc.stderr  # torchrun's report only; no traceback through our code
        assert proc.stderr.index("error: ") < proc.stderr.find("Traceback") % (len(proc.stderr) + 1)
    assert not out.exists()  # nothing was started
    assert all(p.is_file() and p.read_text() == text for p, text in before.items())  # nothing touched
