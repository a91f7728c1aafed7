"""LoRA fine-tuning (``helpers.train --peft``): bad input, every shipped config, parity, resume, the saved adapter,
the trainable/frozen memory split, the estimator, and the post-wrap audit every job runs.

The jobs share process groups where they can: every shipped config in two ``helpers.variants`` sweeps (one per
backend directory, plus one at 4 ranks for the two configs that need them), the families in ``helpers.families``
sweeps. The adapter jobs write checkpoints and so run alone.
"""

import json
import math

import pytest
from conftest import FSDP, REPO, ZERO3, run_families, run_job, run_module, summary

from helpers.compare import compare

LORA = "launch_configs/peft/lora.json"  # o_proj, down_proj, c_proj: inputs no other module reads
LORA_QV = "launch_configs/peft/lora_qv.json"  # q_proj, v_proj: they share their input with k_proj
FAMILIES = "llama,qwen2,gpt2,gemma"  # no biases / q,k,v biases / biases, tied, Conv1D / tied, multi-query
ZERO3_PARTITIONED = "launch_configs/deepspeed/zero3_no_prefetch.yaml"  # persistence threshold 0: nothing kept whole


# --------------------------------------------------------------------------- bad input


class Refused(Exception):
    pass


def _refuse(rank, msg):
    raise Refused(msg)


def validate(tmp_path, *extra):
    from helpers.job.run import parse_args, validate

    return validate(parse_args(["--config", FSDP, "--out", str(tmp_path / "out"), *extra]), refuse=_refuse)


def write(tmp_path, text) -> str:
    p = tmp_path / "lora.json"
    p.write_text(text if isinstance(text, str) else json.dumps(text))
    return str(p)


BAD = {
    "no file": (None, ["no such file", "adapter_config.json"]),
    "not json": ("{r: 8", ["not JSON"]),
    "not lora": ({"peft_type": "IA3", "target_modules": ["o_proj"]},
                 ["peft_type = 'IA3'", "LoRA adapters only"]),
    "unknown key": ({"rr": 8, "target_modules": ["o_proj"]}, ["unknown key 'rr'", "LoraConfig takes"]),
    "no such module": ({"target_modules": ["nope"]},
                       ['target_modules = ["nope"]', "LlamaForCausalLM's linear and embedding modules",
                        "o_proj"]),
    "untested key": ({"target_modules": ["o_proj"], "modules_to_save": ["lm_head"]},
                     ['modules_to_save = ["lm_head"]', "leave it out"]),
    "init from data": ({"target_modules": ["o_proj"], "init_lora_weights": "pissa"},
                       ['init_lora_weights = "pissa"', "gaussian"]),
    "bad value": ({"target_modules": ["o_proj"], "r": 0}, ["PEFT refuses it", "r"]),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_peft_file_is_refused_in_one_line_naming_it(tmp_path, name):
    text, needles = BAD[name]
    path = str(tmp_path / "missing.json") if text is None else write(tmp_path, text)
    with pytest.raises(Refused) as e:
        validate(tmp_path, "--peft", path)
    msg = str(e.value)
    assert "\n" not in msg and f"--peft {path}" in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_flags_that_need_peft_and_resume_mismatches_are_refused(tmp_path):
    with pytest.raises(Refused, match="--save-naive-adapter needs --peft FILE and --checkpoint-dir"):
        validate(tmp_path, "--save-naive-adapter")


def test_the_entry_point_says_it_in_one_line_and_exits_2(tmp_path):
    proc = run_job(FSDP, tmp_path / "run", 0, "--peft", str(tmp_path / "nowhere.json"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: --peft {tmp_path / 'nowhere.json'}: no such file (give a "
                                                "LoRA config as PEFT writes it: adapter_config.json, a directory "
                                                "holding one, or a JSON file with its keys)"]


# --------------------------------------------------------------------------- every shipped config


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """Every shipped launch config trains a LoRA run (helpers.variants: one process group per directory); the two
    that need 4 ranks are refused on 2 with that reason and run on 4."""
    base = tmp_path_factory.mktemp("lora_configs")
    four = base / "four"
    four.mkdir()
    for cfg in ("fsdp/hybrid_shard.yaml", "deepspeed/zero3_hpz.yaml"):
        (four / cfg.split("/")[1]).symlink_to(REPO / "launch_configs" / cfg)
    out = {}
    for name, where, nproc in (("fsdp", "launch_configs/fsdp", 2), ("deepspeed", "launch_configs/deepspeed", 2),
                               ("four", str(four), 4)):
        proc = run_module("helpers.variants", [where, "--out", base / name, "--peft", LORA], nproc, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = base / name
    return out


def test_every_shipped_config_trains_a_lora_run(shipped):
    on = {name: json.loads((d / "variants.json").read_text()) for name, d in shipped.items()}
    two = {**on["fsdp"], **on["deepspeed"]}
    refused = {k: v["why"] for k, v in two.items() if v["verdict"] == "refused"}
    assert set(refused) == {"hybrid_shard", "zero3_hpz"} and all("4 ranks" in w for w in refused.values()), refused
    trained = {k for k, v in {**two, **on["four"]}.items() if v["verdict"] == "trained"}
    yamls = {p.stem for p in (REPO / "launch_configs").glob("*/*.yaml")}
    assert trained == yamls, yamls ^ trained  # the two refused on 2 ranks trained on 4


def test_each_lora_summary_holds_the_split_the_audit_and_no_state_for_frozen_weights(shipped):
    for d in shipped.values():
        for run in (p for p in d.iterdir() if (p / "summary.json").is_file()):
            s = summary(run)
            assert s["audit"]["passed"] and s["audit"]["trainable_numel"] == s["peft"]["trainable_params"], run.name
            assert 0 < s["peft"]["trainable_params"] < s["peft"]["frozen_params"] / 50, run.name
            for rank in s["memory_split_bytes"]:
                frozen, trainable = rank["frozen"], rank["trainable"]
                assert frozen["params"] > 10 * trainable["params"], run.name
                assert frozen["grads"] == frozen["optimizer_states"] == frozen["master_params"] == 0, run.name
                assert trainable["optimizer_states"] > 0, run.name


def test_fsdp_state_per_rank_equals_the_estimator_to_the_byte(shipped):
    """FULL_SHARD, 2 ranks: frozen bf16 shards + fp32 adapter shards, gradients and Adam moments for the adapter only."""
    import argparse

    from helpers import estimate as est
    from helpers.core.mapping import CATEGORIES

    s = summary(shipped["fsdp"] / "full_shard")
    e = est.run(argparse.Namespace(config=FSDP, model="tiny", world_size=2, micro_batch=2, seq_len=16,
                                   budget_gib=None, peft=LORA))
    for r in range(2):
        assert {c: e["categories_per_rank"][r][c] for c in CATEGORIES} == s["memory_bytes"][r], r
        split = s["memory_split_bytes"][r]
        assert {c: split["trainable"][c] + split["frozen"][c] for c in CATEGORIES} == s["memory_bytes"][r]


def test_zero12_keep_frozen_weights_whole_zero3_and_fsdp_shard_them(shipped):
    """A frozen parameter is in no ZeRO-1/2 flat buffer (those hold what the optimizer steps): every rank holds it
    whole, in bf16. FSDP and ZeRO-3 shard it like any other (ZeRO-3 keeps its small ones whole: persistence)."""
    frozen = {name: {r["frozen"]["params"] for r in summary(d / name)["memory_split_bytes"]}
              for name, d in (("zero1", shipped["deepspeed"]), ("zero2", shipped["deepspeed"]),
                              ("zero3_no_prefetch", shipped["deepspeed"]), ("full_shard", shipped["fsdp"]))}
    frozen = {k: v.pop() for k, v in frozen.items() if len(v) == 1}  # the same on both ranks
    numel = summary(shipped["fsdp"] / "full_shard")["peft"]["frozen_params"]
    assert frozen["zero1"] == frozen["zero2"] == 2 * numel  # whole, bf16
    assert frozen["full_shard"] == 2 * numel // 2  # bf16 (frozen weights are not upcast), half on each rank
    assert frozen["zero3_no_prefetch"] == 2 * numel // 2  # threshold 0: every parameter partitioned


# --------------------------------------------------------------------------- parity


@pytest.fixture(scope="module")
def lora_families(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora_families")
    return {b: run_families(cfg, base / b, 3, "--peft", LORA, "--families", FAMILIES)
            for b, cfg in (("fsdp", FSDP), ("deepspeed", ZERO3))}


@pytest.mark.parametrize("family", FAMILIES.split(","))
def test_the_aligned_pair_trains_lora_bit_identically(lora_families, family):
    result = compare(lora_families["fsdp"] / family, lora_families["deepspeed"] / family)
    assert result.identical and result.tensor is None and all(result.traced), f"{family}: {result.report()}"
    s = summary(lora_families["fsdp"] / family)
    assert s["peft"]["trainable_params"] > 0 and s["audit"]["passed"]


def test_families_cover_biases_ties_and_gqa(lora_families):
    from helpers.core.families import FAMILIES as ALL

    cfgs = [ALL[f][0] for f in FAMILIES.split(",")]
    tied = [summary(lora_families["deepspeed"] / f)["audit"]["tied"] for f in FAMILIES.split(",")]
    assert any(tied) and not all(tied)  # tied embeddings (gemma, gpt2) survive wrapping, and untied ones
    assert any(c.get("num_key_value_heads", 4) < c.get("num_attention_heads", 4) for c in cfgs)


def test_adapters_on_shared_inputs_part_in_the_last_bit_under_zero3(tmp_path):
    """The known exception: LoRA on q_proj and v_proj. Their input also feeds k_proj. ZeRO-3 hooks every module,
    and its hooks put q_proj's two gradients (base and adapter) into one sum before it meets k_proj's and
    v_proj's; FSDP (hooks per unit) and ZeRO-1/2 (none) add the five in one buffer. bf16 sums in another order:
    the first step the adapter's B matrix is not zero (step 1), lora_A's local gradient differs."""
    runs = {b: run_families(cfg, tmp_path / b, 2, "--peft", LORA_QV, "--families", "llama")
            for b, cfg in (("fsdp", FSDP), ("deepspeed", ZERO3))}
    result = compare(runs["fsdp"] / "llama", runs["deepspeed"] / "llama")
    assert not result.identical
    from helpers.compare import differing

    t = result.tensor
    assert t.step == 1 and t.stage == "grad_local", result.report()
    # the mechanism's footprint: a layer's adapter gradients come from its own output; only the layers below one
    # whose shared input summed differently see it (llama here has 2 layers: layer 0's q/v adapters differ)
    parted = differing(runs["fsdp"] / "llama", runs["deepspeed"] / "llama", 1, "grad_local")
    assert parted and all(".layers.0.self_attn." in n and ("q_proj" in n or "v_proj" in n) for n in parted), parted


# --------------------------------------------------------------------------- resume, the saved adapter


@pytest.fixture(scope="module")
def adapter_runs(tmp_path_factory):
    """Per backend: 4 steps straight (a checkpoint at 2, with the naive adapter too), and 2 + 2 resumed."""
    base = tmp_path_factory.mktemp("lora_ckpt")
    out = {}
    for name, cfg in (("fsdp", FSDP), ("zero3", ZERO3_PARTITIONED)):
        d = base / name
        proc = run_job(cfg, d / "straight", 2, "--peft", LORA, "--steps", "4", "--checkpoint-dir", d / "ckpt",
                       "--checkpoint-every", "2", "--save-naive-adapter")
        assert proc.returncode == 0, proc.stderr[-3000:]
        proc = run_job(cfg, d / "resumed", 2, "--peft", LORA, "--steps", "4", "--resume", d / "ckpt" / "step_2")
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = d
    return out


def losses(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("backend", ["fsdp", "zero3"])
def test_a_resumed_lora_run_continues_bit_for_bit(adapter_runs, backend):
    d = adapter_runs[backend]
    assert losses(d / "resumed") == losses(d / "straight")[2:]


@pytest.mark.parametrize("backend", ["fsdp", "zero3"])
def test_the_saved_adapter_reloads_with_peft_and_gives_the_jobs_loss(adapter_runs, backend):
    from helpers.adapter import adapter_loss

    d = adapter_runs[backend]
    r = adapter_loss(d / "ckpt" / "step_2")
    assert r["loaded"] and r["empty"] == 0 and r["tensors"] > 0
    assert math.isclose(r["loss"], losses(d / "straight")[2], rel_tol=1e-6), (r["loss"], losses(d / "straight"))
    cfg = json.loads((d / "ckpt" / "step_2" / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8


def test_a_naive_save_under_zero3_writes_empty_tensors(adapter_runs):
    """ZeRO-3 leaves an empty placeholder in every partitioned parameter: saved without gathering, the adapter is
    all names and no values (PEFT warns, and writes it), and PEFT cannot load it. Under FSDP2 the values are
    DTensors: safetensors refuses them, and no file is written."""
    from helpers.adapter import adapter_loss
    from helpers.job.checkpoint import read_meta

    meta = read_meta(adapter_runs["zero3"] / "ckpt" / "step_2")
    assert meta["adapter_naive"]["tensors"] == meta["adapter"]["tensors"] > 0
    assert meta["adapter_naive"]["numel"] == 0 and meta["adapter_naive"]["empty"] == meta["adapter"]["tensors"]
    assert meta["adapter"]["empty"] == 0 and meta["adapter_naive"]["peft_warned"]
    naive = adapter_loss(adapter_runs["zero3"] / "ckpt" / "step_2", "adapter_naive")
    assert not naive["loaded"] and "size mismatch" in naive["error"], naive
    fsdp = read_meta(adapter_runs["fsdp"] / "ckpt" / "step_2")["adapter_naive"]
    assert fsdp["error"] and fsdp["dtensors"] == fsdp["tensors"] > 0, fsdp
    assert not (adapter_runs["fsdp"] / "ckpt" / "step_2" / "adapter_naive" / "adapter_model.safetensors").exists()


def test_resuming_with_and_without_peft_is_refused(adapter_runs, tmp_path):
    from helpers.job.run import parse_args
    from helpers.job.run import validate as job_validate

    ckpt = str(adapter_runs["fsdp"] / "ckpt" / "step_2")
    with pytest.raises(Refused, match="saved by a LoRA job"):
        job_validate(parse_args(["--config", FSDP, "--out", str(tmp_path / "o"), "--steps", "4", "--resume", ckpt]),
                     refuse=_refuse)


# --------------------------------------------------------------------------- the estimator


def test_the_estimator_predicts_lora_peaks_within_10_percent():
    """``benchmarks/estimate_grid_lora.json``: real LoRA jobs (tiny and small, 1 and 2 ranks, FULL_SHARD,
    SHARD_GRAD_OP, ZeRO-2, ZeRO-3) re-scored with today's estimator, with and without DeepSpeed's bucket."""
    from helpers import estimate as est

    rows = json.loads((REPO / "benchmarks" / "estimate_grid_lora.json").read_text())["rows"]
    assert {r["model"] for r in rows} >= {"tiny", "small"} and {r["world_size"] for r in rows} >= {1, 2}
    assert {r["mode"] for r in rows} >= {"full_shard", "shard_grad_op", "zero2", "zero3"}
    assert all(r.get("peft") == LORA for r in rows)
    scored = [est.against(r) | r for r in rows]
    worst = max(scored, key=lambda r: abs(r["error"]))
    assert abs(worst["error"]) <= 0.10, (worst["mode"], worst["model"], worst["world_size"], worst["error"])
    # DeepSpeed's fixed bucket alone is most of a small model's peak: the rest is scored too. ZeRO-3's rest misses
    # the partitions of the small parameters it also keeps whole (helpers/core/footprint.py: state_per_rank): 20%
    for r in scored:
        bound = 0.20 if r["mode"] == "zero3" else 0.10
        assert abs(r["error_without_buckets"]) <= bound, (r["mode"], r["model"], r["world_size"], r["error_without_buckets"])


def test_a_frozen_base_saves_fewer_activations_than_a_full_fine_tune():
    from helpers.core.footprint import activation_ratio, model_shapes
    from helpers.job.lora import read_config

    ratio = activation_ratio(model_shapes("tiny", peft=read_config(LORA)), 8, 64)
    assert 0.6 < ratio < 0.9  # measured on this CPU with saved-tensor hooks: 5,910,532 / 7,858,180 = 0.752


# --------------------------------------------------------------------------- the post-wrap audit


def test_a_failed_audit_ends_the_job_with_one_line_naming_the_parameter(tmp_path):
    proc = run_job(FSDP, tmp_path / "run", 0, "--steps", "1", env={"GUIDE_FAIL_AUDIT": "requires_grad"})
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "audit after wrapping: model.embed_tokens.weight: requires_grad was True, is False" \
        in lines[0], proc.stderr[-2000:]
    assert summary(tmp_path / "run")["status"] == "failed"


def test_the_audit_names_an_untied_weight_a_wrong_dtype_and_a_lost_element():
    import torch

    from helpers.job.audit import compare as audit_compare
    from helpers.job.audit import snapshot

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(4, 3), torch.nn.Linear(3, 4, bias=False)
            self.head.weight = self.emb.weight

    m = Tied()
    before = snapshot(m)
    assert before.tied() == [["emb.weight", "head.weight"]]
    assert audit_compare(before, snapshot(m), lambda n: torch.float32) == []
    m.head.weight = torch.nn.Parameter(m.emb.weight.detach().clone())
    assert any("emb.weight is no longer tied to head.weight" in p
               for p in audit_compare(before, snapshot(m), lambda n: torch.float32))
    assert audit_compare(before, snapshot(Tied().bfloat16()), lambda n: torch.float32)[0] == \
        "emb.weight: dtype bfloat16 after wrapping, the config asks for float32"
    small = Tied()
    small.emb = torch.nn.Embedding(3, 3)
    small.head.weight = small.emb.weight
    assert "emb.weight: 12 elements before wrapping, 9 after" in audit_compare(before, snapshot(small),
                                                                               lambda n: torch.float32)
