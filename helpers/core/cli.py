"""The argument parser of the guide's command-line tools (``python -m helpers.train``, ``helpers.launch``,
``helpers.estimate``): a bad argument is one ``error:`` line, like every other bad input."""

from __future__ import annotations

import argparse


def first_line(e: BaseException, limit: int | None = None) -> str:
    """The first line of an exception's message (its class name when it has none), for a one-line error."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are ``error: MESSAGE (see PROG --help)`` and exit status 2 (argparse's own
    prints the usage first)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")
