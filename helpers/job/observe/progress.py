"""Rank 0's progress bar (tqdm on stderr): steps done, loss, tokens/s per rank.

It appears only once a job's training loop has run for ``DELAY_S`` seconds,
so short jobs (tests, quick notebook runs) print nothing extra. Two looks:

* a terminal (stderr is a tty): the usual bar, redrawn in place; the
  ``step ...`` lines rank 0 prints go above it (``Progress.printing``);
* a pipe (a notebook ``%%bash`` cell, a CI log, ``2> file``): one plain
  ASCII line every ``LINE_INTERVAL_S`` seconds and one at the end - a
  captured ``\\r`` redraw would pile up in the cell or the log.

The bar never reaches ``log.txt``: that file holds what ``RunDir.log``
writes, clean lines only. ``GUIDE_PROGRESS=0`` turns the bar off (so do
tqdm's own ``TQDM_DISABLE=1`` and the other ``TQDM_*`` variables).
"""

from __future__ import annotations

import contextlib
import os
import sys

DELAY_S = 3.0
LINE_INTERVAL_S = 5.0


class _Lines:
    """A file for tqdm that turns each redraw into one plain line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()  # a clear ("\r   \r") leaves nothing
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


class Progress:
    """``update(loss, tokens_per_s)`` once per step; ``close()`` at the end. Inactive off rank 0."""

    def __init__(self, total: int, active: bool, initial: int = 0):
        self.bar = None
        if not active or os.environ.get("GUIDE_PROGRESS", "1") == "0":
            return
        from tqdm import tqdm

        tqdm.monitor_interval = 0  # no monitor thread in a training process
        self.tty = sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", delay=DELAY_S, leave=True, miniters=1,
                        file=sys.stderr if self.tty else _Lines(sys.stderr),
                        mininterval=0.5 if self.tty else LINE_INTERVAL_S, dynamic_ncols=self.tty,
                        ascii=None if self.tty else True, ncols=None if self.tty else 100)

    def update(self, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}, {tokens_per_s:,.0f} tok/s/rank", refresh=False)
            self.bar.update(1)

    @contextlib.contextmanager
    def printing(self):
        """Print to stdout inside this block without tearing the bar (terminal only)."""
        if self.bar is not None and self.tty:
            with self.bar.external_write_mode(file=sys.stdout):
                yield
        else:
            yield

    def close(self) -> None:
        if self.bar is not None:
            if not self.tty and self.bar.last_print_n == self.bar.n:
                self.bar.leave = False  # the last line already says it: no second one
            self.bar.close()
            self.bar = None
