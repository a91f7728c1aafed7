"""The two backends behind one interface: ``apply_backend(model, job, device)`` returns an engine
(helpers.job.backends.fsdp's FSDPEngine or helpers.job.backends.deepspeed's DeepSpeedEngine)."""


def optimizer_impl(optimizer) -> str | None:
    """How the optimizer the job steps runs, read from it: for-loop, foreach, fused, torch-default (foreach
    and fused left unset: torch picks) or null (not a torch optimizer with those options)."""
    from helpers.core.internals import torch_optimizer

    inner = torch_optimizer(optimizer)  # ZeRO's wrapper holds the torch optimizer
    group = inner.param_groups[0] if getattr(inner, "param_groups", None) else {}
    if "fused" not in group and "foreach" not in group:
        return None
    if group.get("fused"):
        return "fused"
    if group.get("foreach") is None:
        return "torch-default"
    return "foreach" if group["foreach"] else "for-loop"


def apply_backend(model, job, device):
    if job.backend == "fsdp":
        from helpers.job.backends.fsdp import apply_fsdp

        return apply_fsdp(model, job, device)
    from helpers.job.backends.deepspeed import apply_deepspeed

    return apply_deepspeed(model, job, device)
