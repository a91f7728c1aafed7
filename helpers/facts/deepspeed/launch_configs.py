"""DeepSpeed (0.19.8) facts the guide states about the README and the launch configs' comments.

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from unittest import mock

from .. import fact, one_rank_group
from .._tools import ds_engine, source_has

V = "0.19.8"


def _cpu_builder(name: str):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    return CPU_Accelerator().create_op_builder(name)


@fact("deepspeed.cpu_comm_builds_shm_op",
      "On a CPU DeepSpeed's torch communication backend loads a small C++ op (ShareMemCommBuilder), built on "
      "first use and cached.",
      "deepspeed", V, "comm/torch.py: build_shm_op, TorchBackend.__init__; accelerator/cpu_accelerator.py: "
      "create_op_builder")
def _shm():
    b = _cpu_builder("ShareMemCommBuilder")
    ok_src, _ = source_has("deepspeed.comm.torch.build_shm_op", "create_op_builder(\"ShareMemCommBuilder\")")
    ok_init, _ = source_has("deepspeed.comm.torch.TorchBackend.__init__", "self.shm_comm_op = build_shm_op()")
    name = type(b).__name__
    return name == "ShareMemCommBuilder" and ok_src and ok_init and hasattr(b, "jit_load"), {
        "builder": name, "called by TorchBackend": ok_init}


@fact("deepspeed.async_io_sources_debug",
      "DeepSpeed's async_io op (CPU builder) has 12 C++ sources, nine of which include torch headers, and "
      "compiles them with debug information (-g).",
      "deepspeed", V, "ops/op_builder/cpu/async_io.py: AsyncIOBuilder.sources, cxx_args; "
      "ops/op_builder/cpu/builder.py: CPUOpBuilder.cxx_args")
def _aio_sources():
    b = _cpu_builder("AsyncIOBuilder")
    root = Path(b.deepspeed_src_path(""))
    inc = [root / p for p in b.include_paths()]

    def reaches_torch(path: Path, seen: set) -> bool:
        if path in seen or not path.is_file():
            return False
        seen.add(path)
        text = path.read_text(errors="replace")
        if re.search(r"#include\s*<(torch|ATen)/", text):
            return True
        for local in re.findall(r'#include\s*"([^"]+)"', text):
            for d in (path.parent, *inc):
                if reaches_torch(d / local, seen):
                    return True
        return False

    srcs = b.sources()
    with_torch = sum(reaches_torch(root / s, set()) for s in srcs)
    args = b.cxx_args()
    return len(srcs) == 12 and with_torch == 9 and "-g" in args, {
        "sources": len(srcs), "include torch": with_torch, "-g": "-g" in args}


@fact("deepspeed.save_checkpoint_no_16bit",
      "DeepSpeed's save_checkpoint writes no consolidated 16-bit weights, even with "
      "stage3_gather_16bit_weights_on_model_save; only engine.save_16bit_model does.",
      "deepspeed", V, "runtime/engine.py: DeepSpeedEngine.save_checkpoint, save_16bit_model", runs=True)
def _no_16bit():
    one_rank_group()
    eng = ds_engine({"stage": 3, "stage3_gather_16bit_weights_on_model_save": True})
    with tempfile.TemporaryDirectory() as d:
        eng.save_checkpoint(d, tag="t")
        files = sorted(p.name for p in Path(d, "t").iterdir())
        eng.save_16bit_model(d, "w.bin")
        has_16 = Path(d, "w.bin").is_file()
    bin_in_ckpt = [f for f in files if "pytorch_model" in f and "states" not in f]
    return not bin_in_ckpt and has_16, {"save_checkpoint wrote": ", ".join(files), "save_16bit_model": has_16}


@fact("deepspeed.checkpoint_pickle_classes",
      "Beyond tensors and plain data, DeepSpeed's ZeRO-1/2/3 checkpoint files hold three classes: ZeroStageEnum, "
      "LossScaler and fragment_address.",
      "deepspeed", V, "runtime/zero/stage3.py, stage_1_and_2.py: state_dict; runtime/fp16/loss_scaler.py; "
      "utils/tensor_fragment.py: fragment_address", runs=True)
def _pickle_classes():
    import torch

    one_rank_group()
    found: dict[str, list[str]] = {}
    for stage in (1, 3):
        eng = ds_engine({"stage": stage})
        loss = eng(torch.ones(1, 16, dtype=torch.bfloat16)).float().sum()
        eng.backward(loss)
        eng.step()
        with tempfile.TemporaryDirectory() as d:
            eng.save_checkpoint(d, tag="t")
            for p in sorted(Path(d, "t").glob("*.pt")):
                for g in torch.serialization.get_unsafe_globals_in_checkpoint(str(p)):
                    found.setdefault(g.rsplit(".", 1)[-1], []).append(f"z{stage}")
    names = set(found)
    return names == {"ZeroStageEnum", "LossScaler", "fragment_address"}, {
        k: "/".join(sorted(set(v))) for k, v in sorted(found.items())}


@fact("deepspeed.load_checkpoint_weights_only_false",
      "DeepSpeed's load_checkpoint reads its files with torch.load(weights_only=False).",
      "deepspeed", V, "runtime/checkpoint_engine/torch_checkpoint_engine.py: TorchCheckpointEngine.load")
def _wo_false():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "x.pt")
        torch.save({"a": torch.ones(1)}, p)
        with mock.patch("torch.load", wraps=torch.load) as spy:
            TorchCheckpointEngine().load(p)
    wo = spy.call_args.kwargs.get("weights_only", "unset")
    return wo is False, {"weights_only": wo}


@fact("deepspeed.gradient_clipping_zero_off",
      "A DeepSpeed config with gradient_clipping 0.0 turns clipping off (DeepSpeed clips only above 0; "
      "without the key it clips at 1.0).",
      "deepspeed", V, "runtime/config.py: get_gradient_clipping; runtime/engine.py: "
      "DeepSpeedEngine._take_model_step")
def _clip_off():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import get_gradient_clipping

    zero, default = get_gradient_clipping({"gradient_clipping": 0.0}), get_gradient_clipping({})
    ok_src, _ = source_has("deepspeed.runtime.engine.DeepSpeedEngine._take_model_step",
                           "if self.gradient_clipping() > 0.0:")
    return zero == 0.0 and default == 1.0 and ok_src, {"with 0.0": zero, "without key": default,
                                                      "clips only if > 0": ok_src}
