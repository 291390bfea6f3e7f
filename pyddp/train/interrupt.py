"""Ctrl-C during Trainer.fit. The first asks the loop to stop at the next step
boundary (it then checkpoints and returns). The second aborts at once with
KeyboardInterrupt, except inside a checkpoint write or an optimizer step
(`sigint_deferred`), where it lands as soon as that is complete. Should
something swallow that KeyboardInterrupt (a generator's or a __del__'s
exception is only printed), the loop raises it again at its next `check`."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Any, Optional

from ..runtime.signals import sigint_deferred

__all__ = ["CtrlC", "sigint_deferred"]


class CtrlC:
    """Installs the two-stage SIGINT handler while entered (main thread only;
    elsewhere signals are not delivered and this does nothing)."""

    def __init__(self) -> None:
        self.stop_requested = False
        self.aborted = False
        self._previous: Optional[Any] = None
        self._installed = False

    def __enter__(self) -> CtrlC:
        self.stop_requested = self.aborted = False
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            previous = self._previous
            signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
            self._installed = False
            self._previous = None

    def check(self) -> None:
        """Raises KeyboardInterrupt if a second Ctrl-C came (and was swallowed)."""
        if self.aborted:
            raise KeyboardInterrupt("pyddp: second Ctrl-C")

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.stop_requested:
            self.aborted = True
            raise KeyboardInterrupt("pyddp: second Ctrl-C")
        self.stop_requested = True
        # Not print(): a signal handler that writes to a stream the interrupted
        # code is writing to raises "reentrant call"; a lost message is better.
        with contextlib.suppress(Exception):
            sys.stderr.write(
                "\npyddp: interrupted; stopping after this step (Ctrl-C again to abort)\n"
            )
            sys.stderr.flush()
