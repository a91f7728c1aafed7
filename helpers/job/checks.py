"""The job's input checks that need the model or the libraries (validate's second half, helpers.job.run): the
resolved config, activation-checkpointing notes, the observers' flags. Each raises ConfigError before any
process group exists."""

from __future__ import annotations


def resolve_job(job, world_size: int) -> tuple[dict, list[str]]:
    """The config as it will run (DeepSpeed "auto" filled); raises ConfigError before anything starts."""
    from helpers.core.config import ConfigError

    resolved, filled = job.to_dict(), []
    if job.backend == "deepspeed":
        import torch

        from helpers.core.models import model_config, resolve_model
        from helpers.job.backends.deepspeed import check_with_deepspeed, resolved_ds_config

        hidden = getattr(model_config(resolve_model(job.train.model)), "hidden_size", None)
        try:
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
            resolved["deepspeed"]["json"], filled = resolved_ds_config(job, world_size, hidden, device_type)
            check_with_deepspeed(resolved["deepspeed"]["json"], device_type)
        except ValueError as e:
            raise ConfigError(f"{job.source}: {e}") from None
        resolved["deepspeed"]["filled"] = filled  # which "auto" values the job filled
    return resolved, filled


def checkpointing_notes(job, spec) -> list[str]:
    """helpers.job.recompute's notes: an offload with nothing to free on a CPU, the model's own checkpointing."""
    import torch

    from helpers.core.models import model_config
    from helpers.job.recompute import notes

    own = spec.kind != "preset" and bool(getattr(model_config(spec), "gradient_checkpointing", False))
    return notes(job, accelerator=torch.cuda.is_available(), model_checkpoints=own)


def check_observers(job, spec, args) -> None:
    """Bad --profile / --trace-tensors / --trace-activations / --memory-budget-gib / wrap-policy input is refused
    before any rank starts (ConfigError)."""
    import torch

    from helpers.core.config import ConfigError
    from helpers.job.observe.profiling import MIN_STEPS

    if args.memory_budget_gib and args.profile and not torch.cuda.is_available():
        raise ConfigError("--memory-budget-gib with --profile: on a CPU the budget is checked against "
                          "peak_tensor_bytes, which --profile leaves untracked (one profiler per thread); drop one")
    if args.profile and job.train.steps < MIN_STEPS:
        raise ConfigError(f"--steps = {job.train.steps}: --profile records steps after warm-up and needs "
                          f"--steps >= {MIN_STEPS}")
    for flag, module in (("trace_tensors", "tensor_trace"), ("trace_activations", "activation_trace")):
        if getattr(args, flag):
            import importlib

            why = importlib.import_module(f"helpers.job.observe.{module}").check(job)
            if why:
                raise ConfigError(f"{job.source}: {why}")
    if job.backend == "fsdp":
        from helpers.job.wrap import check_wrap_policy

        check_wrap_policy(job, spec)
