"""The torch-linked hot path (pyddp._hot): C++ hooks on the gradient
accumulators of CPU replicas, and cross-process bucket launches. Where it is
built for this torch (torch installed before pyddp) it is used unless
PYDDP_HOT=0; CI runs the fast tier
both ways, so every other test covers both paths. Here: which path is on,
and the Python work per step counted (calls, not times)."""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
import threading
from collections import Counter

import pytest
import torch
from torch import nn

import pyddp
from pyddp.runtime import libraries


def _built() -> bool:
    """This install holds a _hot built for its torch (its build record says
    neither that it failed nor that it was left out, PYDDP_BUILD_HOT=0)."""
    if importlib.util.find_spec("pyddp._hot_build") is None:
        return False
    record = importlib.import_module("pyddp._hot_build")
    return getattr(record, "FAILED", None) is None and getattr(record, "SKIPPED", None) is None


BUILT = _built()
SWITCHED_OFF = os.environ.get("PYDDP_HOT", "1").strip() == "0"


def test_the_hot_path_is_on_exactly_where_built_and_not_switched_off():
    module, why = libraries.hot_status()
    assert (module is not None) == (BUILT and not SWITCHED_OFF), why
    if SWITCHED_OFF:
        assert "switched off (PYDDP_HOT)" in why
    elif not BUILT:
        assert why.startswith("not built")
    else:
        assert torch.__version__ == module.TORCH_VERSION


def test_a_build_for_another_torch_is_not_loaded_and_says_so(monkeypatch):
    if not BUILT:
        pytest.skip("pyddp._hot is not built here")
    import pyddp._hot_build as build

    monkeypatch.setattr(build, "TORCH_VERSION", "0.0.0+elsewhere")
    monkeypatch.setenv("PYDDP_HOT", "1")  # as if not switched off (CI runs both)
    libraries._load_hot.cache_clear()
    libraries._say_once.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="built for torch 0.0.0\\+elsewhere"):
            assert libraries.hot() is None
    finally:
        libraries._load_hot.cache_clear()
        libraries._say_once.cache_clear()


# Where pyddp's modules load from: the source tree's pyddp/__init__.py points
# __path__ at the installed build (pyddp/_source_tree.py) where there is one.
_PACKAGE = tuple(os.path.abspath(p) + os.sep for p in pyddp.__path__)


class _EveryThread:
    """Counts pyddp's Python function calls on every thread started after
    it (the wrapped model's replica workers, autograd's) while `counting`."""

    def __init__(self):
        self.calls: Counter = Counter()
        self.counting = False
        self._lock = threading.Lock()
        self._package = _PACKAGE

    def _profile(self, frame, event, arg):
        if self.counting and event == "call" and frame.f_code.co_filename.startswith(self._package):
            with self._lock:
                self.calls[frame.f_code.co_name] += 1

    def __enter__(self):
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        threading.setprofile(None)
        sys.setprofile(None)

    def step(self, step) -> Counter:
        self.calls = Counter()
        self.counting = True
        try:
            step()
        finally:
            self.counting = False
        return self.calls


def _profiled(step) -> Counter:
    """pyddp's Python function calls in `step()`."""
    with _EveryThread() as every:
        return every.step(step)


def _synced_step(sync, replicas, x, after_backward=lambda: None):
    """One synced step of GradSync's `replicas` driven from this thread (every
    hook runs here, so the profiler sees it), ending in zero_grad (to None:
    the next gradients are copied in, the hand-over)."""

    def step() -> None:
        rows = len(x) // len(replicas)
        for r, m in enumerate(replicas):
            m(x[r * rows : (r + 1) * rows]).sum().backward()
        sync.finish()
        after_backward()
        sync.check_step()
        sync.zero_grad()

    return step


def _calls_per_step(layers: int) -> Counter:
    """pyddp's Python calls in one synced step of 2 CPU replicas, after
    warm-up steps."""
    torch.manual_seed(0)
    m0 = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
    m1 = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
    m1.load_state_dict(m0.state_dict())
    sync = pyddp.GradSync([m0, m1], bucket_cap_mb=1000, first_bucket_cap_mb=1000)
    step = _synced_step(sync, [m0, m1], torch.randn(8, 8))
    for _ in range(3):
        step()
    calls = _profiled(step)
    sync.close()
    return calls


def _assert_o_buckets(small: Counter, large: Counter, hook: str, replicas: int) -> None:
    """`small` and `large`: the calls of steps with 8 and 80 parameters."""
    assert sum(small.values()) > 0 and "finish" in small, small  # the profiler saw pyddp
    grown = {k: (small[k], large[k]) for k in set(small) | set(large) if small[k] != large[k]}
    if libraries.hot() is not None:
        assert grown == {}, grown  # O(buckets): one bucket here, whatever the parameters
    else:
        # The Python path: a hook call per parameter per replica (the counter sees it).
        assert large[hook] - small[hook] == replicas * (80 - 8), grown


def test_python_calls_per_step_do_not_grow_with_the_parameters_on_the_hot_path():
    _assert_o_buckets(_calls_per_step(4), _calls_per_step(40), "on_grad", 2)


def gpu_calls_per_step(devices):
    """The same count for GPU replicas on the simulated driver (GradSync
    on `devices`), with the C++ hooks' marks: every gradient of every
    replica marked from C++ (with the stream that produced it: the simgpu
    tier's equivalence tests and tests/simgpu/breakages.py's
    ready-event-on-wrong-stream-hot show that)."""
    from simulated import streams

    from pyddp.engine.streams import simulated_gpus

    counts = []
    for layers in (4, 40):
        torch.manual_seed(0)
        base = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
        reps = [base] + [copy.deepcopy(base) for _ in devices[1:]]
        with simulated_gpus(devices, streams):
            sync = pyddp.GradSync(reps, bucket_cap_mb=1000, first_bucket_cap_mb=1000)
        x = torch.randn(4 * len(devices), 8)
        step = _synced_step(sync, reps, x, lambda: streams.synchronize_all(devices))
        for _ in range(3):
            step()
        hot = sync._reducer._layout.hot
        before = hot.marks() if hot is not None else 0
        counts.append(_profiled(step))
        if libraries.hot() is not None:
            assert hot.marks() - before == len(devices) * 2 * layers
        sync.close()
    _assert_o_buckets(counts[0], counts[1], "on_grad_gpu", len(devices))

    # pyddp.wrap's whole step (forward on the replica workers, backward, the
    # replicated optimizer's step, zero_grad), every thread counted.
    from simulated import gpu_step, gpu_wrap

    counts = []
    with _EveryThread() as every:
        for layers in (4, 40):
            torch.manual_seed(0)
            dm = gpu_wrap(nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)]), devices)
            opt = dm.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
            x = torch.randn(4 * len(devices), 8)

            def step(dm=dm, opt=opt, x=x):
                gpu_step(dm(x).square().mean(), opt, devices)

            for _ in range(4):
                step()
            counts.append(every.step(step))
            dm.close()
    _assert_o_buckets(counts[0], counts[1], "on_grad_gpu", len(devices))


@pytest.mark.simgpu
@pytest.mark.parametrize("devices", [[0, 1], [0, 0]])
def test_gpu_replicas_python_calls_per_step_do_not_grow_with_the_parameters(devices):
    from spawn import run_alone

    run_alone(gpu_calls_per_step, devices)


def test_the_cpp_hooks_follow_a_parameter_given_a_new_accumulator():
    # torch gives a parameter a new gradient accumulator when its data
    # changes dtype or device (Module._apply: .half().float()); hooks left on
    # the old one would never run again (the reductions would wait for the
    # end of backward, and the hand-over would fall to finish()).
    if libraries.hot() is None:
        pytest.skip("the hot path is off here (not built, or PYDDP_HOT=0)")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ref = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ref.load_state_dict(m.state_dict())
    dm = pyddp.wrap(m, ["cpu", "cpu"])
    opt = dm.optimizer(torch.optim.SGD, lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    hot = dm._reducer._layout.hot
    x = torch.randn(8, 4)
    for step in range(3):
        if step == 1:
            m.half().float()
            ref.half().float()
        before = hot.marks()
        dm(x).sum().backward()
        assert hot.marks() - before == 2 * 4, step  # every gradient of both replicas, from C++
        opt.step()
        opt.zero_grad()
        ref(x).sum().backward()
        ropt.step()
        ropt.zero_grad()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)  # float32 sums of 2 halves
    dm.close()


def launches_per_step(out: dict) -> None:
    """2 processes x 1 CPU replica: who launches each bucket across the
    processes (pyddp._hot's Wire in C++, or the transport's Python launch)
    and who completes it, per synced step, after warm-up; and the trained
    parameters, to compare with one device."""
    import pyddp._link.transport as transport

    python_launches, python_done = Counter(), Counter()
    launch, done = transport.BucketTransport.launch, transport._done

    def counted_launch(self, bucket):
        python_launches[bucket] += 1
        return launch(self, bucket)

    def counted_done(flight, bucket, fut):
        python_done[bucket] += 1
        return done(flight, bucket, fut)

    transport.BucketTransport.launch = counted_launch
    transport._done = counted_done
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    # About 16 KiB per layer: buckets of one or two layers.
    dm = pyddp.wrap(model, ["cpu"], bucket_cap_mb=0.04, first_bucket_cap_mb=0.02)
    opt = dm.optimizer(torch.optim.SGD, lr=0.05)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 64, generator=gen) for _ in range(6)]
    rank, world = pyddp.rank(), pyddp.world()
    wire = dm._reducer._link.transport.wire_hot
    out["hot"] = wire is not None
    out["steps"] = []
    for x in batches:
        python_launches.clear()
        python_done.clear()
        before = wire.launches() if wire is not None else 0
        inline = dm._reducer._engine.inline_launches
        dm(x.chunk(world)[rank]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        out["steps"].append(
            {
                "python_launches": sum(python_launches.values()),
                "python_done": sum(python_done.values()),
                "cpp_launches": (wire.launches() if wire is not None else 0) - before,
                "inline_launches": dm._reducer._engine.inline_launches - inline,
                "buckets": len(dm._reducer.buckets),
            }
        )
    out["params"] = [p.detach().tolist() for p in model.parameters()]
    out["batches"] = [x.tolist() for x in batches]
    dm.close()


@pytest.mark.multiprocess
def test_buckets_cross_processes_without_python_per_bucket_on_the_hot_path(tmp_path):
    from spawn import spawn

    got = spawn(launches_per_step, 2, out=tmp_path)
    hot_here = libraries.hot() is not None
    for r in got:
        assert r["hot"] == hot_here
        for s in r["steps"][2:]:  # after the first steps (the plan may be rebuilt)
            assert s["buckets"] >= 3, s
            if hot_here:
                # Every bucket launched and completed in C++, the agreement
                # riding in the last: no Python per bucket, none per step.
                assert s == {**s, "python_launches": 0, "python_done": 0}, s
                assert s["cpp_launches"] == s["buckets"], s
                # ... each from the thread that completed it (autograd's, or
                # finish()'s for the last), as torch DDP launches: no hand-off
                # to the engine's launcher thread.
                assert s["inline_launches"] == s["buckets"], s
            else:
                assert s["python_launches"] == s["buckets"] == s["python_done"], s
                assert s["inline_launches"] == 0, s  # Python launches: the launcher's
    # Both ranks trained as one device on the whole batches (float32 sums of
    # two halves: a few ulps).
    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for x in got[0]["batches"]:
        ref(torch.tensor(x)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    for r in got:
        for p, q in zip(ref.parameters(), r["params"]):
            torch.testing.assert_close(torch.tensor(q), p.detach(), rtol=1e-5, atol=1e-6)


def _build_copy(tmp_path, env=None, broken=False):
    """pip installs a copy of this tree (csrc/hot/ made not to compile if
    `broken`) into tmp_path/site, with `env` on top of this environment;
    returns (site, the build's log)."""
    import subprocess

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "simgpu"))
    from breakages import copy_tree, shadow_editable_install

    for tool in ("scikit_build_core", "pybind11"):
        assert importlib.util.find_spec(tool), (
            f"pytest -m build needs the build tools ({tool} is missing): pip install "
            "scikit-build-core pybind11 cmake ninja, as the README's build from source says"
        )
    src, site = tmp_path / "src", tmp_path / "site"
    copy_tree(str(src))
    if broken:
        with open(src / "csrc" / "hot" / "wire.cpp", "a") as f:
            f.write('\n#error "deliberately broken by tests/test_hot.py"\n')
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps"]
        + ["--target", str(site), str(src)],
        capture_output=True,
        text=True,
        env=dict(os.environ, **(env or {})),
    )
    log = build.stdout + build.stderr
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    shadow_editable_install(str(site))
    return site, log


def _run_built(site, tmp_path, script):
    """`script` in a fresh interpreter on the pyddp in `site`: its output."""
    import subprocess

    script += "print(pyddp.__path__)\n"
    env = dict(os.environ, PYTHONPATH=str(site), PYDDP_HOT="1")
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert str(site) in run.stdout  # the copy was imported, not this checkout
    assert not list((site / "pyddp").glob("_hot*.so"))
    return run.stdout


# Every build without _hot: what it says (`module`, `why`, the warnings
# `said`, the doctor's `report()`), read by each test's own asserts.
_STATUS = (
    "import warnings, torch, pyddp\n"
    "from pyddp.runtime import libraries\n"
    "from pyddp.doctor import report\n"
    "with warnings.catch_warnings(record=True) as said:\n"
    "    warnings.simplefilter('always')\n"
    "    module, why = libraries.hot_status()\n"
    "    assert libraries.hot() is None\n"
)

# What every build without _hot must still do: train on the Python path.
_TRAINS = (
    "m = torch.nn.Linear(4, 2)\n"
    "dm = pyddp.wrap(m, ['cpu', 'cpu'])\n"
    "dm(torch.randn(8, 4)).sum().backward()\n"
    "assert dm._reducer._layout.hot is None and m.weight.grad is not None\n"
)


@pytest.mark.build
def test_a_hot_path_that_does_not_compile_leaves_pyddp_on_the_python_path(tmp_path):
    # csrc/hot/ uses torch's C++ internals, which move between torch
    # releases: where it does not compile, pyddp must still install (without
    # _hot), run its Python path and say why (cmake/hot_step.cmake). A copy of
    # this tree with a deliberate compile error in csrc/hot/ is built and used.
    site, log = _build_copy(tmp_path, broken=True)
    assert "pyddp._hot did not build against torch" in log
    script = _STATUS + (
        "assert module is None and 'failed to compile against torch' in why, why\n"
        "assert 'deliberately broken' in why, why  # the first error, named\n"
        "assert [str(w.message) for w in said if 'hot path' in str(w.message)], said\n"
        "assert 'failed to compile' in '\\n'.join(report())\n"
    )
    _run_built(site, tmp_path, script + _TRAINS)


@pytest.mark.build
@pytest.mark.parametrize(
    "env,logged,why",
    [
        # Left out on purpose: said as such, not as "no torch at pyddp's build".
        ({"PYDDP_BUILD_HOT": "0"}, "PYDDP_BUILD_HOT=0: pyddp._hot is left out",
         "left out at pyddp's build (PYDDP_BUILD_HOT=0)"),
        # PYDDP_TORCH_PYTHON names the interpreter whose torch the build takes:
        # one without torch (here one that fails) leaves _hot out, though the
        # build's own Python has torch.
        ({"PYDDP_TORCH_PYTHON": "/bin/false"}, "no torch found for this build",
         "not built (no torch at pyddp's build"),
    ],
    ids=["PYDDP_BUILD_HOT=0", "PYDDP_TORCH_PYTHON-without-torch"],
)  # fmt: skip
def test_a_build_without_the_hot_path_says_why_and_trains(tmp_path, env, logged, why):
    site, log = _build_copy(tmp_path, env=env)
    assert logged in log, log[-3000:]
    script = _STATUS + (
        f"assert module is None and {why!r} in why, why\n"
        "assert not [w for w in said if 'hot path' in str(w.message)], said  # as asked\n"
        f"assert {why!r} in '\\n'.join(report())\n"
    )
    _run_built(site, tmp_path, script + _TRAINS)
