"""Training step time (forward, backward, SGD-momentum step, zero_grad) of an
MLP classifier. (a) `pyddp.wrap(model, ["cpu"])` against the bare model,
interleaved step by step in this process: the cost of the wrapper itself.
(b) `pyddp.wrap(model, ["cpu", "cpu"])` (gathered-output forward and
`dm.loss`) against torch DDP with gloo in 2 spawned processes at the same
global batch, with the bare single-process model as a reference line.

Thread counts are fixed per process before any thread exists (a torch thread
keeps the intra-op thread count it first saw), so each (b) configuration runs
in its own process; the orchestrator hands blocks of steps to one process at a
time, rotating, so every configuration sees the same machine conditions.

    python bench/step_time.py [--quick] [--sizes 784,1024,1024,10] [--batch 256]"""

from __future__ import annotations

import contextlib
import os
import queue
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from _common import header, parser, rotated, summary, table, write_results
from torch import nn

import pyddp

LR, MOMENTUM = 0.01, 0.9
_TIMEOUT_S = 600  # a child that says nothing for this long has died or hung


def make_model(sizes: Sequence[int]) -> nn.Module:
    torch.manual_seed(0)  # every configuration trains the same initial model
    layers: List[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def make_batch(sizes: Sequence[int], batch: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, sizes[0], generator=g), torch.randint(
        sizes[-1], (batch,), generator=g
    )


Step = Callable[[], None]


def bare_step(sizes: Sequence[int], x: torch.Tensor, y: torch.Tensor) -> Step:
    model = make_model(sizes)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step


def pyddp_step(
    sizes: Sequence[int],
    devices: List[str],
    x: torch.Tensor,
    y: torch.Tensor,
    per_replica_loss: bool,
) -> Step:
    dm = pyddp.wrap(make_model(sizes), devices)
    opt = dm.optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)

    def step() -> None:
        loss = dm.loss(F.cross_entropy, x, y) if per_replica_loss else F.cross_entropy(dm(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def run_interleaved(steps: Dict[str, Step], n: int, first: int = 0) -> Dict[str, List[float]]:
    """n timed steps of every variant, one step of each in turn."""
    times: Dict[str, List[float]] = {k: [] for k in steps}
    for i in range(n):
        for name in rotated(list(steps), first + i):
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    return times


# --------------------------------------------------------------- children
def pyddp_child(threads: int, cfg: Dict[str, Any], cmd: Any, res: Any) -> None:
    """One process, one thread setting: bare model, pyddp gathered and pyddp
    dm.loss, interleaved step by step within each block."""
    if threads > 0:
        torch.set_num_threads(threads)
    x, y = make_batch(cfg["sizes"], cfg["batch"])
    steps = {
        "bare": bare_step(cfg["sizes"], x, y),
        "pyddp gathered": pyddp_step(cfg["sizes"], ["cpu", "cpu"], x, y, False),
        "pyddp dm.loss": pyddp_step(cfg["sizes"], ["cpu", "cpu"], x, y, True),
    }
    res.put((0, torch.get_num_threads()))
    block = 0
    while (msg := cmd.get()) is not None:
        res.put((0, run_interleaved(steps, msg, first=block)))
        block += 1


def ddp_child(
    rank: int, world: int, init_file: str, cfg: Dict[str, Any], cmd: Any, res: Any
) -> None:
    """One DDP rank: its shard of the global batch, step times taken here."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)  # 2 ranks on 2 cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    x, y = make_batch(cfg["sizes"], cfg["batch"])
    shard = cfg["batch"] // world
    xs, ys = x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]
    model = DDP(make_model(cfg["sizes"]))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def step() -> None:
        F.cross_entropy(model(xs), ys).backward()
        opt.step()
        opt.zero_grad()

    res.put((rank, torch.get_num_threads()))
    while (msg := cmd.get()) is not None:
        dist.barrier()  # both ranks start the block together; not timed
        res.put((rank, run_interleaved({"torch DDP gloo": step}, msg)))
    dist.destroy_process_group()


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Environment for a child started inside the block: spawned children read
    OMP/MKL thread counts at import, before any of our code runs."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Group:
    """Processes that run one configuration's blocks together (2 for DDP)."""

    def __init__(self, name: str, procs: List[Any], cmds: List[Any], res: Any):
        self.name, self.procs, self.cmds, self.res = name, procs, cmds, res
        self.threads: List[int] = []
        self.times: Dict[str, List[float]] = {}

    def _get(self) -> Tuple[int, Any]:
        """(rank, payload) from the next child that answers."""
        while True:
            try:
                return self.res.get(timeout=5)
            except queue.Empty:
                dead = [p.exitcode for p in self.procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"{self.name}: a child exited with {dead}") from None

    def wait_ready(self) -> None:
        self.threads = [t for _, t in sorted(self._get() for _ in self.procs)]

    def run(self, steps: int, record: bool) -> None:
        for c in self.cmds:
            c.put(steps)
        replies = dict(self._get() for _ in self.procs)
        # DDP: rank 0's times (the ranks wait for each other every step).
        if record:
            for name, ts in replies[0].items():
                self.times.setdefault(name, []).extend(ts)

    def stop(self) -> None:
        for c in self.cmds:
            c.put(None)
        for p in self.procs:
            p.join(timeout=60)


def start_groups(cfg: Dict[str, Any], tmp: str) -> List[Group]:
    ctx = torch.multiprocessing.get_context("spawn")
    groups = []
    for label, threads in (("threads=1", 1), ("threads=default", 0)):
        cmd, res = ctx.Queue(), ctx.Queue()
        env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"} if threads == 1 else {}
        with _env(**env):
            p = ctx.Process(target=pyddp_child, args=(threads, cfg, cmd, res), daemon=True)
            p.start()
        groups.append(Group(f"pyddp {label}", [p], [cmd], res))
    res = ctx.Queue()
    cmds, procs = [], []
    with _env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"):
        for rank in range(2):
            cmds.append(ctx.Queue())
            p = ctx.Process(
                target=ddp_child,
                args=(rank, 2, os.path.join(tmp, "rendezvous"), cfg, cmds[-1], res),
                daemon=True,
            )
            p.start()
            procs.append(p)
    groups.append(Group("ddp", procs, cmds, res))
    for g in groups:
        g.wait_ready()
    return groups


# ------------------------------------------------------------------ report
def _ms(s: Dict[str, float]) -> List[float]:
    return [s["median"] * 1e3, s["p10"] * 1e3, s["p90"] * 1e3]


def part_a(cfg: Dict[str, Any], steps: int, warmup: int) -> Dict[str, Any]:
    x, y = make_batch(cfg["sizes"], cfg["batch"])
    variants = {
        "bare": bare_step(cfg["sizes"], x, y),
        "pyddp.wrap(['cpu'])": pyddp_step(cfg["sizes"], ["cpu"], x, y, False),
    }
    run_interleaved(variants, warmup)
    times = run_interleaved(variants, steps)
    s = {k: summary(v) for k, v in times.items()}
    ratio = s["pyddp.wrap(['cpu'])"]["median"] / s["bare"]["median"]
    paired = summary([w / b for w, b in zip(times["pyddp.wrap(['cpu'])"], times["bare"])])
    print(
        f"(a) one replica vs bare model, this process ({torch.get_num_threads()} threads), "
        f"{steps} interleaved steps each"
    )
    print(table(["variant", "step ms median", "p10", "p90"], [[k] + _ms(v) for k, v in s.items()]))
    print(
        f"ratio of medians wrap/bare = {ratio:.3f} (goal <= 1.05); per-pair ratio p10-p90 "
        f"{paired['p10']:.3f}-{paired['p90']:.3f}\n"
    )
    return {"steps": s, "ratio_of_medians": ratio, "paired_ratio": paired}


def part_b(cfg: Dict[str, Any], rounds: int, block: int) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        groups = start_groups(cfg, tmp)
        started = time.perf_counter() - t0
        try:
            for g in groups:  # warm-up block: allocator, gloo connections, bucket rebuild
                g.run(max(2, block // 2), record=False)
            for r in range(rounds):
                for g in rotated(groups, r):
                    g.run(block, record=True)
        finally:
            for g in groups:
                g.stop()
    ddp = summary(groups[-1].times["torch DDP gloo"])
    rows, out = [], {"ddp_rank0": ddp, "configs": {}, "startup_s": started}
    rows.append(
        ["torch DDP gloo, 2 procs x 1 thread (rank 0)", cfg["batch"] // 2] + _ms(ddp) + [1.0, "-"]
    )
    for g in groups[:-1]:
        threads = g.threads[0]
        bare = summary(g.times["bare"])
        out["configs"][g.name] = {"torch_threads": threads, "bare": bare}
        rows.append(
            [f"bare model, 1 process, {threads} thread(s)", cfg["batch"]]
            + _ms(bare)
            + [bare["median"] / ddp["median"], 1.0]
        )
        for name in ("pyddp gathered", "pyddp dm.loss"):
            s = summary(g.times[name])
            out["configs"][g.name][name] = s
            label = f"{name}, 2 replicas, {threads} thread(s) each"
            rows.append(
                [label, cfg["batch"]]
                + _ms(s)
                + [s["median"] / ddp["median"], s["median"] / bare["median"]]
            )
    print(
        f"(b) 2 replicas vs torch DDP (gloo), global batch {cfg['batch']}, {rounds} rounds x "
        f"{block} steps per configuration, rotating; process start-up {started:.1f} s"
    )
    print(
        table(
            [
                "configuration",
                "batch/replica",
                "step ms median",
                "p10",
                "p90",
                "÷DDP",
                "÷bare same threads",
            ],
            rows,
        )
    )
    print(
        "goal: pyddp/DDP <= 1.0. thread(s) = torch intra-op threads set in that process "
        "before anything ran\n(1 = torch.set_num_threads(1) + OMP/MKL_NUM_THREADS=1; "
        f"otherwise torch's default, {torch.get_num_threads()} here). Each pyddp replica "
        "thread runs its ops with that many,\nso 2 replicas x 2 threads = 4 busy threads. "
        "DDP ranks time their own steps; rank 0 shown."
    )
    return out


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="784,1024,1024,10", help="MLP layer widths")
    p.add_argument("--batch", type=int, default=256, help="global batch")
    p.add_argument("--steps", type=int, default=60, help="(a) timed steps per variant")
    p.add_argument("--rounds", type=int, default=10, help="(b) rounds over the configurations")
    p.add_argument("--block", type=int, default=6, help="(b) steps per variant per round")
    args = p.parse_args()
    if args.quick:
        args.sizes, args.batch, args.steps, args.rounds, args.block = "64,32,10", 32, 5, 2, 2
    cfg = {"sizes": [int(s) for s in args.sizes.split(",")], "batch": args.batch}
    print(header())
    print(
        f"MLP {args.sizes}, global batch {args.batch}, SGD lr {LR} momentum {MOMENTUM}; "
        "a step = forward + backward + step + zero_grad\n"
    )
    a = part_a(cfg, args.steps, warmup=max(2, args.steps // 10))
    b = part_b(cfg, args.rounds, args.block)
    write_results("step_time", args, {"config": cfg, "one_replica": a, "two_replicas": b})


if __name__ == "__main__":
    main()
