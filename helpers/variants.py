"""``python -m helpers.variants DIR --out OUT``: every launch config of DIR trained or refused, in one process
group (the code: helpers.job.sweep)."""

import os
import sys

from helpers.job.sweep import variants_main

if __name__ == "__main__":
    sys.stdout.flush()
    code = variants_main()
    sys.stdout.flush()
    os._exit(code)  # as helpers.train: skip a teardown that gloo's threads can abort
