"""Progress bars, all made by `progress_bar`: tqdm's on a terminal; where standard error is a log, a whole line
now and then, never a carriage return or a cursor move."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

LOG_INTERVAL_S = 30.0  # at most one line per bar in this many seconds in a log, besides its first and its last

ProgressBar = tqdm  # the type of every bar (LogLines is a tqdm)


class LogLines(tqdm):
    """tqdm for a stream that is not a terminal: a whole line when the bar starts, at most once per LOG_INTERVAL_S,
    and when it closes (with its final count); nothing is cleared."""

    def __init__(self, *args, **kwargs):
        self._line_at: float | None = None  # when the last line was written
        super().__init__(*args, mininterval=LOG_INTERVAL_S, ascii=True, **kwargs)
        if not self.disable:  # a disabled bar has no stream
            self.fp = _LinesOnly(self.fp)  # what close() writes to end or wipe a bar in place

    def display(self, msg=None, pos=None) -> bool:
        now = time.monotonic()
        closing = self.disable  # close() marks the bar disabled, then shows its last state
        if not closing and self._line_at is not None and now - self._line_at < LOG_INTERVAL_S:
            return True
        self.fp.write((msg or self.__str__()).rstrip() + "\n")
        self.fp.flush()
        self._line_at = now
        return True

    def clear(self, nolock: bool = False) -> None:
        """Nothing to clear: the lines written stay (tqdm clears a bar before a log message is written)."""


class _LinesOnly:
    """A bar's stream that passes whole lines and drops what only moves a terminal's cursor ("\\r", "\\n")."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        if text.strip():
            self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(iterable=None, **kwargs) -> ProgressBar:
    """A progress bar over `iterable`, or updated by hand, with tqdm's keywords (desc, total, unit, disable, ...):
    tqdm's own where its stream (`file`, default standard error) is a terminal, else `LogLines`."""
    stream = kwargs.get("file") or sys.stderr
    return (tqdm if _is_terminal(stream) else LogLines)(iterable, **kwargs)


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
