"""Build DeepSpeed checkpoints in layouts the guide's own jobs never write, convert them both ways, resume.

    torchrun --standalone --nproc_per_node 2 tests/ds_layouts.py OUT STAGE

The model is the tiny Llama with tied embeddings (``lm_head.weight`` is ``embed_tokens.weight``: one of
DeepSpeed's ``shared_params``) and a frozen MLP in block 0 (``frozen_param_shapes``). ZeRO-3 runs with a
``sub_group_size`` small enough to cut each rank's partition into several sub-groups; under ZeRO-1/2,
``parameter_alignment`` pads each parameter whose size is not a multiple of 8 (the 6-element k/v biases)
in the flat buffer: DeepSpeed's ``param_alignment_paddings``. Two steps, then:

- OUT/step_2: DeepSpeed's checkpoint in the guide's layout (its files in ds/ds, and meta.json);
- OUT/truth.pt: every trainable parameter's fp32 master and Adam state, read from the live engine;
- OUT/to_fsdp, OUT/back: ``helpers.convert`` of step_2 to FSDP (DCP), and of that back to DeepSpeed;
- step 3 twice: by the engine that saved (OUT/loss3_save.json), and by a fresh engine that imported
  OUT/back/full.pt through helpers.job.checkpoint (OUT/loss3_resume.json). Exact resume: the two are equal.
"""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from helpers.core import safeload  # noqa: E402
from helpers.core.models import model_config, resolve_model  # noqa: E402

SUB_GROUP = 20_000  # elements: each rank's ZeRO-3 partition falls into several sub-groups
FROZEN = "model.layers.0.mlp."


def build(stage: int, state: dict | None = None):
    torch.manual_seed(0)
    cfg = model_config(resolve_model("tiny"))
    cfg.tie_word_embeddings = True
    cfg.attention_bias, cfg.head_dim, cfg.num_key_value_heads = True, 6, 1  # 6-element k/v biases: paddings
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    if state is not None:  # weights before initialize, as helpers.job.checkpoint.before_backend does
        missing = model.load_state_dict(state["model"], strict=False).missing_keys
        assert missing == ["lm_head.weight"], missing  # the alias of the tied embedding
    for n, p in model.named_parameters():
        p.requires_grad_(not n.startswith(FROZEN))
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "zero_optimization": {"stage": stage, "sub_group_size": SUB_GROUP, "parameter_alignment": True,
                                "stage3_param_persistence_threshold": 0},
          "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "steps_per_print": 10**9}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    return engine


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step * 10 + int(os.environ.get("RANK", 0)))
    return torch.randint(0, 1000, (2, 16), generator=g)


def train(engine, step: int) -> float:
    ids = batch(step)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    t = loss.detach().float()
    torch.distributed.all_reduce(t)
    return float(t) / torch.distributed.get_world_size()


def main():
    out, stage = Path(sys.argv[1]), int(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    engine = build(stage)
    for s in (1, 2):
        train(engine, s)
    ck = out / "step_2"  # the guide's layout (helpers.job.checkpoint): DeepSpeed's files in ds/ds, then meta.json
    engine.save_checkpoint(str(ck / "ds"), tag="ds")
    truth = {n: {"w": safe_get_full_fp32_param(p).clone(),
                 **{k: safe_get_full_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")}}
             for n, p in engine.module.named_parameters() if p.requires_grad}
    if rank == 0:
        from helpers.convert import convert
        from helpers.job.checkpoint import META, param_shapes

        (ck / META).write_text(json.dumps({"format": "deepspeed", "backend": "deepspeed", "world_size": 2, "step": 2,
                                           "model": "tiny", "param_shapes": param_shapes(engine.module),
                                           "model_config": engine.module.config.to_dict()}))
        torch.save(truth, out / "truth.pt")
        convert(str(ck), str(out / "to_fsdp"), "fsdp")
        convert(str(out / "to_fsdp"), str(out / "back"), "deepspeed")
    losses = {"save": train(engine, 3)}
    torch.distributed.barrier()  # the conversions are written
    state = safeload.load(out / "back" / "full.pt", "full")
    fresh = build(stage, state)

    from helpers.job.ds_import import import_deepspeed

    import_deepspeed(SimpleNamespace(engine=fresh, module=fresh.module), state)
    losses["resume"] = train(fresh, 3)
    if rank == 0:
        (out / "loss3.json").write_text(json.dumps(losses))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    # As helpers.train: skip the interpreter's teardown, where a gloo thread still alive now and then
    # aborts the process ("terminate called without an active exception") and torchrun fails the run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
