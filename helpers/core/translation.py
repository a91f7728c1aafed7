"""What both directions of ``python -m helpers.translate`` share: the Translation they fill in and write out.

A Translation holds the YAML (and, for DeepSpeed, the JSON) written, with a ``warning:`` for every setting
that has no exact counterpart and a ``note:`` for keys that only matter to logging or the launcher.
The rules of each direction: ``helpers.core.fsdp_to_deepspeed`` and ``helpers.core.deepspeed_to_fsdp``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from helpers.core.mapping import CATEGORIES

# Top-level keys that only tell `accelerate launch` where and how many: copied as they are.
_LAUNCH_KEYS = ["compute_environment", "debug", "downcast_bf16", "enable_cpu_affinity", "gpu_ids", "machine_rank",
                "main_process_ip", "main_process_port", "main_training_function", "num_machines", "num_processes",
                "rdzv_backend", "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "use_cpu",
                "dynamo_config"]


@dataclass
class Translation:
    source: str
    to: str
    yaml: dict
    json: dict | None = None  # the DeepSpeed JSON (to deepspeed only)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not self.warnings

    def header(self) -> str:
        lines = [f"Translated from {self.source} by python -m helpers.translate --to {self.to}."]
        lines += ["Exact: no setting changed meaning."] if self.exact else [
            "Not exact - nearest choices were written for:", *[f"  warning: {w}" for w in self.warnings]]
        lines += [f"  note: {n}" for n in self.notes]
        return "".join(f"# {line}\n" for line in lines)

    def write(self, out: str) -> list[Path]:
        """Write OUT.yaml (and OUT.json for DeepSpeed); returns the paths written."""
        out_p = Path(out)
        out_p.parent.mkdir(parents=True, exist_ok=True)
        written = []
        data = dict(self.yaml)
        if self.json is not None:
            js = out_p.with_suffix(".json")
            js.write_text(json.dumps(self.json, indent=2) + "\n")
            written.append(js)
            data["deepspeed_config"] = {"deepspeed_config_file": _path_for_yaml(js), **data["deepspeed_config"]}
        out_p.write_text(self.header() + yaml.safe_dump(data, sort_keys=False))
        return [out_p, *written]


def _path_for_yaml(p: Path) -> str:
    """Relative to the working directory when under it (as the shipped configs are), else absolute."""
    p = p.resolve()
    try:
        return str(p.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def _gap(src, dst) -> str:
    """What differs between two modes, in sentences, from the mapping data: what one shards and the other
    keeps whole on every rank, then the modes' notes."""
    def name(m):
        return m.fsdp1 if m.backend == "fsdp" else m.zero

    parts = []
    for a, b in ((dst, src), (src, dst)):
        extra = [c.replace("_", " ") for c in CATEGORIES if c in a.sharded and c not in b.sharded]
        if extra:
            parts.append(f"{name(a)} shards the {' and '.join(extra)}, which {name(b)} keeps whole on every rank")
    return "; ".join(parts + [f"under {name(m)}, {m.note}" for m in (dst, src) if m.note])


def _launch_keys(raw: dict) -> dict:
    return {k: raw[k] for k in _LAUNCH_KEYS if k in raw}
