"""SIGTERM/SIGINT as an exception the training loop can handle, deferred in critical sections.

torchrun stops the surviving workers of a group with SIGTERM; the worker then saves its last
completed step before it exits (ddplab.train's emergency path). An optimizer update or a checkpoint
write must not be cut in half: inside :meth:`SignalGuard.critical` a signal is only recorded, and
raised when the section ends.
"""

from __future__ import annotations

import contextlib
import signal
from typing import Any


class Terminated(BaseException):
    """SIGTERM/SIGINT arrived (torchrun stops the surviving workers this way)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class SignalGuard:
    """Turn SIGTERM/SIGINT into :class:`Terminated`, deferred while a critical section runs.

    The optimizer update and checkpoint writes are critical: a signal arriving there is raised
    when the section ends, so the state saved afterwards is always a whole step.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.pending: int | None = None
        self.received: int | None = None  # the last signal handled, raised or not
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = signum
        if self.depth:
            self.pending = signum
            return
        raise Terminated(signum)

    def check(self) -> None:
        """Raise :class:`Terminated` when a signal arrived, even if the exception the handler
        raised was lost: it can fire inside a torch future callback that a library (torchft) runs
        in this thread, where the exception becomes a failed collective (seen: a SIGTERMed worker
        trained on for 30 s until torchrun killed it)."""
        if self.received is not None and not self.depth:
            raise Terminated(self.received)

    def shield(self) -> None:
        """From now on every SIGTERM/SIGINT is only recorded (the emergency path: its checkpoint
        and records are written whatever arrives; the process exits right after)."""
        self.depth += 1

    @contextlib.contextmanager
    def critical(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if not self.depth and self.pending is not None:
            raise Terminated(self.pending)
