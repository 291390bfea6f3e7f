"""Stream capture in the simulated driver (the ground the captured step of
issue 44 is to stand on; pyddp itself does not capture yet): work queued on
a capturing stream is recorded, not run; a stream waiting on a captured
event joins the capture and must be joined back; a graph launch replays the
work (on streams of its own for the joined streams) after the launch
stream's earlier work; and the calls CUDA forbids during a capture fail
with CUDA's errors, the capture invalidated where CUDA invalidates it. Each
scenario runs in a process of its own (tests/spawn.py's run_alone), on the
simulation's own entry points through ctypes."""

from __future__ import annotations

import ctypes

import pytest
from spawn import run_alone

pytestmark = pytest.mark.simgpu

vp = ctypes.c_void_p


def _lib():
    from simulated import sim

    lib = sim.lib
    lib.cuStreamBeginCapture_v2.argtypes = [vp, ctypes.c_int]
    lib.cuStreamEndCapture.argtypes = [vp, ctypes.POINTER(vp)]
    lib.cuStreamIsCapturing.argtypes = [vp, ctypes.POINTER(ctypes.c_int)]
    lib.cuStreamWaitEvent.argtypes = [vp, vp, ctypes.c_uint]
    lib.cuStreamQuery.argtypes = [vp]
    lib.cuGraphInstantiateWithFlags.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_ulonglong]
    lib.cuGraphLaunch.argtypes = [vp, vp]
    lib.cuGraphDestroy.argtypes = [vp]
    lib.cuGraphExecDestroy.argtypes = [vp]
    return sim, lib


def _event(sim, lib, device):
    sim.use_device(device)
    e = vp()
    assert lib.cuEventCreate(ctypes.byref(e), 0) == 0
    return e.value


def _status(lib, stream):
    st = ctypes.c_int()
    assert lib.cuStreamIsCapturing(stream, ctypes.byref(st)) == 0
    return st.value


def capture_fork_join_and_replay() -> None:
    """x -> y on the origin stream A, y -> z on stream B (joined by an
    event), z -> w on A after B is joined back: nothing runs while
    capturing; each launch runs the chain on the values x holds then, with
    B's part on a stream of the graph's own (slowed, so an unordered replay
    would read stale bytes); the graph outlives cuGraphDestroy."""
    sim, lib = _lib()
    n = 1 << 16
    x, y, z, w = (ctypes.create_string_buffer(n) for _ in range(4))
    a, b = sim.stream(0), sim.stream(0)
    lib.simgpu_set_delay_us(b, 2000)  # B's replay copy lands late unless waited for
    fork, join = _event(sim, lib, 0), _event(sim, lib, 0)
    assert lib.cuStreamBeginCapture_v2(a, 0) == 0
    assert _status(lib, a) == 1 and _status(lib, b) == 0
    assert lib.simgpu_copy(a, y, x, n) == 0
    assert lib.cuEventRecord(fork, a) == 0
    assert lib.cuStreamWaitEvent(b, fork, 0) == 0
    assert _status(lib, b) == 1  # joined
    assert lib.simgpu_copy(b, z, y, n) == 0
    assert lib.cuEventRecord(join, b) == 0
    assert lib.cuStreamWaitEvent(a, join, 0) == 0
    assert lib.simgpu_copy(a, w, z, n) == 0
    graph = vp()
    assert lib.cuStreamEndCapture(a, ctypes.byref(graph)) == 0 and graph.value
    assert _status(lib, a) == 0 and _status(lib, b) == 0
    sim.synchronize(a, 0)
    sim.synchronize(b, 0)
    assert w.raw == bytes(n) and z.raw == bytes(n)  # captured, not run
    exe = vp()
    assert lib.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph, 0) == 0
    assert lib.cuGraphDestroy(graph) == 0
    for fill in (7, 42):
        ctypes.memset(x, fill, n)
        assert lib.cuGraphLaunch(exe, a) == 0
        sim.synchronize(a, 0)
        assert w.raw == bytes([fill]) * n, fill
    # The launch follows the launch stream's earlier work: x written on A
    # (slowed) before the launch reaches the copies.
    lib.simgpu_set_delay_us(a, 2000)
    src = ctypes.create_string_buffer(bytes([9]) * n, n)
    assert lib.simgpu_copy(a, x, src, n) == 0
    assert lib.cuGraphLaunch(exe, a) == 0
    sim.synchronize(a, 0)
    assert w.raw == bytes([9]) * n
    assert lib.cuGraphExecDestroy(exe) == 0
    assert lib.simgpu_counter(b"graph_launch") == 3


def capture_rules() -> None:
    """Each call CUDA forbids during a capture fails with CUDA's error, and
    invalidates the capture where CUDA does (its end returns 901 and no
    graph); the streams leave the capture either way."""
    sim, lib = _lib()
    buf = ctypes.create_string_buffer(64)
    graph = vp()

    def begin(stream):
        assert lib.cuStreamBeginCapture_v2(stream, 0) == 0

    # Querying or synchronizing a capturing stream: 900, invalidated.
    for call in ("cuStreamQuery", "cuStreamSynchronize"):
        a = sim.stream(0)
        begin(a)
        assert getattr(lib, call)(a) == 900, call
        assert _status(lib, a) == 2
        assert lib.cuStreamEndCapture(a, ctypes.byref(graph)) == 901 and not graph.value
        assert _status(lib, a) == 0
    # An event last recorded in a capture cannot be queried or waited on by the host: 907.
    a = sim.stream(0)
    e = _event(sim, lib, 0)
    begin(a)
    assert lib.cuEventRecord(e, a) == 0
    assert lib.cuEventQuery(e) == 907 and lib.cuEventSynchronize(e) == 907
    assert lib.cuStreamEndCapture(a, ctypes.byref(graph)) == 0 and graph.value
    assert lib.cuEventQuery(e) == 0  # the capture ended: recorded outside any capture since
    assert lib.cuGraphDestroy(graph) == 0
    # Waiting from a capturing stream on an event recorded outside it: 905, invalidated.
    a, other = sim.stream(0), sim.stream(0)
    outside = _event(sim, lib, 0)
    assert lib.cuEventRecord(outside, other) == 0
    begin(a)
    assert lib.cuStreamWaitEvent(a, outside, 0) == 905
    assert lib.cuStreamEndCapture(a, ctypes.byref(graph)) == 901
    # Two captures merged by a wait: 902.
    a, b = sim.stream(0), sim.stream(0)
    ea = _event(sim, lib, 0)
    begin(a)
    begin(b)
    assert lib.cuEventRecord(ea, a) == 0
    assert lib.cuStreamWaitEvent(b, ea, 0) == 902
    assert lib.cuStreamEndCapture(b, ctypes.byref(graph)) == 901
    assert lib.cuStreamEndCapture(a, ctypes.byref(graph)) == 0
    assert lib.cuGraphDestroy(graph) == 0
    # A joined stream never joined back: 904, no graph; ending on it: 903.
    a, b = sim.stream(0), sim.stream(0)
    fork = _event(sim, lib, 0)
    begin(a)
    assert lib.cuEventRecord(fork, a) == 0
    assert lib.cuStreamWaitEvent(b, fork, 0) == 0
    assert lib.simgpu_copy(b, buf, buf, 64) == 0
    assert lib.cuStreamEndCapture(b, ctypes.byref(graph)) == 903
    assert lib.cuStreamEndCapture(a, ctypes.byref(graph)) == 904 and not graph.value
    assert _status(lib, a) == 0 and _status(lib, b) == 0
    # The default stream cannot capture; the test provider's allocations and
    # host writes are refused on a capturing stream (before capture, pyddp's).
    assert lib.cuStreamBeginCapture_v2(None, 0) == 900
    a = sim.stream(0)
    begin(a)
    assert lib.simgpu_host_use(0, a) == 900
    assert lib.cuStreamEndCapture(a, ctypes.byref(graph)) == 901
    lib.simgpu_reset()  # every violation above was the point: the epilogue checks the rest


def test_capture_records_joins_and_replays_in_order():
    run_alone(capture_fork_join_and_replay)


def test_calls_cuda_forbids_during_capture_fail_as_cuda_fails():
    run_alone(capture_rules)
