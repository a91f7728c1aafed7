"""``python -m helpers.workcopy``: the learner's working copy of the notebooks (the code: helpers.nb.workcopy)."""

import sys

from helpers.nb.workcopy import main

if __name__ == "__main__":
    sys.exit(main())
