"""``--trace-activations``: an exact fingerprint of every module's output, and of the gradient that reaches it.

Where ``--trace-tensors`` says *which parameter* two runs first part on, this says *which module*: per step,
rank and micro-batch, every module's forward output in the order the forwards finish (innermost first), and the
gradient of that output in the order backward reaches it. Two runs whose weights are the same part in the
forward at the first module whose output differs, or in the backward at the first output gradient that does.

The fingerprint is ``helpers.job.observe.tensor_trace.fingerprint`` (exact: any changed value of any element
changes it; a zero's sign does not count) over the module's floating-point outputs, one after the other (a tuple
or a ModelOutput: each tensor at its running offset). A module called twice in one forward gets ``NAME#2`` for
its second call. Only the model's own forward is recorded: activation checkpointing runs blocks again during
backward, and those recomputed forwards are not (their outputs are the same tensors' values; their gradients are
recorded once, on the outputs of the first forward).

Every rank fingerprints its own micro-batches; at each step's end the records are gathered to rank 0, which
writes ``DIR/activation_trace.jsonl``: a first line ``{"modules": {NAME: CLASS}, "biased": [NAME, ...]}`` (every
module and its class; the modules with a bias parameter), then one line per step ``{"step": S, "ranks":
[[{"forward": [[NAME, FP, DTYPE], ...], "backward": [...]}, ...micro-batches], ...ranks]}``. ``python -m
helpers.compare`` reads it. Not with ``--compile`` (hooks on every module; see ``check``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from helpers.core.dtypes import short
from helpers.core.metrics import ACTIVATION_FILE
from helpers.core.models import clean_fqn
from helpers.job.observe.base import gather
from helpers.job.observe.tensor_trace import fingerprint, hex_of


def check(job) -> str | None:
    """Why --trace-activations cannot trace this job (None: it can)."""
    if job.train.compile:
        return "--trace-activations hooks every module eagerly; drop --compile"
    return None


def _floats(out):
    """The floating-point tensors of a module's output, in order (tuples, lists, dicts, ModelOutputs)."""
    if isinstance(out, torch.Tensor):
        if out.is_floating_point():
            yield out
    elif isinstance(out, (tuple, list)):
        for x in out:
            yield from _floats(x)
    elif isinstance(out, dict):  # ModelOutput is an OrderedDict of the fields that are set
        for x in out.values():
            yield from _floats(x)


class ActivationTracer:
    """Observer body: forward hooks on every module, a gradient hook on each output (see the module doc)."""

    def __init__(self, out_dir: str | Path, rank: int):
        self.path = Path(out_dir) / ACTIVATION_FILE
        self.rank = rank
        self.handles: list = []
        self.file = None

    def on_train_begin(self, model) -> None:
        self.names = {m: clean_fqn(n) or "(model)" for n, m in model.named_modules()}
        self.in_forward = False
        self.handles.append(model.register_forward_pre_hook(self._begin))
        for m in self.names:
            self.handles.append(m.register_forward_hook(self._record))
        self.handles.append(model.register_forward_hook(self._end))  # after the model's own record
        if self.rank == 0:
            self.file = self.path.open("w")
            biased = [n for m, n in self.names.items() if isinstance(getattr(m, "bias", None), torch.nn.Parameter)]
            self.file.write(json.dumps({"modules": {n: type(m).__name__ for m, n in self.names.items()},
                                        "biased": biased}) + "\n")

    def on_step_begin(self, step: int) -> None:
        self.micro: list[dict] = []

    def on_step_end(self, step: int) -> None:
        ranks = gather(self.micro) if dist.is_initialized() else [self.micro]
        if self.file is not None:
            self.file.write(json.dumps({"step": step, "ranks": ranks}) + "\n")
            self.file.flush()

    def on_train_end(self) -> None:
        for h in self.handles:
            h.remove()
        if self.file is not None:
            self.file.close()

    # ---------------------------------------------------------------- hooks

    def _begin(self, module, args) -> None:
        if torch.is_grad_enabled():
            self.in_forward = True
            self.calls: dict[str, int] = {}
            self.micro.append({"forward": [], "backward": []})

    def _end(self, module, args, output) -> None:
        self.in_forward = False

    def _record(self, module, args, output) -> None:
        if not self.in_forward:
            return  # a recomputation during backward, or an evaluation forward
        name = self.names[module]
        k = self.calls[name] = self.calls.get(name, 0) + 1
        key = name if k == 1 else f"{name}#{k}"
        tensors = list(_floats(output))
        if not tensors:
            return
        rec = self.micro[-1]
        rec["forward"].append([key, self._fold(tensors), short(tensors[0].dtype)])
        grads: dict[int, torch.Tensor] = {}
        live = [t for t in tensors if t.requires_grad]

        def on_grad(i, grad):
            grads[i] = grad
            if len(grads) == len(live):  # every output's gradient has arrived: one record for the module
                rec["backward"].append([key, self._fold([grads[j] for j in range(len(live))]), short(grad.dtype)])
        for i, t in enumerate(live):
            t.register_hook(lambda g, i=i: on_grad(i, g))

    @staticmethod
    def _fold(tensors: list[torch.Tensor]) -> str:
        total, offset = torch.zeros(2, dtype=torch.int64), 0
        for t in tensors:
            total += fingerprint(t.detach() + 0.0, offset)  # + 0.0: -0.0 becomes 0.0 (equal values, one print)
            offset += t.numel()
        return hex_of(total)
