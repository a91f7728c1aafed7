"""``python -m helpers.universal_native SRC OUT``: DeepSpeed's own ZeRO-3 files at one rank from any checkpoint the
converter reads, for ``ds_to_universal`` to read in turn (helpers.universal.native_at_one_rank runs it in its own
process: it opens a one-rank process group and a DeepSpeed engine)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _save_native(src: str, out: str) -> None:
    """One rank, ZeRO-3, fp32: the model from the checkpoint's config, its state imported, ``save_checkpoint``."""
    import json
    import tempfile
    from types import SimpleNamespace

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import torch
    import torch.distributed as dist

    from helpers.convert import read_consolidated
    from helpers.core.models import build_model, resolve_model
    from helpers.job.checkpoint import read_meta
    from helpers.job.ds_import import import_deepspeed

    meta = read_meta(src)
    state = read_consolidated(src, meta)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(meta["model_config"]))
        model = build_model(resolve_model(d), torch.float32, seed=0)
    model.load_state_dict(state["model"], strict=False)  # a tied alias is one tensor: loaded once
    trained = {n for g in state["optim"]["param_groups"] for n in g["params"]}
    for n, prm in model.named_parameters():
        prm.requires_grad_(n in trained)  # frozen parameters: weights only, as saved
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    import deepspeed

    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], foreach=False)
    js = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1,
          "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**12}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=js)
    import_deepspeed(SimpleNamespace(engine=engine, module=engine.module), state)
    engine.save_checkpoint(str(Path(out) / "ds"), tag="ds", client_state={}, save_latest=False)


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    _save_native(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    os._exit(0)  # skip a teardown that gloo's threads can abort
