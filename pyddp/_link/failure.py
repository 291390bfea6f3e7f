"""Failure handling for the link: a failure found on one rank is named,
published through the store (so the other ranks fail at their next poll,
not at the timeout), and ends the link for good; a census names the ranks
that stopped arriving. Store calls here have deadlines: on the failure path
the store's host may itself be stopped."""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import io
import json
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import torch.distributed as dist

from ..errors import ProcessGroupError
from .groups import STORE_DEADLINE_S, Peers, first_line, store_call


class Failure:
    """The link's failure state: None until a rank fails, then the message
    every later use of the link raises."""

    def __init__(self, peers: Peers):
        self.peers = peers
        self._failed: Optional[str] = None
        self._store_unreachable = False
        self._store_misses = 0
        self._stops: List[Callable[[], None]] = []
        self._noted = False  # a note() of this rank's is in the store

    @property
    def failed(self) -> Optional[str]:
        return self._failed

    @failed.setter
    def failed(self, why: Optional[str]) -> None:
        self._failed = why
        if why is not None:
            for stop in self._stops:
                stop()

    def on_fail(self, stop: Callable[[], None]) -> None:
        """`stop()` runs once the link fails: what launches on the groups
        outside Python (pyddp._hot's Wire) launches nothing more."""
        self._stops.append(stop)

    def check(self) -> None:
        """Raises the failure, if there was one: nothing more goes on the groups."""
        if self.failed is not None:
            raise ProcessGroupError(self.failed)

    def abandon(self, reason: str) -> None:
        """This rank drops the step (a replica's backward raised): tell the
        others, so they fail now instead of at the timeout."""
        if self.failed is None:
            self.failed = (
                f"pyddp: rank {dist.get_rank()} abandoned {self.peers.where()} ({reason}); the "
                "processes can no longer agree on the step: restart them (torchrun "
                "--max-restarts=K resumes a Trainer from its last checkpoint)"
            )
            report_to_launcher(self.failed)
            self._publish(reason)
            exit_without_teardown()

    def call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        """fn(*args, **kwargs) on a group; its failure is named after `what`."""
        self.check()
        try:
            fn(*args, **kwargs)
        except ProcessGroupError:
            raise  # already named (another rank abandoned the step)
        except Exception as e:  # noqa: BLE001 - named and re-raised below
            self.fail(f"{what} failed: {first_line(e)}")

    def wait(self, work: Any, activity: str) -> None:
        """Waits for a control exchange, reading the store every second: a rank
        that abandoned its step, or that waits somewhere else, makes the
        others fail now, not at the timeout. The completion callback (on a
        gloo thread) holds only an Event."""
        if self._noted:  # this rank is at an exchange again: its note() is stale
            self.note(None)
        done = threading.Event()
        work.get_future().then(functools.partial(_set_event, done))
        deadline = time.monotonic() + self.peers.timeout
        post = WaitPost(self, activity)
        try:
            while not done.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    break
                self.check_abandoned()
                post.poll()
        finally:
            post.withdraw()
        work.wait()  # gloo's own error, or its timeout (the same as pyddp's)

    def check_abandoned(self) -> None:
        why = self._abandoned()
        if why is not None:
            self.fail(why, census=False)

    def fail(self, what: str, census: bool = True, where: Optional[str] = None) -> None:
        """Ends the link with `what`, told to the other ranks; raises."""
        peers = self.peers
        why = self._abandoned() if census else None
        if why is not None:  # the root cause, rather than its echo here
            what, census = f"{what}, because {why}", False
        elif "abandoned the step, reporting" not in what and "note in the store" not in what:
            self._publish(what)  # found here: the others hear it now
        missing = self._census() if census else ""
        if self._store_unreachable and not missing:
            missing = "; the rendezvous store did not answer either (its host stopped or gone?)"
        self.failed = (
            f"pyddp: across {peers.world} processes (this is rank {dist.get_rank()}), "
            f"{where or peers.where()}: {what}{missing}. The process group cannot be used after "
            "this: restart the processes (torchrun --max-restarts=K resumes a Trainer from "
            "its last checkpoint)"
        )
        report_to_launcher(f"ProcessGroupError: {self.failed}")
        exit_without_teardown()
        raise ProcessGroupError(self.failed)

    # ------------------------------------------------------------ the store
    def gather_notes(self, name: str, text: str) -> Dict[int, str]:
        """Leaves `text` in the store under `name` and reads every other
        rank's, waiting a few seconds at most: {group rank: text} for those
        that answered. For failure messages only (the groups may be stuck)."""
        peers = self.peers
        key = f"{peers.prefix}/{name}"
        self._store("set", f"{key}/{peers.rank}", text)
        notes = {peers.rank: text}
        deadline = time.monotonic() + min(STORE_DEADLINE_S, peers.timeout)
        while len(notes) < peers.world and time.monotonic() < deadline:
            for r in range(peers.world):
                if r not in notes and self._store("check", [f"{key}/{r}"]):
                    raw = self._store("get", f"{key}/{r}")
                    if raw is not None:
                        notes[r] = bytes(raw).decode("utf-8", errors="replace")
            if self._store_unreachable:
                break
            time.sleep(0.02)
        return notes

    def _publish(self, reason: str) -> None:
        """Tells the other ranks through the store that this one stopped, so
        they fail at their next poll instead of at the timeout. Best effort:
        if the store is gone, the others time out instead. The reason is data
        for them: "rank|text", bounded and quoted where it is read."""
        self._store("set", f"{self.peers.prefix}/abandoned", f"{dist.get_rank()}|{reason}")

    def _abandoned(self) -> Optional[str]:
        """Another rank's reason for abandoning the step, if it left one: read
        as data (anyone who reaches the store can write it), attributed to
        the rank it names, bounded and quoted."""
        key = f"{self.peers.prefix}/abandoned"
        if not self._store("check", [key]):
            return None
        raw = self._store("get", key)
        if raw is None:
            return None
        who, _, text = bytes(raw).decode("utf-8", errors="replace").partition("|")
        if not (who.isdigit() and int(who) in self.peers.ranks) or int(who) == dist.get_rank():
            return f"an unattributed note in the store, {_quoted(who + '|' + text)}"
        return f"rank {int(who)} abandoned the step, reporting {_quoted(text)}"

    def _store(self, op: str, *args: Any) -> Any:
        """A call on torch.distributed's store with a deadline: on the failure
        path a store whose host is stopped (SIGSTOP, a hung node) would block
        forever. None (or False for check) when it fails or does not answer
        within a few seconds; the call is left behind on a daemon thread."""
        store = self.peers.store
        if store is None or self._store_unreachable:
            return False if op == "check" else None
        result = store_call(store, op, args, min(STORE_DEADLINE_S, self.peers.timeout))
        if not result:
            # Twice in a row: a single slow answer does not end the polling.
            self._store_misses += 1
            self._store_unreachable = self._store_misses >= 2
            return False if op == "check" else None
        self._store_misses = 0
        return result[0]

    def note(self, why: Optional[str]) -> None:
        """Leaves `why` (this rank left the others' next exchange: its user
        code raised) in the store, read only by the census of a rank that
        times out waiting for this one, which then names it instead of
        "died, stalled"; None takes it back (this rank carries on). Not a
        failure: every rank may have raised alike, and fit again."""
        if why is not None or self._noted:
            self._store("set", f"{self.peers.prefix}/left/{self.peers.rank}", why or "")
            self._noted = why is not None

    def _left(self, r: int) -> str:
        """Rank `r`'s note, if it left one (read as data, bounded, quoted)."""
        key = f"{self.peers.prefix}/left/{r}"
        raw = self._store("get", key) if self._store("check", [key]) else None
        text = bytes(raw).decode("utf-8", errors="replace") if raw is not None else ""
        return f": it reported {_quoted(text)}" if text else ""

    def _census(self) -> str:
        """Which ranks did not report this failure within a few seconds: the
        ones that died or stopped arriving."""
        peers = self.peers
        if peers.store is None:
            return ""
        notes = self.gather_notes(f"fail/{peers.iteration}", "1")
        others = [r for r in range(peers.world) if r not in notes]
        if self._store_unreachable:
            return "; the rendezvous store is unreachable too (its host gone or stopped?)"
        if not others:
            return ""
        named = ", ".join(str(peers.ranks[r]) for r in others)
        left = "".join(f"; rank {peers.ranks[r]} left{note}" for r in others
                       if (note := self._left(r)))  # fmt: skip
        return (
            f"; missing: rank {named} (died, stalled, or ran out of batches: every rank must "
            f"run the same number of steps, or train under dmodel.join()){left}"
        )


class WaitPost:
    """A wait on a group that lasts (a second or more) says where this rank
    waits, in the store, and reads where the others wait: two ranks waiting
    at different places (a buffer broadcast here, the reductions of a
    backward there: one rank in eval() alone) would only meet at the
    timeout; seen twice in a row, every rank raises now, naming both. Waits
    that end within the second touch the store not at all."""

    def __init__(self, failure: Failure, activity: str):
        # Made at every wait: nothing here may cost (the key is built at the
        # first poll, a second into the wait).
        self.failure, self.activity = failure, activity
        self.key = ""
        self.posted = False
        self.seen: dict = {}

    def poll(self) -> None:
        failure, peers = self.failure, self.failure.peers
        self.key = self.key or f"{peers.prefix}/at"
        if not self.posted:
            failure._store("set", f"{self.key}/{peers.rank}", self.activity)
            self.posted = True
        for r in range(peers.world):
            if r == peers.rank or not failure._store("check", [f"{self.key}/{r}"]):
                continue
            raw = failure._store("get", f"{self.key}/{r}")
            there = None if raw is None else bytes(raw).decode("utf-8", errors="replace")
            if not there or there == self.activity:  # "" : withdrawn
                self.seen.pop(r, None)
                continue
            self.seen[r] = self.seen.get(r, 0) + 1
            if self.seen[r] >= 2:
                failure.fail(
                    f"the ranks are not at the same exchange (rank {dist.get_rank()} waits at "
                    f"{self.activity}; rank {peers.ranks[r]} waits at {_quoted(there)}); every "
                    "rank must make the same pyddp calls in the same order (an evaluation, a "
                    "train()/eval() switch or a wrap on some ranks only pairs with another "
                    "exchange on the others)",
                    census=False,
                )

    def withdraw(self) -> None:
        """Emptied, never deleted: a key another rank saw with `check` must
        still be there for its `get`, which would otherwise block until the
        store's own timeout (minutes)."""
        if self.posted:
            self.failure._store("set", f"{self.key}/{self.failure.peers.rank}", "")
            self.posted = False


def _set_event(event: threading.Event, _future: Any) -> None:
    event.set()


def _quoted(text: str, limit: int = 300) -> str:
    """Text from another process (the store) shown as data: printable, one
    line, bounded, in quotes."""
    clean = "".join(c if c.isprintable() else " " for c in text)
    # Quotes, not repr(): repr escapes the apostrophes of pyddp's own
    # messages ("rank 0\'s buffers") once they also hold double quotes.
    return "'" + clean[:limit] + ("..." if len(clean) > limit else "") + "'"


_exit_armed: Dict[str, bool] = {}


def exit_without_teardown() -> None:
    """After a link failed, this process ends without Python's teardown.
    The failure leaves gloo operations pending (a peer stopped at another
    exchange), each with a Python callback on its future; when the peer
    exits and closes its sockets they fail on gloo's threads, and one that
    runs its callback while the interpreter finalizes cannot take the
    interpreter lock, is unwound by the thread exit through a noexcept frame,
    and aborts the process (SIGABRT, "terminate called after throwing an
    instance of 'gloo::IoException'") after pyddp's named error. So at exit
    (first among the exit handlers: registered last) the other exit handlers
    run, then open files, the standard streams and logging are flushed, and
    the process leaves with os._exit and the status Python would have given:
    the last `sys.exit(n)`'s (a trainer's after catching the failure, as
    Lightning's after a Ctrl-C), 1 after an uncaught exception, else 0.
    Before, the other exit handlers never ran, files left open lost what
    they buffered, and a `sys.exit(n)` after the failure read 0."""
    if not _exit_armed:
        _exit_armed["armed"] = True
        atexit.register(_leave)
        sys.exit = functools.partial(_exit_noted, sys.exit)


def _exit_noted(exit: Callable[..., Any], status: Any = None) -> Any:
    """sys.exit, noting the status asked for (a `raise SystemExit(n)` is not seen)."""
    _exit_armed["status"] = status
    return exit(status)


def _leave() -> None:
    status = _exit_armed.get("status")
    if "status" not in _exit_armed:
        code = 1 if hasattr(sys, "last_value") else 0  # set when Python printed an uncaught error
    elif status is None or isinstance(status, int):
        code = status or 0
    else:  # Python prints any other value to stderr and exits 1
        print(status, file=sys.stderr)
        code = 1
    atexit.unregister(_leave)
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()  # the others (each one's error is printed, as Python does)
    logging.shutdown()
    for stream in [*_open_files(), sys.stdout, sys.stderr]:
        with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing to say there
            stream.flush()
    os._exit(code)


def _open_files() -> List[Any]:
    """The file objects open for writing, whose buffers the teardown os._exit
    skips would have flushed."""
    found = []
    for obj in gc.get_objects():
        with contextlib.suppress(Exception):
            if isinstance(obj, io.IOBase) and not obj.closed and obj.writable():
                found.append(obj)
    return found


def report_to_launcher(message: str) -> None:
    """Writes pyddp's named failure where torchrun reads a worker's error
    (TORCHELASTIC_ERROR_FILE, torch elastic's format), so the launcher's
    root cause is this message, not the "Signal 6" of a gloo thread that
    aborts the process once a peer closes its sockets, nor "To enable
    traceback see ...". Without the variable (not under torchrun) nothing
    is written; a later error recorded by torch's @record replaces it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # The plain form (a string message and a timestamp): torchrun prints the
    # message itself where the structured form shows only a call stack.
    data = {"message": message, "timestamp": str(int(time.time()))}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the named error is raised anyway; only the launcher's summary loses it
