"""A progress line on the terminal while Spark works: the audit's step, and the running stage's
finished / total tasks, read from Spark's status tracker every half second."""

from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from pyspark import SparkContext


class ConsoleProgress:
    """Call it as the audit's ``progress`` callback; ``close()`` when done.

    On a terminal one line is redrawn in place; otherwise a line is written at each step and
    every ``interval`` seconds while a stage runs (for logs and CI).

    :param context: the SparkContext whose stages are shown.
    :param stream: where to write (default ``sys.stderr``).
    """

    def __init__(
        self, context: SparkContext, stream: TextIO | None = None, interval: float = 15.0
    ) -> None:
        self._context = context
        self._stream = stream or sys.stderr
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._interval = interval
        self._started = time.monotonic()
        self._step = ""
        self._last_line = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._poll, name="taskonce-progress", daemon=True)
        self._thread.start()

    def __call__(self, step: int, steps: int, description: str) -> None:
        with self._lock:
            self._step = f"[audit {step}/{steps}] {description}"
        self._show(force=True)

    def _stages(self) -> str:
        try:
            tracker = self._context.statusTracker()
            parts = []
            for stage_id in tracker.getActiveStageIds():
                info = tracker.getStageInfo(stage_id)
                if info is not None:
                    parts.append(
                        f"stage {stage_id}: {info.numCompletedTasks}/{info.numTasks} tasks"
                    )
            return ", ".join(parts)
        except Exception:  # the context is stopping: nothing to show
            return ""

    def _show(self, force: bool = False) -> None:
        with self._lock:
            if not self._step:
                return
            elapsed = time.monotonic() - self._started
            stages = self._stages()
            line = f"{self._step}{' · ' + stages if stages else ''} · {elapsed:.0f} s"
            now = time.monotonic()
            if self._tty:
                self._stream.write("\r\x1b[2K" + line[:160])
                self._stream.flush()
            elif force or (stages and now - self._last_line >= self._interval):
                self._stream.write(line + "\n")
                self._stream.flush()
                self._last_line = now

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            self._show()

    def close(self) -> None:
        """Stop polling and end the line."""
        self._stop.set()
        self._thread.join(timeout=2)
        with self._lock:
            if self._tty and self._step:
                self._stream.write("\n")
                self._stream.flush()
