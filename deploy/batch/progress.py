"""Progress of a batch: a bar on stderr fed either by the in-process runner or by watching OUT grow.

Mental model: a finished request is a whole line in OUT, so "done" is the number of whole lines:
the ones there before the run plus the newlines appended since. A Ray job writes OUT from another
process, so `OutputWatcher` re-reads only the bytes appended since its last look (cheap however big
OUT gets). The rate and ETA count this run's lines only: lines skipped on resume cost nothing and
would make the ETA a lie. On a terminal the bar redraws in place; in a log (not a tty) it prints a
line at most every `log_interval_s` and always the last one.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO


class OutputWatcher:
    """Counts whole lines appended to `path` after byte `offset` (the end of its whole lines when
    the run started; the runner only ever cuts a torn line back to exactly there)."""

    def __init__(self, path: str | Path, offset: int) -> None:
        self.path = Path(path)
        self.offset = offset
        self.new_lines = 0

    def poll(self) -> int:
        """Whole lines appended since the start; a line still being written is not counted."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.new_lines  # the runner has not created it yet
        whole = chunk.rfind(b"\n") + 1
        self.new_lines += chunk.count(b"\n", 0, whole)
        self.offset += whole
        return self.new_lines


def _clock(seconds: float) -> str:
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class ProgressBar:
    def __init__(self, total: int, done_before: int = 0, *, stream: TextIO | None = None, width: int = 30,
                 log_interval_s: float = 10.0) -> None:
        self.total = total
        self.done_before = done_before
        self.done = done_before
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.log_interval_s = log_interval_s
        self.is_tty = self.stream.isatty()
        self._t0 = time.monotonic()
        self._last_draw = float("-inf")
        self._last_text = ""

    def render(self, now: float | None = None) -> str:
        elapsed = (now if now is not None else time.monotonic()) - self._t0
        frac = self.done / self.total if self.total else 1.0
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        this_run = self.done - self.done_before
        rate = this_run / elapsed if elapsed > 0 else 0.0
        left = self.total - self.done
        eta = _clock(left / rate) if rate > 0 else ("0:00:00" if left == 0 else "?")
        return f"[{bar}] {self.done}/{self.total} {frac:4.0%}  {rate:.1f} lines/s  ETA {eta}"

    def update(self, done: int, *, force: bool = False) -> None:
        self.done = done
        now = time.monotonic()
        text = self.render(now)
        if self.is_tty:
            if force or now - self._last_draw >= 0.1:  # redraw at most 10x a second
                self.stream.write("\r" + text)
                self.stream.flush()
                self._last_draw = now
        elif force or (text != self._last_text and now - self._last_draw >= self.log_interval_s):
            self.stream.write(text + "\n")
            self.stream.flush()
            self._last_draw = now
        self._last_text = text

    def finish(self) -> None:
        """Draws the final state once more, and ends the line on a terminal."""
        self.update(self.done, force=True)
        if self.is_tty:
            self.stream.write("\n")
            self.stream.flush()
