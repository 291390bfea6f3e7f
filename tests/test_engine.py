"""The C++ engine on its own: bucket planning, concurrent readiness from
several threads (no deadlock, no lost or doubled reduction), both launch
orders, and the error paths (bad indices, double marks, failing reductions)."""

import copy

import numpy as np
import pytest
import torch

import pyddp
from pyddp import _C


@pytest.mark.parametrize("order", ["ready", "index"])
@pytest.mark.parametrize("cap_bytes", [0, 4096, 1 << 20])
@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_stress_random_readiness(order, cap_bytes, replicas):
    # 1500 iterations x (replicas x 40) marks from 4 threads in random order,
    # 20% of marks left for finish() to settle; the harness checks every
    # element reads N(N+1)/2 after each iteration.
    r = _C.stress_engine(replicas, 40, cap_bytes, order == "index", 1500, 4, 7, 0.2)
    assert r["first_error"] == ""
    assert r["iterations"] == 1500
    assert r["wrong_values"] == 0
    if replicas > 1:
        assert r["reductions"] > 0


def test_plan_per_parameter_mode():
    assert _C.plan_buckets([3, 4, 5], ["float32"] * 3, [2, 1, 0], 0, 0) == [[2], [1], [0]]


def test_plan_caps_and_dtypes():
    numels = [256, 256, 256, 256, 10]
    dtypes = ["float32", "float32", "float64", "float32", "float64"]
    # first cap 1 KiB (256 floats), then 2 KiB
    buckets = _C.plan_buckets(numels, dtypes, [0, 1, 2, 3, 4], 1024, 2048)
    assert buckets[0] == [0]  # the first bucket closes early
    for b in buckets:
        assert len({dtypes[p] for p in b}) == 1
    assert sorted(p for b in buckets for p in b) == [0, 1, 2, 3, 4]
    # f32 p1 waits for p3 while the f64 p2 fills a bucket alone; p4 is left over.
    assert buckets == [[0], [2], [1, 3], [4]]


def test_plan_rejects_bad_order():
    with pytest.raises(RuntimeError, match="twice"):
        _C.plan_buckets([1, 1], ["float32"] * 2, [0, 0], 0, 10)
    with pytest.raises(RuntimeError, match="order names parameter 5"):
        _C.plan_buckets([1, 1], ["float32"] * 2, [0, 5], 0, 10)


def make_engine(replicas=2, numels=(3, 5), order="ready"):
    names = [f"p{i}" for i in range(len(numels))]
    buckets = [[i] for i in range(len(numels))]
    eng = _C.Engine(
        replicas,
        names,
        list(numels),
        ["float32"] * len(numels),
        buckets,
        order,
        "sum",
        _C.CpuBackend(1),
    )
    bufs = [[np.full(n, r + 1, np.float32) for n in numels] for r in range(replicas)]
    for r in range(replicas):
        for b, arr in enumerate(bufs[r]):
            eng.set_buffer(r, b, arr.ctypes.data, arr.size, "float32")
    return eng, bufs


def test_unmarked_parameters_settled_at_finish():
    eng, bufs = make_engine()
    eng.mark_ready(0, 0)  # p0 only on replica 0; p1 nowhere
    assert eng.finish() == ([1], [0])  # p1 never had a gradient: stays None
    assert (bufs[0][0] == 3).all() and (bufs[1][0] == 3).all()
    assert (bufs[0][1] == 1).all()  # not reduced: no gradient anywhere


def test_double_mark_is_an_error():
    eng, _ = make_engine()
    eng.mark_ready(1, 0)
    with pytest.raises(RuntimeError, match="replica 1, parameter 0 \\(p0\\).*twice"):
        eng.mark_ready(1, 0)
    eng.finish()


def test_mark_after_reduction_without_forward_is_an_error():
    eng, _ = make_engine()
    eng.mark_ready(0, 0)
    eng.mark_ready(1, 0)
    eng.finish()
    with pytest.raises(RuntimeError, match="no forward in between"):
        eng.mark_ready(0, 0)
    assert eng.take_reduced_copy(0) and eng.take_reduced_copy(1)
    eng.mark_ready(0, 0)  # after the forward's prepare: fine


def test_indices_checked():
    eng, _ = make_engine()
    with pytest.raises(RuntimeError, match="replica 2 out of range"):
        eng.mark_ready(2, 0)
    with pytest.raises(RuntimeError, match="parameter 9 out of range"):
        eng.mark_ready(0, 9)
    with pytest.raises(RuntimeError, match="holds 3 elements"):
        eng.set_buffer(0, 0, 1234, 4, "float32")


def test_failed_reduction_raises_then_engine_recovers():
    eng, bufs = make_engine(order="index")
    eng.inject_fault(0, "link down")
    for r in range(2):
        for p in range(2):
            eng.mark_ready(r, p)
    with pytest.raises(_C.ReduceError, match="bucket 0 \\(p0\\) across 2 replicas.*link down"):
        eng.finish()
    assert eng.partial
    assert "failed" in eng.partial_reason
    # Next iteration starts clean.
    eng.clear_grads(True)
    for r in range(2):
        for arr in bufs[r]:
            arr[:] = r + 1
    for r in range(2):
        for p in range(2):
            eng.mark_ready(r, p)
    eng.finish()
    assert all((a == 3).all() for rb in bufs for a in rb)
    assert not eng.partial


def test_stats_count_bytes_and_launches():
    eng, _ = make_engine()
    for r in range(2):
        eng.mark_ready(r, 0)
        eng.mark_ready(r, 1)
    eng.finish()
    s = eng.last_stats()
    assert s["launches"] == 2 and s["bytes"] == (3 + 5) * 4 and s["buckets"] == 2
    assert (
        0 < s["first_ready_ns"] <= s["first_launch_ns"] <= s["last_done_ns"] <= s["finish_end_ns"]
    )
    assert eng.ready_order() == [0, 1]


def test_engine_argument_errors():
    with pytest.raises(RuntimeError, match="at least one replica"):
        _C.Engine(0, ["a"], [1], ["float32"], [[0]], "ready", "sum", _C.CpuBackend(1))
    with pytest.raises(RuntimeError, match="reduce order"):
        _C.Engine(1, ["a"], [1], ["float32"], [[0]], "random", "sum", _C.CpuBackend(1))
    with pytest.raises(RuntimeError, match="in no bucket"):
        _C.Engine(1, ["a", "b"], [1, 1], ["float32"] * 2, [[0]], "ready", "sum", _C.CpuBackend(1))
    with pytest.raises(RuntimeError, match="mixes dtypes"):
        _C.Engine(
            1,
            ["a", "b"],
            [1, 1],
            ["float32", "float64"],
            [[0, 1]],
            "ready",
            "sum",
            _C.CpuBackend(1),
        )


def test_the_type_stub_names_what_the_extension_has():
    # pyddp/_C.pyi is what type checkers and editors see: a binding added,
    # renamed or removed without regenerating it fails here.
    import ast
    from pathlib import Path

    import pyddp

    stub = ast.parse((Path(pyddp.__file__).parent / "_C.pyi").read_text())
    declared = {
        node.name for node in stub.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
    }
    members = {}
    for node in stub.body:
        if isinstance(node, ast.ClassDef):
            members[node.name] = {
                n.name for n in node.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"
            }
    public = {n for n in dir(_C) if not n.startswith("_")}
    assert declared == public
    for cls, names in members.items():
        mine = {n for n in vars(getattr(_C, cls)) if not n.startswith("_")}
        assert names == mine, cls


def test_tapered_plan_halves_the_tail_down_to_the_first_cap():
    # 10 parameters of 4 KiB each (1024 float32), caps: first 4 KiB, later 16 KiB.
    numels, dtypes, order = [1024] * 10, ["float32"] * 10, list(range(10))
    plain = _C.plan_buckets(numels, dtypes, order, 4096, 16384)
    assert [len(b) for b in plain] == [1, 4, 4, 1]
    # Tapered: after the first, a bucket opened with R bytes unplaced closes at
    # min(16 KiB, max(4 KiB, R / 2)): R = 36 KiB -> 16 (4 params), 20 -> 10
    # (3 params), 8 -> 4 (1), 4 -> 4 (1).
    tapered = _C.plan_buckets(numels, dtypes, order, 4096, 16384, True)
    assert [len(b) for b in tapered] == [1, 4, 3, 1, 1]
    assert sorted(p for b in tapered for p in b) == list(range(10))
    assert pyddp.plan_buckets(numels, dtypes, order, 4096, 16384) == plain  # off by default
    assert pyddp.plan_buckets(numels, dtypes, order, 4096, 16384, taper=True) == tapered
    with pytest.raises(TypeError, match="taper"):
        pyddp.plan_buckets(numels, dtypes, order, 4096, 16384, taper="yes")


def test_taper_buckets_option_reaches_the_engine():
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    dm = pyddp.wrap(
        model, ["cpu", "cpu"], bucket_cap_mb=0.05, first_bucket_cap_mb=0.01, taper_buckets=True
    )
    untapered = pyddp.wrap(
        copy.deepcopy(model), ["cpu", "cpu"], bucket_cap_mb=0.05, first_bucket_cap_mb=0.01
    )
    assert len(dm._reducer._engine.buckets) > len(untapered._reducer._engine.buckets)
    with pytest.raises(TypeError, match="taper_buckets"):
        pyddp.wrap(copy.deepcopy(model), ["cpu", "cpu"], taper_buckets=1)
