"""The progress bar's numbers (rate and ETA count this run's lines only) and the OUT watcher."""

from __future__ import annotations

import io
from pathlib import Path

from deploy.batch.progress import OutputWatcher, ProgressBar


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_render_counts_only_this_runs_lines() -> None:
    bar = ProgressBar(20, done_before=10, stream=io.StringIO(), width=10)
    bar.done = 15
    text = bar.render(now=bar._t0 + 5.0)  # 5 new lines in 5 s; 5 to go
    assert text == "[#######...] 15/20  75%  1.0 lines/s  ETA 0:00:05"
    bar.done = 10
    assert bar.render(now=bar._t0 + 5.0) == "[#####.....] 10/20  50%  0.0 lines/s  ETA ?"  # no rate yet


def test_terminal_redraws_in_place_and_a_log_gets_lines() -> None:
    tty = Tty()
    bar = ProgressBar(2, stream=tty, width=4)
    bar.update(1)
    bar.update(2, force=True)
    bar.finish()
    drawn = tty.getvalue()
    assert drawn.count("\r") == 3 and "\n" not in drawn[:-1]  # one line, redrawn three times
    assert drawn.rsplit("\r", 1)[1].startswith("[####] 2/2 100%") and drawn.endswith("\n")
    log = io.StringIO()
    bar = ProgressBar(3, stream=log, width=4, log_interval_s=3600)
    for done in (1, 2, 3):
        bar.update(done)
    bar.finish()
    lines = log.getvalue().splitlines()
    assert [ln.split()[1] for ln in lines] == ["1/3", "3/3"]  # the first, then only the final one


def test_watcher_counts_whole_lines_after_its_offset(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    watcher = OutputWatcher(out, offset=0)
    assert watcher.poll() == 0  # not created yet
    out.write_text('{"a": 1}\n{"b"')
    assert watcher.poll() == 1  # the torn line is not done
    with open(out, "a") as f:
        f.write(': 2}\n{"c": 3}\n')
    assert watcher.poll() == 3
    old = tmp_path / "old.jsonl"
    old.write_text('{"x": 1}\n{"y": 2}\n')
    assert OutputWatcher(old, offset=len(old.read_bytes())).poll() == 0  # lines before the run are not new
