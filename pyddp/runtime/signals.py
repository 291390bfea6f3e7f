"""Ctrl-C (SIGINT) held back while pyddp does what must not stop half way:
a file written, a sharded optimizer step (some replicas stepped, the others
not, would differ for good), the Trainer's optimizer step."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator, List


@contextlib.contextmanager
def sigint_deferred(escalate: bool = False) -> Iterator[None]:
    """A SIGINT (Ctrl-C) arriving inside the block is handed to the handler
    that was installed before it once the block ends: a KeyboardInterrupt never
    lands in the middle of a write. `escalate`: a second one inside the block
    raises KeyboardInterrupt at once (work that may wait on another process
    for the whole timeout). Only the main thread receives signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: List[Any] = []

    def hold(signum: int, frame: Any) -> None:
        if escalate and pending:
            pending.clear()
            raise KeyboardInterrupt  # asked twice: out now, the work cut short
        pending.append(frame)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
        for frame in pending:  # each one: a first Ctrl-C stops, a second aborts
            if callable(previous):
                previous(signal.SIGINT, frame)
            elif previous == signal.SIG_DFL or previous is None:
                signal.raise_signal(signal.SIGINT)
