"""``python -m helpers.config``: validate a launch config (the code: helpers.core.config)."""

import sys

from helpers.core.config import main

if __name__ == "__main__":
    sys.exit(main())
