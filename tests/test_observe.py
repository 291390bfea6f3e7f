"""Observability: per-iteration statistics with DDP's definitions, the Chrome
trace timeline, the no-overlap baseline order and the alpha-beta simulator
against hand-computed values (the pyddp-bench CLI: test_bench.py). No timing
assertions: only structure, ordering and arithmetic."""

import json
import os
import stat
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyddp


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(5)], nn.Linear(64, 3))


def train(dm, iterations=4):
    g = torch.Generator().manual_seed(0)
    for _ in range(iterations):
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 3, (16,), generator=g)
        F.cross_entropy(dm(x), y).backward()
        dm.zero_grad()


@pytest.mark.parametrize("cap", [0, 0.01])
def test_stats_follow_ddp_definitions(cap):
    dm = pyddp.wrap(mlp(), ["cpu", "cpu"], bucket_cap_mb=cap, first_bucket_cap_mb=0.005)
    train(dm)
    s = dm.stats()
    for key in (
        "backward_compute_s",
        "comm_s",
        "overlap_s",
        "exposed_comm_s",
        "overlap_fraction",
        "bytes",
        "launches",
        "buckets",
        "bucket_bytes",
        "mean",
    ):
        assert key in s, key
    assert s["iteration"] == 4
    assert 0 <= s["overlap_s"] <= s["comm_s"]
    assert s["exposed_comm_s"] == pytest.approx(s["comm_s"] - s["overlap_s"])
    assert 0 <= s["overlap_fraction"] <= 1
    assert s["backward_compute_s"] > 0
    assert len(s["bucket_bytes"]) == s["buckets"] == len(dm._reducer.buckets)
    assert sum(s["bucket_bytes"]) == s["bytes"] == sum(p.numel() * 4 for p in dm.parameters())
    assert s["launches"] == s["buckets"]
    assert s["mean"]["launches"] == s["launches"]


def test_after_backward_order_launches_nothing_during_backward():
    dm = pyddp.wrap(
        mlp(), ["cpu", "cpu"], bucket_cap_mb=0, reduce_order="after_backward", timeline=1
    )
    train(dm, 2)
    s = dm.stats()
    assert s["overlap_s"] == 0 and s["comm_s"] > 0 and s["exposed_comm_s"] == s["comm_s"]
    raw = dm._reducer._observer.timelines[-1]["raw"]
    assert raw["first_launch_ns"] >= raw["finish_start_ns"]


def test_chrome_trace_structure_and_bounded_memory(tmp_path):
    dm = pyddp.wrap(mlp(), ["cpu", "cpu"], bucket_cap_mb=0, timeline=2)
    train(dm, 5)
    trace = json.loads(dm.export_timeline(tmp_path / "trace.json").read_text())
    events = trace["traceEvents"]
    iterations = [e for e in events if e["ph"] == "X" and e["tid"] == 0]
    assert len(iterations) == 2  # only the last 2 kept
    reductions = [e for e in events if e["ph"] == "X" and e["tid"] == 1]
    assert len(reductions) == 2 * len(dm._reducer.buckets)
    ready = {e["name"][len("ready ") :]: e["ts"] for e in events if e["name"].startswith("ready ")}
    for e in reductions:
        assert e["dur"] >= 0
        assert e["ts"] >= 0
    marks = [e for e in events if e["ph"] == "i" and e["tid"] >= 10]
    assert len(marks) == 2 * 2 * len(dm._reducer._names)  # iterations x replicas x parameters
    assert {e["tid"] for e in marks} == {10, 11}
    assert ready  # bucket-ready instants are there
    # Each reduction launches after its bucket became ready (the last iteration).
    last = dm._reducer._observer.timelines[-1]
    for b in range(len(dm._reducer.buckets)):
        assert (
            last["bucket_ready_ns"][b] <= last["bucket_launch_ns"][b] <= last["bucket_done_ns"][b]
        )


def _nested_and_in_time(events):
    """What Chrome's format asks of complete events: on each track they
    nest (here: never overlap); and no event before the trace's origin, no
    reduction done after its iteration ended."""
    tol = 1e-3  # us: the float rounding of (ns - origin) / 1e3
    tracks = {}
    for e in events:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
        if e["ph"] != "M":
            assert e["ts"] >= 0, e
    for spans in tracks.values():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start >= end - tol, spans
    ends = {  # each iteration's end, by its number
        int(e["name"].split()[-1]): e["ts"] + e["dur"]
        for e in events
        if e["ph"] == "X" and e["tid"] == 0
    }
    for e in events:
        if e["ph"] == "X" and e["name"].startswith("all-reduce"):
            assert e["ts"] + e["dur"] <= ends[e["args"]["iteration"]] + tol, e


def test_reductions_in_flight_together_go_on_tracks_of_their_own():
    # Found by a probe: across processes the reductions overlap, and their
    # spans shared the launcher's track without nesting.
    from pyddp.runtime.trace import LANE_TID, chrome_trace, reduction_lanes

    assert reduction_lanes([(0, 10), (5, 20), (10, 12), (12, 30), (21, 22)]) == [0, 1, 0, 0, 1]
    raw = dict(iteration=1, forward_end_ns=1000, first_ready_ns=1100, finish_end_ns=9000,
               wait_ns=0)  # fmt: skip
    timeline = {
        "raw": raw,
        "bucket_ready_ns": [2000, 2500, 3000],
        "bucket_launch_ns": [2100, 2600, 3100],
        "bucket_done_ns": [5000, 4000, 8000],  # 0 and 1 and 2 in flight together
        "param_ready_ns": [],
    }
    trace = chrome_trace([timeline], ["a", "b", "c"], [[0], [1], [2]], 1, rank=1)
    events = trace["traceEvents"]
    _nested_and_in_time(events)
    spans = {e["args"]["bucket"]: e["tid"] for e in events if e["name"].startswith("all-reduce")}
    assert spans == {0: 1, 1: LANE_TID + 1, 2: LANE_TID + 2}
    assert {e["pid"] for e in events} == {1}
    assert events[0]["args"]["name"] == "pyddp rank 1"


def test_the_trace_names_each_iterations_own_buckets(tmp_path):
    # Found by a probe: the trace labelled every kept iteration with the
    # plan after the rebuild (forward order), the first one's included.
    class Shuffled(nn.Module):
        def __init__(self):
            super().__init__()
            self.big1, self.small = nn.Linear(64, 64), nn.Linear(64, 64, bias=False)
            self.tiny, self.big2 = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x):  # another order than registration
            return self.big1(self.big2(self.tiny(self.small(x))))

    torch.manual_seed(0)
    dm = pyddp.wrap(Shuffled(), ["cpu", "cpu"], timeline=5, bucket_cap_mb=0.02,
                    first_bucket_cap_mb=0.005)  # fmt: skip
    sizes = {n: p.numel() * 4 for n, p in dm.module.named_parameters()}
    x, y = torch.randn(8, 64), torch.randint(0, 64, (8,))
    bytes_per_iteration = []
    for _ in range(3):
        F.cross_entropy(dm(x), y).backward()
        bytes_per_iteration.append(dm.stats()["bucket_bytes"])
    assert bytes_per_iteration[0] != bytes_per_iteration[1]  # (the rebuild moved members)
    trace = json.loads(dm.export_timeline(tmp_path / "t.json").read_text())
    seen = {}
    for e in trace["traceEvents"]:
        if e["name"].startswith("backward+sync"):
            it = int(e["name"].split()[-1])
        elif e["name"].startswith("all-reduce"):
            members = e["args"]["params"]
            seen.setdefault(it, {})[e["args"]["bucket"]] = sum(sizes[n] for n in members)
    for it, buckets in seen.items():
        assert [buckets[b] for b in sorted(buckets)] == bytes_per_iteration[it - 1], it
    dm.close()


def test_files_the_tools_write_replace_links_and_are_whole_or_absent(tmp_path):
    # Found by a probe: export_timeline, the benchmarks' JSON and charts and
    # Profile.save wrote through a symbolic link (into the file it named)
    # and in place (an interrupted write left half a file).
    from pyddp.bench._util import write_json
    from pyddp.runtime.writing import write_atomic

    dm = pyddp.wrap(nn.Linear(4, 2), ["cpu", "cpu"], timeline=2)
    dm(torch.randn(4, 4)).sum().backward()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    for write in (dm.export_timeline, lambda p: write_json(p, {"a": 1})):
        link = tmp_path / "out.json"
        link.unlink(missing_ok=True)
        link.symlink_to(victim)
        written = write(link)
        assert victim.read_text() == "keep me" and not written.is_symlink()
        assert json.loads(written.read_text())
    with pytest.raises(IsADirectoryError, match="a directory is there"):
        dm.export_timeline(tmp_path)

    def half(tmp):
        tmp.write_text("{half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(victim, half)
    assert victim.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "victim.txt"]
    dm.close()


def test_files_the_tools_write_into_a_device_or_a_pipe_are_written_into(tmp_path):
    # Found by a probe: export_timeline("/dev/null") replaced the system's
    # /dev/null with a regular file (as root), and a named pipe alike. A
    # character device or FIFO, directly or through a link, is written into
    # as a shell's redirection writes; a block device or socket is refused.
    import socket
    import stat
    import threading

    from pyddp.bench._util import write_json

    dm = pyddp.wrap(nn.Linear(4, 2), ["cpu", "cpu"], timeline=2)
    dm(torch.randn(4, 4)).sum().backward()
    null = tmp_path / "null"
    null.symlink_to(os.devnull)  # (through a link: a broken write replaces the link only)
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    for write in (dm.export_timeline, lambda p: write_json(p, {"a": 1})):
        assert write(null) == null
        assert null.is_symlink() and stat.S_ISCHR(os.stat(os.devnull).st_mode)
        got = []
        reader = threading.Thread(target=lambda into: into.append(pipe.read_text()), args=(got,))
        reader.start()
        write(pipe)
        reader.join(30)
        assert stat.S_ISFIFO(os.lstat(pipe).st_mode) and json.loads(got[0])
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "sock"))
        with pytest.raises(OSError, match="a socket is there"):
            dm.export_timeline(tmp_path / "sock")
    try:  # a block device node of no device: nothing behind it to harm
        os.mknod(tmp_path / "block", stat.S_IFBLK | 0o600, os.makedev(240, 254))
    except PermissionError:
        pass  # (no CAP_MKNOD here: the branch is the socket's)
    else:
        with pytest.raises(OSError, match="a block device is there"):
            dm.export_timeline(tmp_path / "block")
    assert sorted(p.name for p in tmp_path.iterdir()) <= ["block", "null", "pipe", "sock"]
    dm.close()


def test_a_path_through_proc_is_written_into_even_to_a_file(tmp_path):
    # A review: /dev/stdout -> /proc/self/fd/1 -> a regular file (a run whose
    # output goes to a log) was renamed over, and the log got nothing. Here a
    # link of our own to /proc/self/fd/1, in a process writing to a file.
    import subprocess
    import sys

    link, log = tmp_path / "stdout", tmp_path / "log.txt"
    link.symlink_to("/proc/self/fd/1")
    script = f"from pyddp.runtime.writing import write_text; write_text({str(link)!r}, 'hello')"
    with open(log, "w") as out:
        subprocess.run([sys.executable, "-c", script], stdout=out, check=True)
    assert link.is_symlink() and log.read_text() == "hello"


def test_timeline_off_by_default_and_env_validated(monkeypatch, tmp_path):
    dm = pyddp.wrap(mlp(), ["cpu", "cpu"])
    with pytest.raises(RuntimeError, match="timeline is off"):
        dm.export_timeline("x.json")
    # Nothing kept yet: said, not an empty trace written (a probe).
    kept = pyddp.wrap(mlp(), ["cpu", "cpu"], timeline=2)
    with kept.no_sync():
        kept(torch.randn(4, 64)).sum().backward()
    with pytest.raises(RuntimeError, match="no synced iteration kept yet"):
        kept.export_timeline(tmp_path / "x.json")
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv("PYDDP_TIMELINE", "many")
    with pytest.raises(ValueError, match="PYDDP_TIMELINE"):
        pyddp.wrap(mlp(), ["cpu", "cpu"])


def test_reset_stats_forgets_the_means_not_the_last_iteration():
    dm = pyddp.wrap(mlp(), ["cpu", "cpu"], bucket_cap_mb=0)
    train(dm, iterations=3)
    before = dm.stats()
    assert before["mean"]["launches"] == before["launches"]
    dm.reset_stats()  # e.g. after a benchmark's warm-up
    after = dm.stats()
    assert after["mean"] == {} and after["iteration"] == 3
    train(dm, iterations=2)
    again = dm.stats()
    assert again["iteration"] == 5 and again["mean"]["launches"] == again["launches"]


class _Events:
    """A stream provider's timing events whose completion the test sets: the
    GPU passes an event when the test says so, never by the clock."""

    def __init__(self):
        self.made = []

    def timing_event(self, device):
        event = {"device": device, "done": False, "at": None}
        self.made.append(event)
        return event

    def event_done(self, event):
        return event["done"]

    def capturing(self, device):  # (no CUDA graph capture here)
        return False

    def elapsed_ms(self, start, end):
        assert start["done"] and end["done"]
        return end["at"] - start["at"]

    def complete(self, at_ms):
        for event in self.made:
            if not event["done"]:
                event.update(done=True, at=at_ms)


def test_gpu_clock_tells_a_host_bound_step_from_a_gpu_bound_one():
    from pyddp.engine.observe import GpuClock

    events = _Events()
    clock = GpuClock(events, [0, 1, 0])  # replica -> device
    # GPU-bound: each forward finds the previous backward's work still queued.
    for step in range(4):
        for replica in (0, 1, 2):  # replicas 0 and 2 share cuda:0: one start per device
            clock.begin(replica)
        if step:  # the GPU reaches the previous step's end only now
            events.complete(at_ms=10.0 * step)
        clock.end()
    gpu = clock.stats()
    assert set(gpu) == {"cuda:0", "cuda:1"}
    for d in gpu.values():
        assert d["backwards"] == 4 and d["host_ms"] >= 0
        assert d["gpu_waited_for_host"] == 0.0 and d["bound"] == "gpu"
        # Spans read once both events passed, never waited for: the last
        # step's events have not completed, so 3 of 4 were read.
        assert d["gpu_ms"] == pytest.approx((0 + 10 + 10) / 3)
    # Host-bound: the GPU has passed every event before the next forward.
    events.complete(at_ms=40.0)
    clock.reset()
    for _ in range(3):
        clock.begin(0)
        clock.end()
        events.complete(at_ms=5.0)
    d = clock.stats()["cuda:0"]
    assert d["backwards"] == 3 and d["gpu_waited_for_host"] == 1.0 and d["bound"] == "host"
    assert d["gpu_ms"] == 0.0  # every span read (the fake GPU completes at one instant)


def test_gpu_clock_stops_measuring_when_a_timing_event_fails():
    # A dead context fails every driver call: the clock's must not be the
    # error the user sees (pyddp's own calls name it), and stats() says why
    # the means stop.
    from pyddp.engine.observe import GpuClock

    events = _Events()
    clock = GpuClock(events, [0])
    clock.begin(0)
    clock.end()
    events.complete(at_ms=1.0)

    def dead(device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    events.timing_event = dead
    clock.begin(0)  # does not raise
    clock.end()
    clock.begin(0)
    report = clock.report()
    assert report["gpu"]["cuda:0"]["backwards"] == 1
    assert "illegal memory access" in report["gpu_stopped"]


def test_ready_times_of_a_gradsync_count_from_its_first_gradient():
    # A GradSync does not see the caller's forward end (wrap notes it):
    # ready_times() raised "no ready time for every parameter" at every call.
    torch.manual_seed(0)
    replicas = [mlp(), mlp()]
    replicas[1].load_state_dict(replicas[0].state_dict())
    with pyddp.GradSync(replicas, timeline=2) as sync:
        for _ in range(2):
            for m in replicas:
                m(torch.randn(8, 64)).square().mean().backward()
            sync.finish()
            sync.zero_grad()
        got = sync.ready_times()
        # The first gradient's stamp is the earliest parameter's (a probe saw
        # a trace instant 42 ns before it: two stamps, the later one kept).
        for t in sync._reducer._observer.timelines:
            assert min(filter(None, t["param_ready_ns"])) == t["raw"]["first_ready_ns"]
    names = [n for n, _ in replicas[0].named_parameters()]
    assert got.names == names and len(got.ready_s) == len(names)
    assert min(got.ready_s) == 0.0 and max(got.ready_s) <= got.backward_s


def test_what_was_measured_is_still_read_after_close(tmp_path):
    # README: a closed wrapper raises if used for training, and still gives
    # what it measured.
    dm = pyddp.wrap(nn.Linear(4, 2), ["cpu", "cpu"], timeline=2)
    dm(torch.randn(4, 4)).sum().backward()
    dm.close()
    assert dm.stats()["iteration"] == 1
    assert json.loads(dm.export_timeline(tmp_path / "t.json").read_text())["traceEvents"]
    assert dm.ready_times()
    with pytest.raises(RuntimeError, match="closed"):
        dm(torch.randn(4, 4))


def test_files_the_tools_write_keep_the_usual_mode_names_and_formats(tmp_path, monkeypatch):
    # Found in review of the atomic writes: files came out 0600 (a temporary
    # file's mode), a read-only file was replaced, a long name failed on the
    # temporary one's, and a chart named .svg was written as PNG bytes.
    from pyddp.bench._util import pyplot, save_figure, write_json
    from pyddp.runtime.writing import write_text

    old = os.umask(0o022)
    try:
        path = write_json(tmp_path / "r.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    locked = tmp_path / "locked.json"
    locked.write_text("keep")
    locked.chmod(0o444)
    if os.access(locked, os.W_OK):  # root may write anyway: os.access says no for it
        access = os.access
        monkeypatch.setattr(os, "access", lambda p, m, **k: Path(p) != locked and access(p, m, **k))
    with pytest.raises(PermissionError):
        write_text(locked, "new")
    assert locked.read_text() == "keep"
    long = tmp_path / ("x" * 240 + ".json")
    assert json.loads(write_json(long, {"b": 2}).read_text()) == {"b": 2}
    fig = pyplot().figure()
    svg = save_figure(fig, tmp_path / "c.svg", dpi=50)
    assert svg.read_text().lstrip().startswith("<?xml")


def test_a_replaced_file_keeps_its_mode_and_odd_names_write(tmp_path):
    # Found in review: a replaced 0600 file came back with the umask's mode,
    # a long non-ASCII name failed on the temporary one's, and a chart named
    # `run.final` raised matplotlib's unknown format.
    from pyddp.bench._util import pyplot, save_figure
    from pyddp.runtime.writing import write_text

    private = tmp_path / "private.json"
    private.write_text("{}")
    private.chmod(0o600)
    write_text(private, "{}")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert write_text(tmp_path / ("\U0001f600" * 60 + ".json"), "{}").read_text() == "{}"
    png = save_figure(pyplot().figure(), tmp_path / "run.final", dpi=50)
    assert png.read_bytes().startswith(b"\x89PNG")


def traced_across_processes(out: dict) -> None:
    """Each rank trains with a timeline, then exports it to one path and to a
    path naming "{rank}"."""
    from spawn import out_dir, write

    dm = pyddp.wrap(mlp(), ["cpu"], bucket_cap_mb=0, timeline=3)
    train(dm, 4)
    folder = Path(out_dir())
    written = [dm.export_timeline(folder / "trace.json"), dm.export_timeline(folder / "t-{rank}")]
    out["written"] = [str(p) for p in written]
    out["null"] = str(dm.export_timeline(folder / "null"))  # (a link to /dev/null)
    dm.close()
    write(out)


@pytest.mark.multiprocess
def test_across_processes_each_rank_writes_its_own_trace(tmp_path):
    # Found by a probe: every rank wrote the path given (the last one's
    # trace kept, the others' lost), all as pid 0, and reductions in flight
    # together overlapped on one track; a reduction could end after its
    # iteration's span did.
    from spawn import spawn

    (tmp_path / "null").symlink_to(os.devnull)  # every rank writes into it, none beside it
    results = spawn(traced_across_processes, 2, out=tmp_path)
    assert [got["null"] for got in results] == [str(tmp_path / "null")] * 2
    assert (tmp_path / "null").is_symlink() and stat.S_ISCHR(os.stat(os.devnull).st_mode)
    for rank, got in enumerate(results):
        assert got["written"] == [
            str(tmp_path / f"trace.rank{rank}.json"),
            str(tmp_path / f"t-{rank}"),
        ]
        for path in got["written"]:
            events = json.loads(Path(path).read_text())["traceEvents"]
            assert {e["pid"] for e in events} == {rank}
            assert events[0]["args"]["name"] == f"pyddp rank {rank}"
            reductions = sum(e["name"].startswith("all-reduce") for e in events)
            assert reductions == 3 * 12  # iterations x buckets
            _nested_and_in_time(events)
    assert not (tmp_path / "trace.json").exists()


def test_across_processes_finish_ends_after_its_wait_and_every_reduction():
    # A review of a probe's fix: finish's end was the engine's end plus the
    # wait's length, which fell before a reduction's done stamp when Python
    # ran between the two. merge_timing, on figures of its own.
    from types import SimpleNamespace

    from pyddp._link.processes import ProcessLink

    transport = SimpleNamespace(done_ns_last={0: 1500, 1: 1900}, wait_ns=300, wait_end_ns=2000)
    link = SimpleNamespace(transport=transport, agreement=SimpleNamespace(exposed_ns=7))
    raw = dict(last_done_ns=1000, finish_start_ns=900, finish_end_ns=1200, wait_ns=0)
    timeline = {"bucket_done_ns": [0, 0]}
    ProcessLink.merge_timing(link, raw, timeline, finish_called_ns=800)
    assert raw == dict(last_done_ns=1900, finish_start_ns=800, finish_end_ns=2000, wait_ns=300,
                       agree_ns=7)  # fmt: skip
    assert timeline["bucket_done_ns"] == [1500, 1900]
    raw.update(finish_end_ns=1900)  # the engine's end plus the wait, when later, stands
    ProcessLink.merge_timing(link, raw, timeline, finish_called_ns=800)
    assert raw["finish_end_ns"] == 2200


def test_rank_paths():
    from pyddp.runtime.trace import rank_path

    assert rank_path("t.json", 1) == Path("t.rank1.json")
    assert rank_path("run/t", 2) == Path("run/t.rank2")
    assert rank_path("t-{rank}.json", 3) == Path("t-3.json")
    assert rank_path("t-{rank}.json", None) == Path("t-0.json")  # one process: rank 0
    assert rank_path("t.json", None) == Path("t.json")
    assert rank_path(os.devnull, 1) == Path(os.devnull)  # every rank writes into it
    for folder in ("out/", "."):
        with pytest.raises(IsADirectoryError, match="a directory is there"):
            rank_path(folder, 1)
