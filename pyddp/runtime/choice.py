"""How "auto" (wrap's run_replicas) picks the way CPU replicas, and replicas
sharing a GPU, run each kind of work: on their threads or in turn on the
caller's thread (replicas/workers.py runs them; this times and decides)."""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Set


class Choice:
    """run_replicas="auto": one way for every kind of work (forward,
    backward, optimizer step, ...). Each kind runs WARMUP calls on threads,
    then alternates, timed; once one kind has TRIALS calls each way, in turn
    is kept for all if the replicas' work in turn costs less than MARGIN
    times that on threads, the kinds weighed by how often each ran (its
    median time each way, times its calls), else threads. One way for all:
    a kind on threads between kinds in turn wakes a worker that idled,
    which its trials (on threads after threads) never paid: chosen kind by
    kind, in turn won by 10-25% per kind on an MLP 64-64-64-10 x2 while a
    backward kept on threads among the others in turn cost 1.06-1.3x the
    step (bench/run_replicas_auto.py). The margin keeps threads where the
    two are close (a wrong pick on a noisy machine costs less that way:
    where in turn wins, it wins by far more). A call that raised is not
    timed (took is not called)."""

    WARMUP, TRIALS, MARGIN = 5, 8, 0.9

    def __init__(self) -> None:
        self.calls: Dict[str, int] = {}
        self.times: Dict[str, Dict[str, List[float]]] = {}
        self.chosen: Optional[str] = None
        self.announced: Set[str] = set()  # kinds whose callers ask before each run

    def kinds(self) -> List[str]:
        return list(self.calls)

    def upcoming(self, what: str) -> str:
        """How the next call of `what` runs. A kind first seen after the
        choice (a backward after a validation pass of forwards alone, a
        second optimizer) tries both ways again, every kind with it."""
        if self.chosen is not None and what not in self.calls:
            self.calls, self.times, self.chosen = dict.fromkeys(self.calls, 0), {}, None
        if self.chosen is not None:
            return self.chosen
        trial = self.calls.setdefault(what, 0) + 1 - self.WARMUP
        return "in_turn" if trial > 0 and trial % 2 else "threads"

    def next(self, what: str) -> str:
        how = self.upcoming(what)
        if self.chosen is None:
            self.calls[what] += 1
        return how

    def took(self, what: str, how: str, seconds: float) -> None:
        if self.chosen is not None or self.calls[what] <= self.WARMUP:
            return
        times = self.times.setdefault(what, {"threads": [], "in_turn": []})
        times[how].append(seconds)
        if min(map(len, times.values())) < self.TRIALS:
            return
        cost = {"threads": 0.0, "in_turn": 0.0}
        for kind, t in self.times.items():
            if all(t.values()):  # timed both ways
                for way in cost:
                    cost[way] += self.calls[kind] * statistics.median(t[way])
        self.chosen = "in_turn" if cost["in_turn"] < self.MARGIN * cost["threads"] else "threads"
