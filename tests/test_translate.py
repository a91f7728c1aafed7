"""Config translation (helpers.translate), legacy FSDP1 spellings and DeepSpeed "auto" filling.

The round-trip test globs launch_configs/, so a config added there is checked without editing this file.
"""

import json
import subprocess
import sys

import pytest
from conftest import REPO, job_env, run_job, summary

from helpers.core.config import ConfigError, load_job_config
from helpers.job import recompute
from helpers.translate import check, translate

SHIPPED = sorted(str(p.relative_to(REPO)) for p in (REPO / "launch_configs").rglob("*.yaml"))
FSDP_SHIPPED = [p for p in SHIPPED if load_job_config(str(REPO / p)).backend == "fsdp"]
EXACT_FSDP = [p for p in FSDP_SHIPPED if translate(str(REPO / p), "deepspeed").exact]

# What each compared setting is called in a warning (either leg of the round trip must name it).
FSDP_FIELDS = {
    "sharding": ("sharding", "stage"), "reshard_after_forward": ("sharding", "stage"),
    "hybrid_shard_size": ("hpz", "parallelism", "HYBRID"), "offload_params": ("offload",),
    "state_dict_type": ("state_dict_type", "16bit"), "cpu_ram_efficient_loading": ("loading", "init_flag"),
    "sync_module_states": ("sync_module_states",), "auto_wrap_policy": ("wrap",),
    "forward_prefetch": ("prefetch",), "backward_prefetch": ("prefetch",),
    "activation_checkpointing": ("checkpointing",), "use_orig_params": ("orig_params",),
}
DS_FIELDS = {"zero_stage": ("stage",), "offload_optimizer_device": ("offload",),
             "offload_param_device": ("offload",), "zero3_init_flag": ("init_flag", "loading"),
             "zero3_save_16bit_model": ("16bit", "state_dict_type")}


def settings(job) -> dict:
    """What a config makes the job do, as comparable values."""
    out = {"mixed_precision": job.mixed_precision, "grad_clip": job.train.grad_clip,
           "grad_accum": job.train.grad_accum, "checkpointing": recompute.requested(job)}
    if job.backend == "fsdp":
        out.update({k: getattr(job.fsdp, k) for k in FSDP_FIELDS})
    else:
        out.update({k: getattr(job.deepspeed, k) for k in DS_FIELDS})
        out["hpz"] = job.deepspeed.json.get("zero_optimization", {}).get("zero_hpz_partition_size", 1)
    return out


def named(field: str, warnings: list[str]) -> bool:
    """A warning is *about* a setting when its subject (the text before its first ': ') names it; a word
    further on (another warning's "nearest: ...") does not count."""
    words = {**FSDP_FIELDS, **DS_FIELDS, "mixed_precision": ("mixed_precision", "bf16"),
             "grad_clip": ("clipping",), "grad_accum": ("accumulation",), "hpz": ("hpz", "HYBRID"),
             "checkpointing": ("checkpointing",)}[field]
    return any(w.lower() in msg.split(": ", 1)[0].lower() for msg in warnings for w in words)


@pytest.mark.parametrize("path", SHIPPED)
def test_round_trip_every_shipped_config(path, tmp_path):
    """There and back: both outputs validate, and every setting that changed was warned about."""
    src = load_job_config(str(REPO / path))
    other = "deepspeed" if src.backend == "fsdp" else "fsdp"
    there = translate(str(REPO / path), other)
    check(there, str(tmp_path / "there.yaml"))
    back = translate(str(tmp_path / "there.yaml"), src.backend)
    job = check(back, str(tmp_path / "back.yaml"))
    warnings = there.warnings + back.warnings
    before, after = settings(src), settings(job)
    for field, value in before.items():
        if after[field] != value:
            assert named(field, warnings), (f"{path}: {field} {value!r} -> {after[field]!r} changed with no "
                                            f"warning naming it; warnings: {warnings}")
    if there.exact:
        assert after == before, f"{path}: exact translation must round-trip unchanged"


def test_exact_translation_is_what_mapping_says():
    t = translate(str(REPO / "launch_configs/fsdp/full_shard.yaml"), "deepspeed")
    assert t.exact, t.warnings
    assert t.json["zero_optimization"] == {"stage": 3, "memory_efficient_linear": False}  # torch's F.linear
    assert t.json["bf16"] == {"enabled": True}
    assert t.json["gradient_clipping"] == "auto"  # a missing key would make DeepSpeed clip at 1.0
    back = translate(str(REPO / "launch_configs/deepspeed/zero3.yaml"), "fsdp")
    assert back.exact and back.yaml["fsdp_config"]["fsdp_reshard_after_forward"] is True
    assert any("steps_per_print" in n for n in back.notes)  # reported, not silently dropped


def write(tmp_path, text: str, js: dict | None = None, name="c.yaml"):
    if js is not None:
        (tmp_path / "ds.json").write_text(json.dumps(js))
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


DS_HEAD = "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n"


@pytest.mark.parametrize("cfg, expect", [
    (DS_HEAD + "  zero_stage: 1\n", "stage 1: FSDP has no exact counterpart. Written: the nearest, SHARD_GRAD_OP"),
    (DS_HEAD + "  zero_stage: 3\n  offload_param_device: nvme\n  offload_param_nvme_path: /nvme\n"
     "  offload_optimizer_device: nvme\n  offload_optimizer_nvme_path: /nvme\n", "to the host only (no NVMe"),
    (DS_HEAD + "  zero_stage: 3\n  offload_param_device: cpu\n", "Written: fsdp_offload_params true"),
    (DS_HEAD + "  zero_stage: 3\n  gradient_clipping: 0.5\n", "pass --grad-clip 0.5"),
    (DS_HEAD + "  zero_stage: 2\n", "DeepSpeed clips at its default 1.0"),
])
def test_no_equivalent_is_warned_with_the_nearest_choice(tmp_path, cfg, expect):
    t = translate(write(tmp_path, cfg), "fsdp")
    assert any(expect in w for w in t.warnings), t.warnings
    check(t)


def test_ds_json_knobs_without_counterpart_are_warned(tmp_path):
    js = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "gradient_clipping": 0.0,
          "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_prefetch_bucket_size": 0},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "data_types": {"grad_accum_dtype": "fp32"}}
    t = translate(write(tmp_path, DS_HEAD + "  deepspeed_config_file: ds.json\n", js), "fsdp")
    text = "\n".join(t.warnings)
    for key in ("overlap_comm", "stage3_prefetch_bucket_size", "optimizer", "data_types", "--micro-batch 4"):
        assert key in text, key
    assert t.yaml["fsdp_config"]["fsdp_backward_prefetch"] == "NO_PREFETCH"
    check(t)


def test_fsdp_only_settings_are_warned(tmp_path):
    cfg = ("distributed_type: FSDP\nmixed_precision: bf16\nfsdp_config:\n  fsdp_version: 2\n"
           "  fsdp_reshard_after_forward: false\n  fsdp_offload_params: true\n"
           "  fsdp_cpu_ram_efficient_loading: true\n  fsdp_activation_checkpointing: true\n"
           "  fsdp_backward_prefetch: NO_PREFETCH\n")
    t = translate(write(tmp_path, cfg), "deepspeed")
    text = "\n".join(t.warnings)
    for part in ("can move only the optimizer", "zero3_init_flag, works only under ZeRO-3", "prefetch"):
        assert part in text, part
    assert "checkpointing" not in text  # it has a counterpart now: the JSON's section (a note, not a warning)
    assert t.json["activation_checkpointing"] == {}
    assert any("activation_checkpointing_enable()" in n for n in t.notes)
    assert t.json["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert "offload_param" not in t.json["zero_optimization"]
    check(t)


def test_cli_writes_valid_files_and_refuses_bad_input(tmp_path):
    run = [sys.executable, "-m", "helpers.translate"]
    out = tmp_path / "x" / "ds.yaml"
    p = subprocess.run([*run, "launch_configs/fsdp/shard_grad_op.yaml", "--to", "deepspeed", "-o", str(out)],
                       cwd=REPO, env=job_env(), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "warning: sharding SHARD_GRAD_OP" in p.stderr
    assert out.read_text().startswith("# Translated from") and out.with_suffix(".json").is_file()
    assert load_job_config(str(out)).deepspeed.zero_stage == 2
    for args, words in ((["nope.yaml", "--to", "fsdp"], "no such config file"),
                        (["launch_configs/fsdp/full_shard.yaml", "--to", "fsdp"], "already a fsdp config"),
                        (["launch_configs/fsdp/full_shard.yaml", "--to", "deepspeed", "-o", "x.txt"], ".yaml")):
        p = subprocess.run([*run, *args], cwd=REPO, env=job_env(), capture_output=True, text=True)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and words in p.stderr, p.stderr


# --------------------------------------------------------------------------- legacy FSDP1 spellings


def test_legacy_fsdp1_spellings(tmp_path):
    cfg = ("distributed_type: FSDP\nmixed_precision: bf16\nfsdp_config:\n  fsdp_sharding_strategy: 2\n"
           "  fsdp_state_dict_type: 1\n  backward_prefetch: 2\n  fsdp_backward_prefetch_policy: BACKWARD_PRE\n")
    job = load_job_config(write(tmp_path, cfg))
    assert job.fsdp.sharding == "SHARD_GRAD_OP" and not job.fsdp.reshard_after_forward
    assert job.fsdp.state_dict_type == "FULL_STATE_DICT"
    assert job.fsdp.backward_prefetch == "BACKWARD_POST"  # prefix added, as Accelerate does
    notes = "\n".join(job.notes)
    assert "fsdp_backward_prefetch_policy" in notes and "silently drops it" in notes
    with pytest.raises(ConfigError, match="fsdp_sharding_strategy = 7"):
        load_job_config(write(tmp_path, cfg.replace("strategy: 2", "strategy: 7")))


# --------------------------------------------------------------------------- DeepSpeed "auto"


def ds_job(tmp_path, js, **overrides):
    return load_job_config(write(tmp_path, DS_HEAD + "  deepspeed_config_file: ds.json\n", js), overrides)


def test_auto_values_are_filled_and_reported(tmp_path):
    from helpers.job.backends.deepspeed import resolved_ds_config

    js = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
          "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                       "warmup_num_steps": "auto"}}}
    job = ds_job(tmp_path, js, micro_batch=4, grad_accum=2, grad_clip=0.5, lr=0.01, steps=30)
    out, filled = resolved_ds_config(job, 2, hidden_size=128)
    assert out["train_batch_size"] == 16 and out["gradient_clipping"] == 0.5 and out["bf16"]["enabled"] is True
    assert out["zero_optimization"]["reduce_bucket_size"] == 128 * 128
    assert out["optimizer"]["params"]["lr"] == 0.01 and out["optimizer"]["params"]["torch_adam"] is True
    assert out["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 3}
    assert "bf16.enabled=True" in filled and "optimizer.params.lr=0.01" in filled
    assert ds_job(tmp_path, js, model_dtype="fp32").mixed_precision == "no"  # auto bf16 follows the model dtype
    js["zero_optimization"]["sub_group_size"] = "auto"
    with pytest.raises(ValueError, match="sub_group_size"):
        resolved_ds_config(ds_job(tmp_path, js), 2, hidden_size=128)


# --------------------------------------------------------------------------- real jobs


def test_json_optimizer_and_scheduler_run(tmp_path):
    """Accelerate's DummyOptim/DummyScheduler pattern: DeepSpeed builds both from the JSON."""
    js = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                       "warmup_num_steps": "auto"}}}
    cfg = write(tmp_path, DS_HEAD + "  deepspeed_config_file: ds.json\n", js)
    out = tmp_path / "run"
    p = run_job(cfg, out, 2, "--model", "tiny", "--steps", "4", "--lr", "0.01")
    assert p.returncode == 0, p.stderr[-3000:]
    resolved = json.loads((out / "config.json").read_text())["deepspeed"]
    assert "optimizer.params.lr=0.01" in resolved["filled"]
    assert "scheduler.params.warmup_num_steps=1" in resolved["filled"]
    assert "filled DeepSpeed 'auto'" in (out / "log.txt").read_text()
    lrs = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert lrs[0] < 0.01 and lrs[-1] == pytest.approx(0.01), lrs  # the JSON scheduler warmed the lr up
    assert summary(out)["status"] == "completed"


def test_some_shipped_fsdp_config_translates_exactly():
    assert "launch_configs/fsdp/full_shard.yaml" in EXACT_FSDP, EXACT_FSDP


@pytest.mark.parametrize("path", EXACT_FSDP)
def test_exact_translation_trains_identically(path, tmp_path):
    """The proof: a shipped FSDP config and its exact DeepSpeed translation give the same losses."""
    t = translate(str(REPO / path), "deepspeed")
    check(t, str(tmp_path / "ds.yaml"))
    losses = {}
    for name, cfg in (("fsdp", path), ("ds", str(tmp_path / "ds.yaml"))):
        p = run_job(cfg, tmp_path / name, 2, "--model", "tiny", "--steps", "4")
        assert p.returncode == 0, p.stderr[-3000:]
        losses[name] = summary(tmp_path / name)["losses"]
    assert losses["fsdp"] == losses["ds"]


def test_zero3_memory_efficient_linear_left_on_is_named(tmp_path):
    """DeepSpeed's default swaps torch's F.linear (bias added in a second rounding): warned both ways."""
    js = {"bf16": {"enabled": True}, "gradient_clipping": 0.0, "zero_optimization": {"stage": 3}}
    cfg = write(tmp_path, DS_HEAD + "  deepspeed_config_file: ds.json\n", js)
    t = translate(cfg, "fsdp")
    assert not t.exact and any("memory_efficient_linear" in w and "biased layers" in w for w in t.warnings), t.warnings
    assert any("memory_efficient_linear" in n for n in load_job_config(cfg).notes)
    for shipped in sorted((REPO / "launch_configs/deepspeed").glob("zero3*.json")):
        assert json.loads(shipped.read_text())["zero_optimization"]["memory_efficient_linear"] is False, shipped
