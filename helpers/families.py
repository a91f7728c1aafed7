"""``python -m helpers.families``: the family sweep (the code: helpers.job.sweep; the models: helpers.core.families)."""

import os
import sys

from helpers.job.sweep import main

if __name__ == "__main__":
    sys.stdout.flush()
    code = main()
    sys.stdout.flush()
    os._exit(code)  # as helpers.train: skip a teardown that gloo's threads can abort
