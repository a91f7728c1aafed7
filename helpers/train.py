"""The job entry point: ``torchrun [--nnodes M] --nproc_per_node N -m helpers.train --config X --out DIR``.

One code path for 1 rank, N ranks and N nodes; the job's phases are in helpers.job.run.
"""

import os
import sys

from helpers.job.run import main

if __name__ == "__main__":
    code = main()
    # Everything is written and closed. Skip the interpreter's teardown: once in a while a C++
    # communication thread (gloo) still alive at finalization aborts the process ("terminate called
    # without an active exception", SIGABRT), and torchrun would report a finished run as failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
