"""What a job imports at start-up and never uses stays out (benchmarks/startup.py measures the time)."""

import subprocess
import sys

PROBE = """
import sys, torch
from helpers.job.backends.deepspeed import MUON, _import_muon_eagerly
from deepspeed.runtime import compiler
before = compiler.compile
_import_muon_eagerly({OPT})
print(MUON in sys.modules, "torch._inductor.compile_fx" in sys.modules, compiler.compile is before)
"""


def _probe(opt: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE.replace("{OPT}", opt)], capture_output=True, text=True,
                         check=True)
    return out.stdout.strip().splitlines()[-1].split()  # after DeepSpeed's own start-up lines


def test_deepspeed_muon_module_loads_without_compiling_its_kernels():
    # the module ZeRO's optimizer check asks for is there, real, and cost no torch.compile; compile restored
    loaded, compiled, restored = _probe("{}")
    assert (loaded, compiled, restored) == ("True", "False", "True")


def test_a_json_that_asks_for_muon_gets_deepspeeds_own_import():
    loaded, compiled, restored = _probe("{'optimizer': {'type': 'Muon'}}")
    assert (loaded, restored) == ("False", "True")
