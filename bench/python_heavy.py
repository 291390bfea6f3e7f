"""Where a training step's time goes for a Python-heavy model on CPU replicas in
one process. The model is many tiny Linear layers (default 2500 x Linear(8, 8),
batch 32): each step is thousands of small ops whose Python and dispatch cost
far exceeds their arithmetic, and Python runs one thread at a time (the GIL),
so replicas on threads cannot run it in parallel.

Variants, interleaved in blocks (one untimed step, then --block timed steps;
who goes first rotates each round):
  bare                  the model alone, torch's default intra-op threads
                        (sensitive to other OpenMP threads in the process:
                        compare with a --no-pyddp run)
  bare, 1 thread        the same under torch.set_num_threads(1): what each of
                        2 pyddp CPU replicas gets on a 2-core machine
  bare, 1 thread, hooks + a no-op Python hook on every parameter: the cost of
                        autograd calling into Python once per gradient
  2 copies, 1 thread    two copies of the model on half batches, one after
                        the other on one thread: two replicas' work, no threads
  2 copies, 2 threads   the same two copies on two threads (1 intra-op
                        thread each), no pyddp: the best that threaded
                        replicas can do under the GIL
  pyddp, 2 replicas     pyddp.wrap(model, ["cpu", "cpu"]): dm.loss, backward,
                        zero_grad
Each step is split into forward (with the loss), backward and zero_grad;
"cores busy" is the process's CPU time over wall time (1.0: one core busy).
Then one cProfile of pyddp's step on the caller's thread (replica 0 and the
orchestration; replica 1's thread is not profiled), grouped by where the
time is spent. cProfile slows Python-heavy code: read its shares, not its ms.

    python bench/python_heavy.py [--quick] [--layers 2500] [--width 8] [--batch 32]
                                 [--rounds 6] [--no-pyddp]"""

from __future__ import annotations

import cProfile
import pstats
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
from _common import header, parser, rotated, summary, table, write_results
from torch import nn

import pyddp

Phases = Tuple[float, float, float]  # forward (with loss), backward, zero_grad; seconds
PHASES = ("forward", "backward", "zero_grad")


def one_thread() -> None:
    """Thread initializer: 1 intra-op thread, for good. torch sets a thread's
    count again at its first parallel op, to the last count any thread set; the
    get_num_threads() call does that first, so set_num_threads(1) sticks."""
    torch.get_num_threads()
    torch.set_num_threads(1)


def make_model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)  # every variant trains the same initial model
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


class Timer:
    """Wall-clock marks between phases of one step."""

    def __init__(self) -> None:
        self.marks = [time.perf_counter()]

    def mark(self) -> None:
        self.marks.append(time.perf_counter())

    def phases(self) -> Phases:
        m = self.marks
        return (m[1] - m[0], m[2] - m[1], m[3] - m[2])


def bare_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, threads: int = 0):
    def step() -> Phases:
        before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            t = Timer()
            loss = F.cross_entropy(model(x), y)
            t.mark()
            loss.backward()
            t.mark()
            model.zero_grad()
            t.mark()
        finally:
            torch.set_num_threads(before)
        return t.phases()

    return step


def serial_step(models: List[nn.Module], x: torch.Tensor, y: torch.Tensor):
    half = x.shape[0] // 2
    halves = [
        bare_step(m, x[i * half : (i + 1) * half], y[i * half : (i + 1) * half], threads=1)
        for i, m in enumerate(models)
    ]

    def step() -> Phases:
        a, b = (h() for h in halves)
        return (a[0] + b[0], a[1] + b[1], a[2] + b[2])

    return step


def threaded_step(models: List[nn.Module], x: torch.Tensor, y: torch.Tensor, pool):
    """Two copies on half batches: copy 0 on the caller's thread, copy 1 on the
    pool's thread, forward together, then backward together."""
    half = x.shape[0] // 2
    xs, ys = (x[:half], x[half:]), (y[:half], y[half:])

    def both(fn: Callable[[int], object]) -> List[object]:
        other = pool.submit(fn, 1)
        return [fn(0), other.result()]

    def step() -> Phases:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            t = Timer()
            losses = both(lambda r: F.cross_entropy(models[r](xs[r]), ys[r]))
            t.mark()
            both(lambda r: losses[r].backward())
            t.mark()
            for m in models:
                m.zero_grad()
            t.mark()
        finally:
            torch.set_num_threads(before)
        return t.phases()

    return step


def pyddp_step(dm: pyddp.DistributedModel, x: torch.Tensor, y: torch.Tensor):
    def step() -> Phases:
        t = Timer()
        loss = dm.loss(F.cross_entropy, x, y)
        t.mark()
        loss.backward()
        t.mark()
        dm.zero_grad()
        t.mark()
        return t.phases()

    return step


def measure(steps: Dict[str, Callable[[], Phases]], rounds: int, block: int) -> Dict[str, Dict]:
    samples: Dict[str, List[Phases]] = {k: [] for k in steps}
    busy: Dict[str, List[float]] = {k: [] for k in steps}
    names = list(steps)
    for r in range(rounds + 1):  # round 0 is warm-up: allocator, thread pools
        for name in rotated(names, r):
            steps[name]()  # untimed: brings this variant's weights back into cache
            cpu, wall = time.process_time(), time.perf_counter()
            phases = [steps[name]() for _ in range(block)]
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            if r:
                samples[name] += phases
                busy[name].append(cpu / wall)
    out = {}
    for name in names:
        out[name] = {
            "step_s": summary([sum(p) for p in samples[name]]),
            **{f"{ph}_s": summary([p[i] for p in samples[name]]) for i, ph in enumerate(PHASES)},
            "cores_busy": summary(busy[name]),
        }
    return out


def profile_groups(dm: pyddp.DistributedModel, x, y, steps: int) -> Dict[str, float]:
    """Own time (tottime) on the caller's thread, by where it is spent."""
    step = pyddp_step(dm, x, y)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    groups = {
        "autograd engine (C++, replica 0's backward)": 0.0,
        "ops (C++: linear, loss, copies)": 0.0,
        "pyddp's Python (hooks, replica checks, scatter)": 0.0,
        "torch.nn's Python (Module.__call__, forward)": 0.0,
        "waiting for replica 1's thread (lock)": 0.0,
        "other Python": 0.0,
    }
    for (path, _, func), (_, _, own, _, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        if "run_backward" in func:
            key = "autograd engine (C++, replica 0's backward)"
        elif "_thread.lock" in func:
            key = "waiting for replica 1's thread (lock)"
        elif path == "~":  # a builtin: torch ops and the rest of C
            key = "ops (C++: linear, loss, copies)" if "torch" in func else "other Python"
        elif "/pyddp/" in path:
            key = "pyddp's Python (hooks, replica checks, scatter)"
        elif "/torch/nn/" in path:
            key = "torch.nn's Python (Module.__call__, forward)"
        else:
            key = "other Python"
        groups[key] += own / steps
    return groups


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2500, help="tiny Linear layers")
    p.add_argument("--width", type=int, default=8, help="features of each layer")
    p.add_argument("--batch", type=int, default=32, help="global batch")
    p.add_argument("--rounds", type=int, default=6, help="timed blocks per variant")
    p.add_argument("--block", type=int, default=2, help="timed steps per block")
    p.add_argument(
        "--no-pyddp",
        action="store_true",
        help="bare variants only: no pyddp threads in the process (a control for 'bare')",
    )
    args = p.parse_args()
    if args.quick:
        args.layers, args.rounds, args.block = 200, 2, 1
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randint(args.width, (args.batch,), generator=g)

    print(header())
    print(
        f"{args.layers} x Linear({args.width}, {args.width}), global batch {args.batch}; "
        f"{args.rounds} rounds x {args.block} timed steps per variant\n"
    )
    hooked = make_model(args.layers, args.width)
    for param in hooked.parameters():
        param.register_post_accumulate_grad_hook(lambda _: None)
    pool = ThreadPoolExecutor(1, initializer=one_thread)
    copies = [make_model(args.layers, args.width) for _ in range(2)]
    steps = {
        "bare": bare_step(make_model(args.layers, args.width), x, y),
        "bare, 1 thread": bare_step(make_model(args.layers, args.width), x, y, threads=1),
        "bare, 1 thread, hooks": bare_step(hooked, x, y, threads=1),
        "2 copies, 1 thread": serial_step(copies, x, y),
        "2 copies, 2 threads": threaded_step(copies, x, y, pool),
    }
    dm = None
    if not args.no_pyddp:
        dm = pyddp.wrap(make_model(args.layers, args.width), ["cpu", "cpu"])
        steps["pyddp, 2 replicas"] = pyddp_step(dm, x, y)
    res = measure(steps, args.rounds, args.block)
    base = res["bare"]["step_s"]["median"]
    rows = []
    for name, r in res.items():
        s = r["step_s"]
        rows.append(
            [name, s["median"] * 1e3, s["p10"] * 1e3, s["p90"] * 1e3]
            + [r[f"{ph}_s"]["median"] * 1e3 for ph in PHASES]
            + [s["median"] / base, r["cores_busy"]["median"]]
        )
    headers = ["variant", "step ms", "p10", "p90", "forward", "backward", "zero_grad"]
    print(table(headers + ["÷bare", "cores busy"], rows))
    print("forward, backward, zero_grad: medians of each phase (they need not add up to the step)")
    pool.shutdown()
    results: Dict[str, object] = {"variants": res}
    if dm is not None:
        # Each CPU replica should run 1 intra-op thread here (2 cores, 2
        # replicas); a worker that ended up with more slows every variant's ops.
        results["replica_threads"] = dm._map_replicas(
            lambda r, m, s: torch.get_num_threads(), [None, None]
        )
        print(f"pyddp replicas' intra-op threads after the run: {results['replica_threads']}")
        groups = profile_groups(dm, x, y, max(2, args.block))
        total = sum(groups.values())
        print(
            f"\ncProfile of pyddp's step, caller's thread: {total * 1e3:.0f} ms per step profiled"
        )
        shares = [[k, v * 1e3, f"{v / total:.0%}"] for k, v in groups.items()]
        print(table(["where", "ms", "share"], shares))
        results["profile_caller_thread_s"] = groups
        dm.close()
    write_results("python_heavy-no-pyddp" if args.no_pyddp else "python_heavy", args, results)


if __name__ == "__main__":
    main()
