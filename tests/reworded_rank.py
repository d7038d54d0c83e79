"""A rank of run_pretraining.py (through tests/test_resume.py's fault injection) whose every printed line is
reworded: each line's words in reverse order ("error: x [no restart]" becomes "restart] [no x error:").
tests/test_supervisor.py runs the real driver so under the supervisor, which must decide as it does for the
driver's own words."""

import runpy
import sys
from pathlib import Path


def reword(line: str) -> str:
    return " ".join(reversed(line.split(" ")))


class RewordedLines:
    """A text stream that passes each whole line on, reworded, as one write."""

    def __init__(self, stream):
        self.stream, self.pending = stream, ""

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        if lines:
            self.stream.write("".join(f"{reword(line)}\n" for line in lines))
            self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name):  # fileno, isatty, encoding...: the stream's own
        return getattr(self.stream, name)


if __name__ == "__main__":
    sys.stdout, sys.stderr = RewordedLines(sys.stdout), RewordedLines(sys.stderr)
    runpy.run_path(str(Path(__file__).with_name("test_resume.py")), run_name="__main__")
