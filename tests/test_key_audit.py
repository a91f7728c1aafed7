"""No silent keys: every key helpers.config accepts either changes what the job does or makes it log a note.

The keys are Accelerate's (``accelerate_keys``: the top level, each section) plus the DeepSpeed JSON's
``activation_checkpointing`` sub-keys that helpers.config checks. A key the guide applies is listed in
EFFECTS with the test that shows its effect; every other key must come back from ``load_job_config`` as one
``note:`` line (``unapplied_notes``) naming it and why. docs/config_keys.md lists every key. No job
runs here: the named tests run the jobs.
"""

import json
import re
from types import SimpleNamespace

import pytest
from conftest import REPO

from helpers.core import config_keys as config  # its key tables
from helpers.core.config import ConfigError, accelerate_keys, load_job_config, no_effect_reason, unapplied_notes
from helpers.job.backends.fsdp import set_prefetch

# key ("section.key"; the JSON's sub-keys as "activation_checkpointing.KEY") -> the test that shows its effect
EFFECTS = {
    "distributed_type": "tests/test_train.py::test_fsdp_and_zero3_train_bit_identically",
    "mixed_precision": "tests/test_precision.py::test_low_precision_stalls_where_mixed_precision_learns",
    "fsdp_config.fsdp_version": "tests/test_translate.py::test_legacy_fsdp1_spellings",
    "fsdp_config.fsdp_sharding_strategy": "tests/test_memory.py::test_state_per_rank_matches_theory",
    "fsdp_config.fsdp_reshard_after_forward": "tests/test_memory.py::test_state_per_rank_matches_theory",
    "fsdp_config.fsdp_offload_params": "tests/test_offload.py::test_fsdp_offload_moves_everything_together",
    "fsdp_config.fsdp_state_dict_type": "tests/test_resume_anywhere.py::test_fsdp_resumes_a_full_state_dict",
    "fsdp_config.fsdp_cpu_ram_efficient_loading": "tests/test_loading.py::test_each_method_loads_the_file",
    "fsdp_config.fsdp_auto_wrap_policy": "tests/test_profile.py::test_wrap_policies_give_accelerates_units",
    "fsdp_config.fsdp_transformer_layer_cls_to_wrap": "tests/test_profile.py::test_wrap_policies_give_accelerates_units",
    "fsdp_config.fsdp_min_num_params": "tests/test_profile.py::test_wrap_policies_give_accelerates_units",
    "fsdp_config.fsdp_forward_prefetch": "tests/test_key_audit.py::test_prefetch_keys_set_fsdp2s_explicit_prefetch",
    "fsdp_config.fsdp_backward_prefetch": "tests/test_key_audit.py::test_prefetch_keys_set_fsdp2s_explicit_prefetch",
    "fsdp_config.fsdp_activation_checkpointing":
        "tests/test_activation_checkpointing.py::test_job_names_its_one_mechanism_and_holds_fewer_bytes",
    "fsdp_config.fsdp_activation_checkpointing_offload":
        "tests/test_activation_checkpointing.py::test_fsdp_offload_wraps_on_a_gpu_and_notes_on_a_cpu",
    "deepspeed_config.deepspeed_config_file": "tests/test_train.py::test_deepspeed_config_autos_are_filled",
    "deepspeed_config.zero_stage": "tests/test_key_audit.py::test_inline_deepspeed_keys_build_accelerates_json",
    "deepspeed_config.gradient_accumulation_steps":
        "tests/test_key_audit.py::test_inline_deepspeed_keys_build_accelerates_json",
    "deepspeed_config.gradient_clipping": "tests/test_key_audit.py::test_inline_deepspeed_keys_build_accelerates_json",
    "deepspeed_config.offload_optimizer_device":
        "tests/test_key_audit.py::test_inline_deepspeed_keys_build_accelerates_json",
    "deepspeed_config.offload_param_device": "tests/test_key_audit.py::test_inline_deepspeed_keys_build_accelerates_json",
    "deepspeed_config.offload_optimizer_nvme_path":
        "tests/test_key_audit.py::test_inline_deepspeed_keys_build_accelerates_json",
    "deepspeed_config.offload_param_nvme_path":
        "tests/test_key_audit.py::test_inline_deepspeed_keys_build_accelerates_json",
    "deepspeed_config.zero3_save_16bit_model": "tests/test_checkpoint.py::test_16bit_save_holds_the_bf16_weights",
    "deepspeed_config.zero3_init_flag": "tests/test_loading.py::test_each_method_loads_the_file",
    "parallelism_config.parallelism_config_dp_replicate_size": "tests/test_memory.py::test_state_per_rank_matches_theory",
    "parallelism_config.parallelism_config_dp_shard_size": "tests/test_memory.py::test_state_per_rank_matches_theory",
    "parallelism_config.parallelism_config_tp_size": "tests/test_key_audit.py::test_other_parallelism_sizes_are_refused",
    "parallelism_config.parallelism_config_cp_size": "tests/test_key_audit.py::test_other_parallelism_sizes_are_refused",
    "parallelism_config.parallelism_config_sp_size": "tests/test_key_audit.py::test_other_parallelism_sizes_are_refused",
    "activation_checkpointing.cpu_checkpointing":
        "tests/test_activation_checkpointing.py::test_deepspeed_cpu_checkpointing_offloads_on_a_gpu_and_notes_on_a_cpu",
}
CONTAINERS = set(config._SECTIONS)  # top-level keys that hold a section; their keys are audited one by one
FSDP_HEAD = "distributed_type: FSDP\nmixed_precision: bf16\nfsdp_config:\n  fsdp_version: 2\n"
DS_HEAD = "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n"


def accepted() -> list[tuple[str, str]]:
    """(section, key) for every key helpers.config accepts; section "" is the top level."""
    keys = accelerate_keys()
    out = [("", k) for k in sorted(keys[""]) if k not in CONTAINERS]
    out += [(s, k) for s in config._SECTIONS for k in sorted(keys[s])]
    return out + [("activation_checkpointing", k) for k in config._DS_AC_KEYS]


def dotted(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def asking_value(key: str):
    """A value that asks for something and passes the key's rule."""
    rule = {**config._FSDP_KEYS, **config._DS_KEYS, **config._PAR_KEYS}.get(key)
    rule = config._DS_AC_KEYS[key][0] if key in config._DS_AC_KEYS else rule
    if rule is bool:
        return True
    if rule is int:
        return 4
    if isinstance(rule, list):
        return rule[0]
    return "x"


def test_every_key_either_takes_effect_or_is_noted(tmp_path):
    keys = accepted()
    applied = {dotted(s, k) for s, k in keys if no_effect_reason(s, k) is None}
    assert set(EFFECTS) == applied, "EFFECTS must list exactly the applied keys"
    for key, test in EFFECTS.items():
        path, name = test.split("::")
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), f"{key}: {test} does not exist"
    for section, key in keys:
        why = no_effect_reason(section, key)
        if why is None:
            continue
        value = asking_value(key)
        if section == "activation_checkpointing":
            (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3},
                                                          "activation_checkpointing": {key: value}}))
            text = DS_HEAD
        elif section == "":
            text = FSDP_HEAD + f"{key}: {json.dumps(value)}\n"
        elif section == "deepspeed_config":
            text = f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  {key}: {json.dumps(value)}\n"
        else:
            text = FSDP_HEAD if section == "fsdp_config" else FSDP_HEAD + f"{section}:\n"
            text += f"  {key}: {json.dumps(value)}\n"
        (tmp_path / "c.yaml").write_text(text)
        notes = unapplied_notes(load_job_config(str(tmp_path / "c.yaml")))
        mine = [n for n in notes if n.startswith(f"{dotted(section, key)} = ")]
        assert mine == [f"{dotted(section, key)} = {value!r}: no effect here: {why}"], (key, notes)


def test_docs_list_every_key_with_its_effect():
    text = (REPO / "docs" / "config_keys.md").read_text()
    section = text.split("## Config keys and what each one does", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`([a-z0-9_.]+)`", section))
    missing = []
    for s, k in accepted():
        whole_section = s in config._NO_EFFECT_SECTION and s in listed  # "every key of `fp8_config`"
        if not (whole_section or k in listed or dotted(s, k) in listed):
            missing.append(dotted(s, k))
    assert not missing, f"docs/config_keys.md does not list: {missing}"


def test_prefetch_keys_set_fsdp2s_explicit_prefetch():
    calls = []

    class Unit:
        def __init__(self, name):
            self.name = name

        def set_modules_to_forward_prefetch(self, mods):
            calls.append((self.name, "forward", [m.name for m in mods]))

        def set_modules_to_backward_prefetch(self, mods):
            calls.append((self.name, "backward", [m.name for m in mods]))

    root, inner = Unit("root"), [Unit("a"), Unit("b")]
    for fwd, bwd, want in (
            (False, "BACKWARD_PRE", []),  # FSDP2's defaults: nothing set
            (True, "BACKWARD_PRE", [("root", "forward", ["a"]), ("a", "forward", ["b"])]),
            (False, "NO_PREFETCH", [("root", "backward", ["root"]), ("a", "backward", ["a"]),
                                    ("b", "backward", ["b"])])):
        calls.clear()
        set_prefetch(root, inner, SimpleNamespace(forward_prefetch=fwd, backward_prefetch=bwd))
        assert calls == want, (fwd, bwd)


def test_inline_deepspeed_keys_build_accelerates_json(tmp_path):
    (tmp_path / "c.yaml").write_text(
        "distributed_type: DEEPSPEED\nmixed_precision: bf16\ndeepspeed_config:\n  zero_stage: 3\n"
        "  gradient_accumulation_steps: 4\n  gradient_clipping: 0.5\n  offload_optimizer_device: nvme\n"
        "  offload_optimizer_nvme_path: /nvme/o\n  offload_param_device: nvme\n  offload_param_nvme_path: /nvme/p\n"
        "  zero3_save_16bit_model: true\n")
    job = load_job_config(str(tmp_path / "c.yaml"))
    assert job.deepspeed.json["zero_optimization"] == {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme/o"},
        "offload_param": {"device": "nvme", "nvme_path": "/nvme/p"}, "stage3_gather_16bit_weights_on_model_save": True}
    assert (job.train.grad_accum, job.train.grad_clip) == (4, 0.5)
    assert job.deepspeed.json["gradient_clipping"] == 0.5 and job.deepspeed.json["gradient_accumulation_steps"] == 4


@pytest.mark.parametrize("key", ["tp", "cp", "sp"])
def test_other_parallelism_sizes_are_refused(tmp_path, key):
    (tmp_path / "c.yaml").write_text(FSDP_HEAD + f"parallelism_config:\n  parallelism_config_{key}_size: 2\n")
    with pytest.raises(ConfigError, match=f"parallelism_config_{key}_size = 2: this guide runs data parallelism "
                                          "only; allowed: 1"):
        load_job_config(str(tmp_path / "c.yaml"))
    (tmp_path / "c.yaml").write_text(FSDP_HEAD + f"parallelism_config:\n  parallelism_config_{key}_size: 1\n")
    assert load_job_config(str(tmp_path / "c.yaml")).fsdp.sharding == "FULL_SHARD"
