"""Stream capture in the simulated driver, and pyddp's captured step on it.
The driver: work queued on a capturing stream is recorded, not run; a
stream waiting on a captured event joins the capture and must be joined
back (through any number of streams); a graph launch replays the work (on
streams of its own for the joined streams, NCCL collectives included) after
the launch stream's earlier work; the calls CUDA forbids during a capture,
or in a capture's mode, fail with CUDA's errors, the capture invalidated
where CUDA invalidates it. pyddp: GradSync's reductions captured with a
step replay to an eager step's bytes, a capture begun while reductions are
in flight stays valid, and what a replay could not redo is refused by name.
Each scenario runs in a process of its own (tests/spawn.py's run_alone),
partly on the simulation's own entry points through ctypes."""

from __future__ import annotations

import ctypes

import pytest
import torch
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


def capture_modes_and_ids() -> None:
    """The mode rules of a capture (cuThreadExchangeStreamCaptureMode): a
    query of an event recorded outside any capture fails with 900 and
    invalidates a global-mode capture when made from the capturing thread,
    or from another thread in the global thread mode; the relaxed thread
    mode (and, for another thread's capture, the thread-local one) allows it.
    cuStreamGetCaptureInfo_v2 gives one id per capture, shared by the
    streams that joined it."""
    import threading

    sim, lib = _lib()
    lib.cuThreadExchangeStreamCaptureMode.argtypes = [ctypes.POINTER(ctypes.c_int)]
    graph = vp()
    done, before = _event(sim, lib, 0), sim.stream(0)
    assert lib.cuEventRecord(done, before) == 0
    sim.synchronize(before, 0)

    def capture_id(stream):
        status, cid = ctypes.c_int(), ctypes.c_ulonglong()
        assert lib.cuStreamGetCaptureInfo_v2(stream, status, cid, None, None, None) == 0
        return status.value, cid.value

    def exchange(mode):
        m = ctypes.c_int(mode)
        assert lib.cuThreadExchangeStreamCaptureMode(ctypes.byref(m)) == 0
        return m.value

    a, b = sim.stream(0), sim.stream(0)
    assert capture_id(a) == (0, 0)
    assert lib.cuStreamBeginCapture_v2(a, 0) == 0
    fork = _event(sim, lib, 0)
    assert lib.cuEventRecord(fork, a) == 0 and lib.cuStreamWaitEvent(b, fork, 0) == 0
    (sa, ida), (sb, idb) = capture_id(a), capture_id(b)
    assert sa == sb == 1 and ida == idb != 0
    # Relaxed thread mode: the capturing thread may query an outside event.
    assert exchange(2) == 0
    assert lib.cuEventQuery(done) == 0
    assert exchange(0) == 2
    # Another thread in the thread-local mode may; in the global mode it may not.
    got = {}

    def other(mode):
        if mode is not None:
            exchange(mode)
        got[mode] = lib.cuEventQuery(done)

    for mode in (1, None):
        t = threading.Thread(target=other, args=(mode,))
        t.start()
        t.join()
    assert got == {1: 0, None: 900}, got
    assert capture_id(a)[0] == 2  # invalidated by the global-mode query
    assert lib.cuStreamEndCapture(a, ctypes.byref(graph)) == 901
    # The capturing thread itself, in the global mode: 900, invalidated.
    c = sim.stream(0)
    assert lib.cuStreamBeginCapture_v2(c, 0) == 0
    assert capture_id(c)[1] not in (0, ida)  # a new capture, a new id
    assert lib.cuEventQuery(done) == 900
    assert lib.cuStreamEndCapture(c, ctypes.byref(graph)) == 901
    lib.simgpu_reset()  # every violation above was the point: the epilogue checks the rest


def test_capture_modes_bar_unsafe_calls_as_cuda_does():
    run_alone(capture_modes_and_ids)


# ---------------------------------------------------------------- pyddp's captured step
def _captured_setup(devices, op):
    """Replicas of a small MLP on simulated `devices` under GradSync, each
    gradient written (after autograd's host write) by a stream-ordered copy
    from a static source in device memory, as a captured backward kernel
    writes it at every replay (the simulation cannot capture torch's own
    ops: the copies stand for them). Streams of the test's own, one per
    device (a capture cannot begin on a default stream)."""
    import copy

    from simulated import sim, streams
    from torch import nn

    import pyddp
    from pyddp.engine.streams import simulated_gpus

    streams.late_us = 0  # the test writes each gradient itself, on its stream
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    reps = [base] + [copy.deepcopy(base) for _ in devices[1:]]
    own = {d: sim.stream(d) for d in set(devices)}
    with streams.stream(own):
        sources = [[streams.upload(d, torch.zeros_like(p)) for p in m.parameters()]
                   for d, m in zip(devices, reps)]  # fmt: skip
    for r, m in enumerate(reps):
        for i, p in enumerate(m.parameters()):

            def hook(p, r=r, i=i):
                src, s = sources[r][i], streams.current(devices[r])
                nbytes = src.numel() * src.element_size()
                assert sim.lib.simgpu_copy(s, p.grad.data_ptr(), src.data_ptr(), nbytes) == 0

            p.register_post_accumulate_grad_hook(hook)
    with simulated_gpus(devices, streams):
        sync = pyddp.GradSync(reps, op=op)
    return sync, reps, sources, own


def _captured_fill(sources, own, devices, seed):
    """New values in every source (on the host, the streams drained)."""
    from simulated import sim

    for d, s in own.items():
        sim.synchronize(s, d)
    g = torch.Generator().manual_seed(seed)
    for per_replica in sources:
        for src in per_replica:
            src.copy_(torch.randn(src.shape, generator=g))


def _captured_step(sync, reps, own, devices):
    """Forward and backward of every replica on the test's streams, then
    finish(), as a training step drives GradSync."""
    from simulated import streams

    x = torch.randn(4 * len(reps), 16)
    with streams.stream(own):
        for r, m in enumerate(reps):
            m(x[4 * r : 4 * (r + 1)]).pow(2).sum().backward()
        sync.finish()


def _expected(sources, op):
    n = len(sources)
    out = [sum(src[i] for src in sources) for i in range(len(sources[0]))]
    return [t / n for t in out] if op == "avg" else out


def _grads(reps):
    return [[p.grad.clone() for p in m.parameters()] for m in reps]


def _check_reduced(grads, sources, op):
    """One replica's gradients against the closed-form reduction of the sources."""
    for g, want in zip(grads, _expected(sources, op)):
        assert torch.allclose(g, want, atol=1e-6), (g - want).abs().max()


def _capture(own, devices, run):
    """Runs `run()` inside a capture begun on devices[0]'s stream, the other
    devices' streams joined through an event and joined back after it (also
    when it raises); cuStreamEndCapture's code and the graph."""
    from simulated import sim

    lib = _lib()[1]
    origin = own[devices[0]]
    joins = {d: (_event(sim, lib, devices[0]), _event(sim, lib, d)) for d in own if d != devices[0]}
    assert lib.cuStreamBeginCapture_v2(origin, 0) == 0
    for d, (fork, _) in joins.items():
        assert lib.cuEventRecord(fork, origin) == 0 and lib.cuStreamWaitEvent(own[d], fork, 0) == 0
    graph = vp()
    try:
        run()
    finally:
        for d, (_, back) in joins.items():
            assert lib.cuEventRecord(back, own[d]) == 0
            assert lib.cuStreamWaitEvent(origin, back, 0) == 0
        code = lib.cuStreamEndCapture(origin, ctypes.byref(graph))
    return code, graph


def captured_step_replays_as_eager(devices, op):
    """A step of GradSync's replicas captured into a graph (origin: device
    0's stream; the other devices' streams joined through an event and
    joined back at the end) and replayed: the reductions (NCCL across
    devices, the shared-GPU kernel on one) run at each replay on the
    sources' values then, to the bytes an eager step gives, and eager steps
    still run after. While capturing, pyddp queries no event and watches no
    captured launch (the simulation fails any such call)."""
    from simulated import sim

    sync, reps, sources, own = _captured_setup(devices, op)
    lib = _lib()[1]
    origin = own[devices[0]]
    for seed in (1, 2):  # eager: the second synced backward has the final buckets
        _captured_fill(sources, own, devices, seed)
        _captured_step(sync, reps, own, devices)
    for d, s in own.items():
        sim.synchronize(s, d)
    eager = _grads(reps)
    _check_reduced(eager[0], sources, op)
    sync._reducer._engine.check()  # the eager launches, completed, leave the watch
    launches = sync._reducer._backend.captured_launches
    code, graph = _capture(own, devices, lambda: _captured_step(sync, reps, own, devices))
    assert code == 0, sim.violations()
    exe = vp()
    assert lib.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph, 0) == 0
    assert sync._reducer._backend.captured_launches > launches  # the buckets are in the graph
    assert sync.stats()["captured_backwards"] == 1
    # Replays: the same sources give the eager bytes; new ones their reduction.
    for seed, reference in ((2, eager), (3, None)):
        _captured_fill(sources, own, devices, seed)
        assert lib.cuGraphLaunch(exe, origin) == 0
        sim.synchronize(origin, devices[0])
        got = _grads(reps)
        if reference is not None:
            assert all(torch.equal(a, b) for ga, gb in zip(got, reference) for a, b in zip(ga, gb))
        for per_replica in got:
            _check_reduced(per_replica, sources, op)
    # Eager steps after the replays.
    _captured_fill(sources, own, devices, 4)
    _captured_step(sync, reps, own, devices)
    for d, s in own.items():
        sim.synchronize(s, d)
    _check_reduced(_grads(reps)[-1], sources, op)
    assert lib.cuGraphExecDestroy(exe) == 0 and lib.cuGraphDestroy(graph) == 0
    sync.close()


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("devices", [[0, 1], [0, 0], [0, 1, 2]])
def test_a_captured_step_replays_to_the_bytes_of_an_eager_one(devices, op):
    run_alone(captured_step_replays_as_eager, devices, op)


def capture_begun_with_reductions_in_flight(devices):
    """A capture begun while the eager step before it still reduces (cuda:1's
    NCCL rank held back until the capture ended, so that step's launches
    stay watched): pyddp's queries of their events (the watchdog's, and
    finish()'s own on the capturing thread) are made in the relaxed capture
    mode, which CUDA allows, and the capture is valid; once the rank goes
    on, the replay gives the sources' reduction."""
    from simulated import sim

    sync, reps, sources, own = _captured_setup(devices, "sum")
    lib = _lib()[1]
    origin = own[devices[0]]
    for seed in (1, 2):
        _captured_fill(sources, own, devices, seed)
        _captured_step(sync, reps, own, devices)
    _captured_fill(sources, own, devices, 3)
    sim.lib.simgpu_nccl_stall(1, 1)
    _captured_step(sync, reps, own, devices)  # its reductions wait for cuda:1's rank
    ended, graph = _capture(own, devices, lambda: _captured_step(sync, reps, own, devices))
    sim.lib.simgpu_nccl_stall(1, 0)
    assert ended == 0, sim.violations()
    exe = vp()
    assert lib.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph, 0) == 0
    _captured_fill(sources, own, devices, 4)
    assert lib.cuGraphLaunch(exe, origin) == 0
    sim.synchronize(origin, devices[0])
    for per_replica in _grads(reps):
        _check_reduced(per_replica, sources, "sum")
    assert lib.cuGraphExecDestroy(exe) == 0 and lib.cuGraphDestroy(graph) == 0
    sync.close()


def test_a_capture_begun_while_reductions_are_in_flight_stays_valid():
    run_alone(capture_begun_with_reductions_in_flight, [0, 1])


def captures_pyddp_refuses():
    """What a captured step cannot hold is refused by name, at the forward
    (before any synced backward laid out the buckets again; a replica
    capturing beside one that does not, in either order) or at finish() (a
    parameter without a gradient): nothing is left half done, and eager
    steps go on after each, and after abort() of a step whose code raised
    inside the capture."""
    from simulated import sim, streams

    devices = [0, 1]
    sync, reps, sources, own = _captured_setup(devices, "sum")
    lib = _lib()[1]
    x = torch.randn(8, 16)

    def refused(run, words):
        def expect_refusal():
            try:
                with streams.stream(own):
                    run()
                raise AssertionError(f"accepted: {words}")
            except RuntimeError as e:
                assert "cannot be captured into a CUDA graph" in str(e) and words in str(e), e

        _, graph = _capture(own, devices, expect_refusal)
        if graph.value:
            assert lib.cuGraphDestroy(graph) == 0
        # The capture left unjoined is the refusal's own doing; any other
        # broken rule is not.
        seen = [v for v in sim.violations().splitlines() if v.strip()]
        assert all("cuStreamEndCapture" in v for v in seen), (words, seen)
        lib.simgpu_reset()

    def eager_steps_go_on():
        _captured_fill(sources, own, devices, 7)
        _captured_step(sync, reps, own, devices)
        for d, s in own.items():
            sim.synchronize(s, d)
        _check_reduced(_grads(reps)[1], sources, "sum")

    # Before the first synced backward: the buckets are laid out again after it.
    refused(lambda: reps[0](x[:4]), "no synced backward ran yet")
    eager_steps_go_on()
    eager_steps_go_on()

    # Replica 1 on a stream that does not capture, beside replica 0 on one that does.
    def mixed():
        reps[0](x[:4])
        with streams.stream({1: sim.stream(1)}):
            reps[1](x[4:])

    refused(mixed, "every replica's stream must take part in the capture")
    eager_steps_go_on()

    # The other order: replica 0 eager, replica 1 capturing: refused at
    # replica 1's forward, before any launch (NCCL's rank 0 would run now and
    # rank 1 only at a replay: a hang no timeout watches).
    def eager_first():
        with streams.stream({0: sim.stream(0)}):
            reps[0](x[:4]).pow(2).sum().backward()
        reps[1](x[4:]).pow(2).sum().backward()
        sync.finish()

    refused(eager_first, "replicas [0] started this step on streams that capture nothing")
    eager_steps_go_on()

    # A parameter without a gradient: refused at finish(), the backward dropped.
    def unused():
        for r, m in enumerate(reps):
            sync._reducer.prepare(r)  # (what the replica's forward pre-hook does)
            m[0](x[4 * r : 4 * (r + 1)]).pow(2).sum().backward()  # the last layer gets none
        sync.finish()

    refused(unused, "no gradient for replica 0 parameter 2")
    eager_steps_go_on()

    # The user's code raises inside the capture after a forward: abort() (as
    # after any failed backward) ends the step, and eager steps go on.
    def raises():
        reps[0](x[:4])
        raise RuntimeError("cannot be captured into a CUDA graph: the user's own")

    refused(raises, "the user's own")
    sync.abort()
    eager_steps_go_on()
    sync.close()


def test_what_a_captured_step_cannot_hold_is_refused_by_name():
    run_alone(captures_pyddp_refuses)


def nccl_ranks_split_across_a_capture() -> None:
    """A collective whose ranks' streams are partly in a capture (the
    collectives API, cuda:0's stream capturing, cuda:1's not) is refused
    before anything is launched, naming the devices: NCCL's rank 1 would run
    now and rank 0 only at a replay, a hang no timeout watches. The
    communicators stay usable (the backstop behind the captured step's own
    refusals, which come at the forward)."""
    from simulated import sim, streams

    from pyddp.runtime import libraries as _runtime

    lib = _lib()[1]
    backend = _runtime.make_backend([0, 1], timeout=30)
    s0, s1 = sim.stream(0), sim.stream(1)
    with streams.stream({0: s0, 1: s1}):
        ts = [streams.upload(d, torch.full((1000,), float(d + 1))) for d in (0, 1)]
    sim.synchronize(s0, 0)
    sim.synchronize(s1, 1)
    graph = vp()
    assert lib.cuStreamBeginCapture_v2(s0, 0) == 0
    try:
        backend.reduce([t.data_ptr() for t in ts], [0, 1], [s0, s1], 1000, "float32")
        raise AssertionError("a collective split across a capture was launched")
    except Exception as e:
        assert "not all in one CUDA graph capture (cuda:0 capturing, cuda:1 not)" in str(e), e
    lib.cuStreamEndCapture(s0, ctypes.byref(graph))  # cuda:0's communication stream joined it
    lib.simgpu_reset()  # (that unjoined stream is the refusal's own doing)
    assert sim.counter("nccl_allreduce") == 0
    backend.reduce([t.data_ptr() for t in ts], [0, 1], [s0, s1], 1000, "float32")
    sim.synchronize(s0, 0)
    sim.synchronize(s1, 1)
    assert all(torch.equal(t, torch.full_like(t, 3.0)) for t in ts)
    backend.close()


def test_a_collective_split_across_a_capture_is_refused_before_launch():
    run_alone(nccl_ranks_split_across_a_capture)
