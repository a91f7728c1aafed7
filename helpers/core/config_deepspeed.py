"""The ``deepspeed_config`` section of a launch config -> DeepSpeedOptions and the DeepSpeed JSON.

Either a ``deepspeed_config_file`` (the JSON read and checked: ZeRO stage, offload, precision, the
``activation_checkpointing`` section) or the inline keys, from which the JSON is built the way
Accelerate builds it.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from helpers.core.config_keys import _DS_AC_KEYS, _DS_FILE_EXCLUSIVE, _DS_KEYS, _Checker, _find_file
from helpers.core.config_types import DeepSpeedOptions, Precision


def _deepspeed_options(c: _Checker, raw: dict) -> tuple[DeepSpeedOptions, Precision, list[str]]:
    sec = c.section(raw, "deepspeed_config", _DS_KEYS)
    notes: list[str] = []
    o = DeepSpeedOptions()
    for k in ("zero_stage", "offload_optimizer_device", "offload_param_device",
              "offload_optimizer_nvme_path", "offload_param_nvme_path",
              "zero3_init_flag", "zero3_save_16bit_model"):
        if k in sec:
            setattr(o, k, sec[k])
    if "deepspeed_config_file" in sec:
        clash = [k for k in _DS_FILE_EXCLUSIVE if k in sec] + (
            ["mixed_precision"] if raw.get("mixed_precision") is not None else [])
        if clash:
            c.fail(
                f"deepspeed_config.deepspeed_config_file is set, so {', '.join(clash)} must be "
                "in the DeepSpeed JSON instead (Accelerate refuses both)"
            )
        found = _find_file(sec["deepspeed_config_file"], c.source)
        if found is None:
            c.fail(f"deepspeed_config.deepspeed_config_file = {sec['deepspeed_config_file']!r}: no such file")
        o.config_file = str(found)
        try:
            o.json = json.loads(found.read_text())
        except json.JSONDecodeError as e:
            c.fail(f"{found}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}")
        if not isinstance(o.json, dict):
            c.fail(f"{found}: expected a JSON object")
        o, mp, notes = o, *_read_ds_json(c, o, str(found), notes)
        return o, mp, notes + _linear_note(o)

    # Inline keys: build the JSON the way Accelerate does.
    mp = c.value("mixed_precision", raw.get("mixed_precision") or "no", ["no", "bf16"])
    zo: dict[str, Any] = {"stage": o.zero_stage}
    for what in ("optimizer", "param"):
        dev = getattr(o, f"offload_{what}_device")
        if dev != "none":
            zo[f"offload_{what}"] = {"device": dev}
            if dev == "nvme":
                path = getattr(o, f"offload_{what}_nvme_path")
                if not path:
                    c.fail(f"deepspeed_config.offload_{what}_device = nvme needs offload_{what}_nvme_path")
                zo[f"offload_{what}"]["nvme_path"] = path
    if o.zero3_save_16bit_model:
        zo["stage3_gather_16bit_weights_on_model_save"] = True
    o.json = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": sec.get("gradient_accumulation_steps", "auto"),
        "zero_optimization": zo,
        "bf16": {"enabled": mp == "bf16"},
    }
    clip = sec.get("gradient_clipping")
    if clip:
        o.json["gradient_clipping"] = clip
    elif clip is not None:
        notes.append(
            "gradient_clipping: 0 in the YAML is dropped (Accelerate only passes a non-zero value), "
            "so DeepSpeed clips at its default 1.0; set it in a deepspeed_config_file to turn clipping off"
        )
    return o, mp, notes + _linear_note(o)


LINEAR_NOTE = ("zero_optimization.memory_efficient_linear is not false: ZeRO-3 replaces torch's F.linear with "
               "DeepSpeed's, which adds the bias in a second bf16 rounding, so layers with biases (Qwen2, "
               "GPT-NeoX, ...) part from FSDP in the last bits from step 1; set it to false for parity")


def _linear_note(o: DeepSpeedOptions) -> list[str]:
    zo = o.json.get("zero_optimization") or {}
    return [LINEAR_NOTE] if o.zero_stage == 3 and zo.get("memory_efficient_linear", True) is not False else []


def _read_ds_json(c: _Checker, o: DeepSpeedOptions, path: str, notes: list[str]):
    js = o.json
    zo = js.get("zero_optimization", {})
    if not isinstance(zo, dict):
        c.fail(f"{path}: zero_optimization = {zo!r}: expected an object")
    o.zero_stage = c.value(f"{path}: zero_optimization.stage", zo.get("stage", 0), [0, 1, 2, 3])
    for what in ("optimizer", "param"):
        dev = (zo.get(f"offload_{what}") or {}).get("device", "none")
        setattr(o, f"offload_{what}_device",
                c.value(f"{path}: zero_optimization.offload_{what}.device", dev, ["none", "cpu", "nvme"]))
    for key in ("stage3_gather_16bit_weights_on_model_save", "memory_efficient_linear"):  # the booleans read here
        if zo.get(key, "auto") != "auto":  # "auto": refused later, when nothing fills it (backends.deepspeed)
            zo[key] = c.value(f"{path}: zero_optimization.{key}", zo[key], bool)
    o.zero3_save_16bit_model = bool(zo.get("stage3_gather_16bit_weights_on_model_save", False))
    _read_ds_ac(c, js, path)
    bf16 = (js.get("bf16") or {}).get("enabled", False)
    fp16 = (js.get("fp16") or {}).get("enabled", False)
    if fp16 not in (False, "false"):
        c.fail(f"{path}: fp16.enabled = {fp16!r}: this guide trains in bf16 or fp32; allowed: false")
    if bf16 == "auto":  # filled at launch: on, unless --model-dtype fp32 (see load_job_config)
        return "bf16", notes
    mp: Precision = "bf16" if c.value(f"{path}: bf16.enabled", bf16, bool) else "no"
    return mp, notes


def _read_ds_ac(c: _Checker, js: dict, path: str) -> None:
    """The JSON's activation_checkpointing section: each sub-key checked; one that asks for something it cannot
    do here is remembered for a note (unapplied_notes)."""
    if "activation_checkpointing" not in js:
        return
    sec = js["activation_checkpointing"]
    if not isinstance(sec, dict):
        c.fail(f"{path}: activation_checkpointing = {sec!r}: expected an object (even empty: {{}} turns the "
               "model's activation checkpointing on)")
    for k, v in sec.items():
        if k not in _DS_AC_KEYS:
            near = difflib.get_close_matches(str(k), list(_DS_AC_KEYS), n=1)
            c.fail(f"{path}: unknown key activation_checkpointing.{k}{f' (did you mean {near[0]}?)' if near else ''}"
                   f"; allowed: {', '.join(sorted(_DS_AC_KEYS))}")
        rule, default, _ = _DS_AC_KEYS[k]
        if v is not None and v != default:
            c.value(f"{path}: activation_checkpointing.{k}", v, rule)
            c.no_effect("activation_checkpointing", k, v)
