"""Activation checkpointing (helpers.job.recompute): one mechanism per job, the same losses, fewer held bytes.

Parity runs go through helpers.families (one process group per config, a few families, 3 steps), the
same sweep tests/test_families.py uses for the aligned pair; then one job per backend shows log.txt,
summary.json and the measured activation bytes. The rest runs in this process on a tiny model.
"""

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import FSDP, REPO, ZERO3, run_families, run_job, summary

from helpers.compare import compare
from helpers.core.config import ConfigError, load_job_config, unapplied_notes
from helpers.core.families import write_config
from helpers.core.models import build_model, decoder_layers, resolve_model
from helpers.job import recompute
from helpers.job.observe.memory import SavedActivations
from helpers.translate import translate

FSDP_AC = "launch_configs/fsdp/full_shard_ac.yaml"
ZERO3_AC = "launch_configs/deepspeed/zero3_ac.yaml"
FAMILIES = "llama,qwen2,gemma"  # no biases / q,k,v biases + GQA / tied, scaled embeddings + multi-query
CPU = torch.device("cpu")


# --------------------------------------------------------------------------- parity (jobs)


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    base = tmp_path_factory.mktemp("ac")
    # FAMILIES only, 3 steps (tests/test_families.py runs every family)
    return {name: run_families(cfg, base / name, 3, "--families", FAMILIES) for name, cfg in
            (("fsdp", FSDP), ("fsdp_ac", FSDP_AC), ("zero3", ZERO3), ("zero3_ac", ZERO3_AC))}


@pytest.mark.parametrize("family", FAMILIES.split(","))
@pytest.mark.parametrize("a,b", [("fsdp", "fsdp_ac"), ("zero3", "zero3_ac"), ("fsdp_ac", "zero3_ac")])
def test_checkpointing_changes_no_loss_grad_norm_or_tensor(sweeps, family, a, b):
    result = compare(sweeps[a] / family, sweeps[b] / family)
    assert result.steps == 3
    assert result.identical, f"{family} {a} vs {b}: {result.report()}"
    assert result.tensor is None and all(result.traced), result.report()  # every weight, gradient and update


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ac_jobs")
    out = {}
    ckpt = ("--checkpoint-dir", str(base / "ckpt"), "--checkpoint-every", "2")
    for name, cfg in (("fsdp", FSDP), ("fsdp_ac", FSDP_AC), ("zero3_ac", ZERO3_AC)):
        proc = run_job(cfg, base / name, 2, "--model", "tiny", "--steps", "3", *(ckpt if name == "fsdp_ac" else ()))
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        out[name] = base / name
    return out


def test_job_names_its_one_mechanism_and_holds_fewer_bytes(jobs):
    s = {k: summary(v) for k, v in jobs.items()}
    assert s["fsdp"]["activation_checkpointing"] is None
    assert s["fsdp_ac"]["activation_checkpointing"] == "fsdp checkpoint_wrapper per LlamaDecoderLayer (2 blocks)"
    assert s["zero3_ac"]["activation_checkpointing"] == "transformers gradient_checkpointing (2 blocks)"
    for name, want in (("fsdp", "off (every activation is kept)"),
                       ("fsdp_ac", s["fsdp_ac"]["activation_checkpointing"]),
                       ("zero3_ac", s["zero3_ac"]["activation_checkpointing"])):
        lines = (jobs[name] / "log.txt").read_text().splitlines()
        assert [ln for ln in lines if ln.startswith("activation checkpointing:")] == \
            [f"activation checkpointing: {want}"]
    assert s["fsdp"]["losses"] == s["fsdp_ac"]["losses"] == s["zero3_ac"]["losses"]
    # both mechanisms hold the same tensors (each block's inputs), far fewer than every activation
    assert s["fsdp_ac"]["activation_bytes_per_sample"] == s["zero3_ac"]["activation_bytes_per_sample"]
    assert s["fsdp_ac"]["activation_bytes_per_sample"] < 0.5 * s["fsdp"]["activation_bytes_per_sample"]


def test_a_checkpointed_jobs_checkpoint_resumes_without_checkpointing(jobs, tmp_path):
    """checkpoint_wrapper adds a step to parameter names; checkpoints keep the model's own names, so a run
    saved with checkpointing resumes without it (and the losses go on as before)."""
    ckpt = jobs["fsdp_ac"].parent / "ckpt" / "step_2"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert not any("_checkpoint_wrapped_module" in n for n in meta["param_shapes"])
    proc = run_job(FSDP, tmp_path / "resumed", 2, "--model", "tiny", "--steps", "3", "--resume", str(ckpt))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary(tmp_path / "resumed")["losses"] == summary(jobs["fsdp"])["losses"][2:]


# --------------------------------------------------------------------------- held bytes, exactly (in process)


def _storages_bytes(tensors, params) -> int:
    seen = {p.untyped_storage().data_ptr() for p in params}
    total = 0
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _expected_with_checkpointing(model, ids) -> tuple[int, int, int]:
    """Without checkpointing: (all saved bytes, bytes saved outside the blocks + every block's inputs, the
    blocks' hidden-state inputs alone). Checkpointing should keep exactly the second."""
    depth, outside, inputs, hidden = [0], [], [], []

    def pre(_m, args, kwargs):
        depth[0] += 1
        hidden.append(args[0])
        inputs.extend(t for v in [*args, *kwargs.values()] for t in (v if isinstance(v, tuple) else [v])
                      if torch.is_tensor(t))

    def post(*_):
        depth[0] -= 1

    hooks = [h for b in decoder_layers(model) for h in (b.register_forward_pre_hook(pre, with_kwargs=True),
                                                         b.register_forward_hook(post))]
    saved = []

    def pack(t):
        saved.append(t)
        if depth[0] == 0:
            outside.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    for h in hooks:
        h.remove()
    params = list(model.parameters())
    return (_storages_bytes(saved, params), _storages_bytes(outside + inputs, params),
            sum(h.untyped_storage().nbytes() for h in hidden))


def _held(model, ids) -> int:
    with SavedActivations(model) as sa:
        model(input_ids=ids, labels=ids).loss.backward()
    return sa.bytes


@pytest.mark.parametrize("config", [FSDP_AC, ZERO3_AC])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_checkpointing_holds_exactly_the_block_inputs(config, family, tmp_path):
    spec = resolve_model(str(write_config(family, tmp_path)))
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = build_model(spec, torch.bfloat16, seed=0)
    everything, expected, hidden = _expected_with_checkpointing(plain, ids)
    blocks = len(decoder_layers(plain))
    cfg = plain.config
    assert hidden == blocks * 2 * 16 * cfg.hidden_size * 2  # one bf16 [batch, seq, hidden] input per block
    assert _held(plain, ids) == everything  # the probe counts every saved tensor without checkpointing

    model = build_model(spec, torch.bfloat16, seed=0)
    assert recompute.apply(model, load_job_config(str(REPO / config)), CPU)
    held = _held(model, ids)
    assert held == expected, (held, expected)
    assert held < everything / 2
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):  # same arithmetic: same gradients
        assert torch.equal(a.grad, b.grad)


# --------------------------------------------------------------------------- one mechanism, never two


def _tiny_with_own_checkpointing(tmp_path) -> tuple:
    path = write_config("llama", tmp_path)
    path.write_text(json.dumps({**json.loads(path.read_text()), "gradient_checkpointing": True}))
    spec = resolve_model(str(path))
    return spec, build_model(spec, torch.float32, seed=0)


def _wrappers(model, kind="CheckpointWrapper") -> int:
    return sum(type(m).__name__ == kind for m in model.modules())


def test_model_config_checkpointing_is_replaced_by_fsdps_never_stacked(tmp_path):
    spec, model = _tiny_with_own_checkpointing(tmp_path)
    assert recompute.model_checkpoints(model) == 2  # transformers turned it on from config.json
    job = load_job_config(str(REPO / FSDP_AC))
    assert recompute.apply(model, job, CPU) == "fsdp checkpoint_wrapper per LlamaDecoderLayer (2 blocks)"
    assert recompute.model_checkpoints(model) == 0 and _wrappers(model) == 2
    assert any("turned off, so that only fsdp_activation_checkpointing" in n
               for n in recompute.notes(job, accelerator=False, model_checkpoints=True))
    # without the FSDP key, the model's own is what runs, and the job says where it came from
    _, model = _tiny_with_own_checkpointing(tmp_path)
    assert recompute.apply(model, load_job_config(str(REPO / FSDP)), CPU) == \
        "transformers gradient_checkpointing (2 blocks), from the model's config.json"
    assert _wrappers(model) == 0


def test_deepspeed_section_sets_non_reentrant_model_checkpointing(tmp_path):
    _, model = _tiny_with_own_checkpointing(tmp_path)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    recompute.apply(model, load_job_config(str(REPO / ZERO3_AC)), CPU)
    funcs = {m._gradient_checkpointing_func for m in decoder_layers(model)}
    assert len(funcs) == 1 and funcs.pop().keywords == {"use_reentrant": False}
    assert _wrappers(model) == 0  # the model's mechanism only
    plain = build_model(resolve_model("tiny"), torch.float32, seed=0)
    assert recompute.apply(plain, load_job_config(str(REPO / ZERO3)), CPU) is None  # no section: off
    assert recompute.model_checkpoints(plain) == 0


# --------------------------------------------------------------------------- offload and the sub-keys


def _write(tmp_path, yaml_text, js=None) -> str:
    if js is not None:
        (tmp_path / "ds.json").write_text(json.dumps(js))
    (tmp_path / "c.yaml").write_text(yaml_text)
    return str(tmp_path / "c.yaml")


FSDP_HEAD = "distributed_type: FSDP\nmixed_precision: bf16\nfsdp_config:\n  fsdp_version: 2\n"
DS_HEAD = "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n"
DS_JSON = json.loads((REPO / "launch_configs/deepspeed/zero3_ac.json").read_text())


def test_fsdp_offload_wraps_on_a_gpu_and_notes_on_a_cpu(tmp_path):
    job = load_job_config(_write(tmp_path, FSDP_HEAD + "  fsdp_activation_checkpointing: true\n"
                                 "  fsdp_activation_checkpointing_offload: true\n"))
    [note] = recompute.notes(job, accelerator=False, model_checkpoints=False)
    assert note.startswith("fsdp_config.fsdp_activation_checkpointing_offload = true: no effect here: the device "
                           "is the CPU")
    assert recompute.notes(job, accelerator=True, model_checkpoints=False) == []
    model = build_model(resolve_model("tiny"), torch.float32, seed=0)
    desc = recompute.apply(model, job, torch.device("cuda"))  # wrapping only: nothing runs on the device
    assert desc.endswith(", inputs offloaded to pinned host memory") and _wrappers(model, "OffloadWrapper") == 2
    model = build_model(resolve_model("tiny"), torch.float32, seed=0)
    recompute.apply(model, job, CPU)
    assert _wrappers(model, "OffloadWrapper") == 0 and _wrappers(model) == 2
    with pytest.raises(ConfigError, match="fsdp_activation_checkpointing_offload = true needs "
                                          "fsdp_activation_checkpointing: true"):
        load_job_config(_write(tmp_path, FSDP_HEAD + "  fsdp_activation_checkpointing_offload: true\n"))


def test_deepspeed_cpu_checkpointing_offloads_on_a_gpu_and_notes_on_a_cpu(tmp_path):
    js = {**DS_JSON, "activation_checkpointing": {"cpu_checkpointing": True}}
    job = load_job_config(_write(tmp_path, DS_HEAD, js))
    assert unapplied_notes(job) == []  # applied (on a GPU), so not a config-level note
    [note] = recompute.notes(job, accelerator=False, model_checkpoints=False)
    assert note.startswith("activation_checkpointing.cpu_checkpointing = true: no effect here: the device is the CPU")
    model = build_model(resolve_model("tiny"), torch.float32, seed=0)
    assert recompute.apply(model, job, torch.device("cuda")).endswith(", inputs offloaded to pinned host memory")
    func = decoder_layers(model)[0]._gradient_checkpointing_func
    assert func.func is not torch.utils.checkpoint.checkpoint  # transformers' save_on_cpu around the checkpoint


def test_each_deepspeed_sub_key_that_cannot_apply_is_one_note(tmp_path):
    asks = {"partition_activations": True, "contiguous_memory_optimization": True, "number_checkpoints": 4,
            "synchronize_checkpoint_boundary": True, "profile": True}
    job = load_job_config(_write(tmp_path, DS_HEAD, {**DS_JSON, "activation_checkpointing": asks}))
    notes = unapplied_notes(job)
    assert [n.split(" = ")[0] for n in notes] == [f"activation_checkpointing.{k}" for k in asks]
    assert all("no effect here: " in n and "deepspeed.checkpointing.checkpoint" in n for n in notes)
    shipped = unapplied_notes(load_job_config(str(REPO / ZERO3_AC)))
    assert not any("activation_checkpointing" in n for n in shipped)  # its sub-keys' defaults ask for nothing
    for bad, msg in (({"partition_activation": True}, "unknown key activation_checkpointing.partition_activation "
                      "(did you mean partition_activations?)"),
                     ({"profile": "yes"}, "activation_checkpointing.profile = 'yes': expected true or false"),
                     (True, "activation_checkpointing = True: expected an object")):
        with pytest.raises(ConfigError, match=re.escape(f"ds.json: {msg}")):
            load_job_config(_write(tmp_path, DS_HEAD, {**DS_JSON, "activation_checkpointing": bad}))


def test_translate_carries_checkpointing_both_ways(tmp_path):
    there = translate(str(REPO / FSDP_AC), "deepspeed")
    assert there.json["activation_checkpointing"] == {} and there.exact
    back = translate(str(REPO / ZERO3_AC), "fsdp")
    assert back.yaml["fsdp_config"]["fsdp_activation_checkpointing"] is True
    assert "fsdp_activation_checkpointing_offload" not in back.yaml["fsdp_config"]
    cfg = _write(tmp_path, DS_HEAD, {**DS_JSON, "activation_checkpointing": {"cpu_checkpointing": True,
                                                                             "profile": True}})
    t = translate(cfg, "fsdp")
    assert t.yaml["fsdp_config"]["fsdp_activation_checkpointing_offload"] is True
    assert [w.split(":")[0] for w in t.warnings if "checkpointing" in w.split(":")[0]] == \
        ["activation_checkpointing.profile = True"]
    off = translate(_write(tmp_path, FSDP_HEAD + "  fsdp_activation_checkpointing: true\n"
                           "  fsdp_activation_checkpointing_offload: true\n"), "deepspeed")
    assert off.json["activation_checkpointing"] == {"cpu_checkpointing": True}


def test_shipped_pair_differs_from_the_aligned_pair_only_in_checkpointing():
    fsdp = [ln for ln in (REPO / FSDP_AC).read_text().splitlines() if not ln.startswith("#")]
    plain = [ln for ln in (REPO / FSDP).read_text().splitlines() if not ln.startswith("#")]
    assert [ln for ln in fsdp if ln not in plain] == [
        ln for ln in fsdp if "fsdp_activation_checkpointing" in ln]
    js, base = DS_JSON, json.loads((REPO / "launch_configs/deepspeed/zero3.json").read_text())
    assert {k: v for k, v in js.items() if k != "activation_checkpointing"} == base
    assert Path(REPO / ZERO3_AC).read_text().count("zero3_ac.json") == 1
