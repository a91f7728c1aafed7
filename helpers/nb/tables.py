"""Tables the notebooks print from run directories: the precision table of Hugging Face's write-up on aligning
FSDP and DeepSpeed (the "write-up") next to the measured
dtypes (notebooks/02), where each kind of state lives per offload setting (notebooks/03)."""

from __future__ import annotations

from helpers.core.mapping import CATEGORIES
from helpers.job.observe.offload import LOCATIONS
from helpers.job.observe.precision import PROBE_KEYS

# ----------------------------------------------------------------- the seeds' table, next to the measurement

PRECISION_MODES = {"fsdp_low": "FSDP low precision", "fsdp_mixed": "FSDP aligned (mixed)",
                   "deepspeed": "DeepSpeed ZeRO-3"}
# The seeds' precision table (shared/REFERENCE.md) as claims about probe rows:
# probe key -> (the seed's row, FSDP low precision, FSDP mixed, DeepSpeed).
SEED_TABLE = {
    "loaded": ("model loaded as", "bf16", "bf16", "bf16"),
    "stored_param": ("flat/sharded params prepared as", "bf16", "fp32", "fp32"),
    "optimizer_param": ("flat/sharded params prepared as", "bf16", "fp32", "fp32"),
    "forward_weight": ("forward/backward compute", "bf16", "bf16", "bf16"),
    "grad_before_reduce": ("forward/backward compute", "bf16", "bf16", "bf16"),
    "optimizer_states": ("optimizer states and step", "bf16", "fp32", "fp32"),
}


def seed_claim(key: str, mode: str) -> str | None:
    row = SEED_TABLE.get(key)
    return row[1 + list(PRECISION_MODES).index(mode)] if row else None


def seed_differences(dtypes: dict[str, dict]) -> list[tuple[str, str, str, str]]:
    """(probe key, mode, measured, seed) wherever a run's ``dtypes`` contradicts the seeds' table."""
    out = []
    for mode, d in dtypes.items():
        for key in SEED_TABLE:
            claim = seed_claim(key, mode)
            if d.get(key) != claim:
                out.append((key, mode, d.get(key), claim))
    return out


def dtype_table(dtypes: dict[str, dict]):
    """Measured dtypes (rows: probe keys; columns: modes), each cell marked where it differs from the seeds.

    ``dtypes`` maps a PRECISION_MODES key to a run's ``summary["dtypes"]``. A cell reads
    ``bf16``, ``-`` (no such tensor), or ``bf16 != write-up fp32``.
    """
    import pandas as pd

    rows = {}
    for key in PROBE_KEYS:
        row = {"write-up's row": SEED_TABLE[key][0] if key in SEED_TABLE else ""}
        for mode, d in dtypes.items():
            got, claim = d.get(key) or "-", seed_claim(key, mode)
            row[PRECISION_MODES[mode]] = got if claim in (None, got) else f"{got} != write-up {claim}"
        rows[key] = row
    return pd.DataFrame.from_dict(rows, orient="index")


def loss_drop(losses: list[float], last: int = 10) -> float:
    """First loss minus the mean of the last ``last`` losses (the mean evens out batch-to-batch noise)."""
    tail = losses[-last:]
    return losses[0] - sum(tail) / len(tail)


# --------------------------------------------------------------------------- reading runs


def settings_table(configs: dict):
    """One row per config (dict label -> path under launch_configs/, no suffix): its offload keys."""
    import pandas as pd

    from helpers.core.config import load_job_config

    rows = {}
    for label, path in configs.items():
        job = load_job_config(f"launch_configs/{path}.yaml")
        if job.fsdp:
            on = job.fsdp.offload_params
            rows[label] = {"key": f"fsdp_offload_params: {str(on).lower()}",
                           "optimizer states to": "host" if on else "-", "params to": "host" if on else "-"}
        else:
            ds = job.deepspeed
            name = {"none": "-", "cpu": "host", "nvme": "disk"}
            rows[label] = {"key": f"offload_optimizer: {ds.offload_optimizer_device}, "
                                  f"offload_param: {ds.offload_param_device}",
                           "optimizer states to": name[ds.offload_optimizer_device],
                           "params to": name[ds.offload_param_device]}
    return pd.DataFrame(rows).T


def where(run, category: str, rank: int = 0) -> dict[str, int]:
    """{location: bytes} of one category in a finished run, locations holding nothing left out."""
    return {loc: n for loc, n in run.summary["memory_location_bytes"][rank][category].items() if n}


def location_table(runs: dict, rank: int = 0, unit: float = 1e6):
    """One row per run (dict label -> Run), one column per category: 'host 41.7' (MB), places joined by ' + '."""
    import pandas as pd

    rows = {}
    for label, run in runs.items():
        rows[label] = {cat: " + ".join(f"{loc} {n / unit:.1f}" for loc, n in where(run, cat, rank).items()) or "-"
                       for cat in CATEGORIES}
    return pd.DataFrame(rows).T


def location_totals(runs: dict, rank: int = 0, unit: float = 1e6):
    """One row per run: MB of state on device, host and disk, and the total."""
    import pandas as pd

    rows = {}
    for label, run in runs.items():
        locs = run.summary["memory_location_bytes"][rank]
        rows[label] = {loc: sum(locs[c][loc] for c in CATEGORIES) / unit for loc in LOCATIONS}
        rows[label]["total"] = sum(rows[label].values())
    return pd.DataFrame(rows).T.round(1)
