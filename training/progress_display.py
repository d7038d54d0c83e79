"""The progress display of a loop (training steps, fine-tuning steps, predictions): tqdm's bar on a terminal, one
line every few steps elsewhere."""

import sys
import time
from typing import Any, TextIO


def progress_bar(show: bool, total: int, initial: int, desc: str, every: int,
                 stream: TextIO | None = None) -> Any:
    """The progress display of a loop of `total` steps from `initial` (update(n), close()), on stderr (stream): tqdm's
    bar on a terminal; elsewhere (a log file, a pipe) ProgressLines, one line every `every` steps, where the
    bar would fill the file with its redrawings; nothing when show is False."""
    from tqdm import tqdm
    stream = sys.stderr if stream is None else stream
    if show and not stream.isatty():
        return ProgressLines(total, initial, desc, every, stream)
    return tqdm(total=total, initial=initial, desc=desc, disable=not show, dynamic_ncols=True, file=stream)


class ProgressLines:
    """Progress for output that is read afterwards: `DESC: N/TOTAL (P%), S s, R/s` when N is a multiple of
    `every`, reaches `total`, or stops elsewhere (close). The time and rate are this process's own (a resumed
    loop starts at `initial`)."""

    def __init__(self, total: int, initial: int, desc: str, every: int, stream: TextIO):
        self.total, self.n, self.desc, self.every, self.stream = total, initial, desc, max(1, every), stream
        self.started, self.initial, self.shown = time.perf_counter(), initial, initial

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n % self.every == 0 or self.n == self.total:
            self._line()

    def close(self) -> None:
        if self.n != self.shown:
            self._line()

    def _line(self) -> None:
        elapsed = time.perf_counter() - self.started
        rate = (self.n - self.initial) / elapsed if elapsed > 0 else 0.0
        percent = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        print(f"{self.desc}: {self.n}/{self.total}{percent}, {elapsed:.1f} s, {rate:.2f}/s", file=self.stream,
              flush=True)
        self.shown = self.n
