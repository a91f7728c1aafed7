"""Accelerate (1.15.0) facts the guide states about throughput (07) and memory and batch size (08).

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

import os
from unittest import mock

from .. import fact

V = "1.15.0"
FSDP2_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
             "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer"}


def _plugin(**env):
    from accelerate.utils import FullyShardedDataParallelPlugin

    with mock.patch.dict(os.environ, {**FSDP2_ENV, **env}):  # what `accelerate launch` sets from the YAML
        return FullyShardedDataParallelPlugin()


@fact("accelerate.fsdp2_offload_params_policy",
      "Under FSDP2, fsdp_offload_params: true becomes torch's CPUOffloadPolicy.",
      "accelerate", V, "utils/dataclasses.py: FullyShardedDataParallelPlugin.__post_init__ (cpu_offload)")
def _offload():
    on, off = _plugin(FSDP_OFFLOAD_PARAMS="true"), _plugin(FSDP_OFFLOAD_PARAMS="false")
    names = type(on.cpu_offload).__name__, type(off.cpu_offload).__name__
    return names[0] == "CPUOffloadPolicy" and names[1] != "CPUOffloadPolicy", {"true": names[0], "false": names[1]}
