"""``python -m helpers.switch``: both backends run, settings side by side, the verdict, the module and the cause.

Two real switches (each one torchrun launch of two jobs): the shipped FSDP config with a tiny Llama (identical,
exit 0) and a shrunk 7B Olmo2 config (parts in the forward: the module and the known cause named, exit 1).
"""

import json
import re
from pathlib import Path

import pytest
from conftest import FSDP, REPO, run_module

from helpers.core.causes import CAUSES
from helpers.core.shrink import shrink

MODELS = REPO / "launch_configs" / "models"


def switch(*args, nproc=0):
    return run_module("helpers.switch", list(args), nproc, timeout=900)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("switch") / "tiny"
    return switch("--config", FSDP, "--model", "tiny", "--out", out), out


def test_the_shipped_fsdp_config_and_a_tiny_llama_are_identical(tiny):
    proc, out = tiny
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "settings, read from the two runs of tiny" in proc.stdout
    assert "tiny: identical" in proc.stdout and "every module output and output gradient identical" in proc.stdout
    result = json.loads((out / "switch.json").read_text())["models"]["tiny"]
    assert result["identical"] and result["causes"] == []
    rows = {k: (a, b, d) for k, a, b, d in result["settings"]}
    assert rows["dtype: stored_param"] == ("fp32", "bf16", True)  # FSDP's fp32 shards vs ZeRO-3's bf16 params
    assert rows["dtype: forward_weight"] == ("bf16", "bf16", False)
    assert rows["attn_implementation"] == ("sdpa", "sdpa", False) and rows["max_norm"][2] is False
    flags = [{True: 0, None: 1, False: 2}[d] for _, _, _, d in result["settings"]]
    assert flags == sorted(flags), "differing rows come first, then the ones not measured on one side"
    marked = [ln for ln in proc.stdout.splitlines() if ln.startswith("* ")]
    assert len(marked) == flags.count(0) and any("dtype: stored_param" in ln for ln in marked)
    # one unit per fully_shard call, as helpers.job.wrap plans them (the tail's two modules are one unit)
    from helpers.core.config import load_job_config
    from helpers.core.models import resolve_model
    from helpers.job import wrap

    planned = len(wrap.units(wrap.meta_model(resolve_model("tiny")), load_job_config(str(FSDP)).fsdp))
    assert rows["units"][0] == f"{planned} FSDP units (TRANSFORMER_BASED_WRAP)", rows["units"]


def test_a_shrunk_7b_olmo2_parts_in_the_forward_and_the_switch_names_module_and_cause(tmp_path):
    proc = switch("--config", FSDP, "--model", MODELS / "olmo2_7b.json", "--shrink", "--out", tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "shrunk: hidden_size 4096 -> 64" in proc.stdout
    assert ("first differing module: step 0 rank 0 micro-batch 0, forward: output of "
            "model.layers.0.self_attn.o_proj (Linear)") in proc.stdout, proc.stdout
    assert "known cause (fsdp_casts_unit_inputs)" in proc.stdout and "model.rotary_emb" in proc.stdout
    result = json.loads((tmp_path / "switch.json").read_text())["models"]["olmo2_7b"]
    assert not result["identical"] and result["module"]["phase"] == "forward"
    assert ("unit_inputs_cast_to", "bf16", "-", True) in [tuple(r) for r in result["settings"]]


def test_zero2_and_fsdp_train_the_same_and_report_the_norm_in_other_dtypes(tmp_path):
    """ZeRO-2 and its FSDP translation: every loss and every module output and output gradient the same, the logged
    gradient norms not (ZeRO-1/2 sum the squared norms in fp32, fact deepspeed.zero12_grad_norm_fp32)."""
    proc = switch("--config", "launch_configs/deepspeed/zero2.yaml", "--model", "tiny", "--out", tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    r = json.loads((tmp_path / "switch.json").read_text())["models"]["tiny"]
    assert [c["key"] for c in r["causes"]] == ["grad_norm_dtype"], r["report"]
    rows = {k: (a, b, d) for k, a, b, d in r["settings"]}
    assert rows["norm_dtype"] == ("fp32", "fp64", True) and rows["reshard_after_forward"][:2] == ("False", "False")
    assert rows["dtype: optimizer_states"][2] is None  # the probe does not read ZeRO-2's: "?", not a difference
    assert "tensor traces: not taken (zero_optimization.stage = 2" in proc.stdout
    runs = [tmp_path / "runs" / "tiny" / side for side in "ab"]
    losses = [[json.loads(x)["loss"] for x in (r / "metrics.jsonl").read_text().splitlines()] for r in runs]
    assert losses[0] == losses[1] and r["module"] is None


@pytest.mark.parametrize("args,needle", [
    (["--config", FSDP], "pass --config and one of --model or --families"),
    (["--config", FSDP, "--model", "tiny", "--families", "all"], "pass --config and one of --model or --families"),
    (["--config", FSDP, "--families", "llama,nope"], "--families llama,nope: allowed all or"),
    (["--config", FSDP, "--model", "tiny", "--steps", "0"], "--steps = 0: must be >= 1"),
    (["--config", "nope.yaml", "--model", "tiny"], "nope.yaml"),
    (["--config", FSDP, "--model", "tiny", "--shrink"], "--shrink: --model tiny is a preset"),
    (["--config", FSDP, "--model", "huge"], "--model 'huge'"),
    (["--config", FSDP, "--model", "tiny", "--compile"], "--compile: the switch traces every module eagerly"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, needle):
    proc = switch(*args, "--out", tmp_path / "o")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], (proc.returncode, lines)


def test_a_config_the_job_refuses_is_named_in_one_line(tmp_path):
    proc = switch("--config", FSDP, "--to", "launch_configs/fsdp/hybrid_shard.yaml", "--model", "tiny",
                  "--out", tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: tiny/b (B): ") and "4 ranks" in lines[0], lines


@pytest.mark.parametrize("name,kind", [("llama2_7b", "MHA"), ("mixtral_8x7b", "GQA"), ("olmo2_7b", "MHA")])
def test_shrink_keeps_the_architecture_and_builds_small(name, kind):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads((MODELS / f"{name}.json").read_text())
    small, changes = shrink(raw)
    assert small["model_type"] == raw["model_type"] and changes
    heads, kv = small["num_attention_heads"], small["num_key_value_heads"]
    assert {"MHA": kv == heads, "GQA": 1 < kv < heads}[kind], (heads, kv)
    assert all(k not in raw or raw[k] == v or k in " ".join(changes) for k, v in small.items())
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.for_model(**small))
    assert sum(p.numel() for p in m.parameters()) < 1_000_000
    assert all(v < 128 for k, v in small.items() if k.endswith("token_id") and isinstance(v, int))


def test_every_known_cause_names_a_test_that_exists():
    for cause in CAUSES:
        file, name = cause.test.split("::")
        assert re.search(rf"^def {name}\(", (REPO / file).read_text(), re.M), cause.test
    assert len({c.key for c in CAUSES}) == len(CAUSES)


def test_the_readme_and_docs_name_the_command():
    text = (REPO / "docs" / "switching.md").read_text()
    assert "python -m helpers.switch" in text and all(c.key in text for c in CAUSES)
    assert "docs/switching.md" in Path(REPO / "README.md").read_text()


def test_a_sweep_undoes_deepspeeds_process_wide_linear_after_each_job():
    """ZeRO-3 (memory_efficient_linear) swaps torch.nn.functional.linear for the whole process; in a sweep the next
    job, FSDP's too, would compute with it. helpers.switch runs A then B per model: each job gets torch's own."""
    import torch

    from helpers.job.sweep import one_job_only

    torch_linear = torch.nn.functional.linear
    with one_job_only():
        torch.nn.functional.linear = lambda *a, **k: None  # what a ZeRO-3 job leaves behind
    assert torch.nn.functional.linear is torch_linear
