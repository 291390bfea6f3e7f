"""The Chrome trace file of the engine's kept timelines (wrap(...,
timeline=N); engine/observe.py keeps them): one process's tracks, its pid
its rank across processes, written as runtime/writing.py writes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .writing import is_stream, write_text


def rank_path(path: os.PathLike, rank: Optional[int]) -> Path:
    """`path` for rank `rank`'s own file (None: one process, rank 0):
    "{rank}" in it replaced, else across processes ".rank<R>" before its
    suffix (trace.json -> trace.rank1.json); a stream (/dev/null,
    /dev/stdout) stays itself, every rank writing into it."""
    text = os.fspath(path)
    if "{rank}" in text:
        return Path(text.replace("{rank}", str(rank or 0)))
    p = Path(text)
    if rank is None or is_stream(p):
        return p
    if text.endswith(os.sep) or p.is_dir() or not p.name:
        raise IsADirectoryError(f"{path}: a directory is there; name a file to write")
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix}")


def reduction_lanes(spans: Sequence[Tuple[int, int]]) -> List[int]:
    """A lane for each (launch, done) span such that spans in one lane never
    overlap (Chrome's format nests the complete events of one thread):
    reductions in flight together (across processes) on lanes of their own."""
    ends: List[int] = []
    lanes = []
    for start, end in spans:
        lane = next((k for k, last in enumerate(ends) if last <= start), len(ends))
        if lane == len(ends):
            ends.append(end)
        ends[lane] = end
        lanes.append(lane)
    return lanes


LANE_TID = 1000  # tids of the lanes after the first (the launcher's, tid 1)


def chrome_trace(
    timelines: Sequence[Dict[str, Any]],
    names: Sequence[str],
    buckets: Sequence[Sequence[int]],
    replicas: int,
    rank: Optional[int] = None,
) -> Dict[str, Any]:
    """Chrome trace events of one process (its pid: its rank across
    processes, else 0): one track per replica (parameter ready instants), a
    launcher track (bucket ready instants and launch->done spans; spans in
    flight together on further tracks) and an iteration track (end of
    forward -> end of finish)."""
    pid = rank or 0
    if not timelines:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    origin = min(t["raw"]["forward_end_ns"] or t["raw"]["first_ready_ns"] for t in timelines)

    def us(ns: int) -> float:
        return (ns - origin) / 1e3

    process = "pyddp" if rank is None else f"pyddp rank {rank}"
    events: List[Dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "iteration"}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": 1, "args": {"name": "launcher"}},
    ]
    for r in range(replicas):
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": pid,
                "tid": 10 + r,
                "args": {"name": f"replica {r}"},
            }
        )
    spans: List[Dict[str, Any]] = []
    nparams = len(names)
    for t in timelines:
        raw = t["raw"]
        begin = raw["forward_end_ns"] or raw["first_ready_ns"]
        events.append(
            {
                "name": f"backward+sync {raw['iteration']}",
                "ph": "X",
                "pid": pid,
                "tid": 0,
                "ts": us(begin),
                "dur": (raw["finish_end_ns"] - begin) / 1e3,
                "args": {"finish_wait_us": raw["wait_ns"] / 1e3},
            }
        )
        for b, members in enumerate(t.get("buckets", buckets)):
            ready, launch, done = (
                t["bucket_ready_ns"][b],
                t["bucket_launch_ns"][b],
                t["bucket_done_ns"][b],
            )
            label = (
                names[members[0]] if len(members) == 1 else f"bucket {b} ({len(members)} params)"
            )
            if ready:
                events.append(
                    {
                        "name": f"ready {label}",
                        "ph": "i",
                        "s": "t",
                        "pid": pid,
                        "tid": 1,
                        "ts": us(ready),
                    }
                )
            if launch and done:
                spans.append(
                    {
                        "name": f"all-reduce {label}",
                        "ph": "X",
                        "pid": pid,
                        "tid": 1,
                        "ts": us(launch),
                        "dur": (done - launch) / 1e3,
                        "args": {
                            "bucket": b,
                            "iteration": raw["iteration"],
                            "params": [names[i] for i in members],
                        },
                        "_span": (launch, done),
                    }
                )
        marks = t["param_ready_ns"]
        for r in range(replicas if marks else 0):
            for i in range(nparams):
                ns = marks[r * nparams + i]
                if ns:
                    events.append(
                        {
                            "name": names[i],
                            "ph": "i",
                            "s": "t",
                            "pid": pid,
                            "tid": 10 + r,
                            "ts": us(ns),
                        }
                    )
    spans.sort(key=lambda e: e["_span"])
    lanes = reduction_lanes([e.pop("_span") for e in spans])
    for lane in range(1, max(lanes, default=0) + 1):
        name = f"reductions in flight ({lane + 1})"
        events.append(
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": LANE_TID + lane,
             "args": {"name": name}}
        )  # fmt: skip
    for e, lane in zip(spans, lanes):
        e["tid"] = 1 if lane == 0 else LANE_TID + lane
    return {"traceEvents": events + spans, "displayTimeUnit": "ms"}


def write_trace(trace: Dict[str, Any], path: os.PathLike) -> Path:
    """Whole or not at all, never through a link (runtime/writing.py)."""
    return write_text(path, json.dumps(trace))
