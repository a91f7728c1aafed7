"""The argument parser of the guide's command-line tools (``python -m helpers.train``, ``helpers.launch``,
``helpers.estimate``): a bad argument is one ``error:`` line, like every other bad input."""

from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are ``error: MESSAGE (see PROG --help)`` and exit status 2 (argparse's own
    prints the usage first)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")
