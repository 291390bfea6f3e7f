"""Training step time (forward, backward, SGD-momentum step, zero_grad) of an
MLP classifier. (a) `pyddp.wrap(model, ["cpu"])` against the bare model in
this process: the cost of the wrapper itself. (b) `pyddp.wrap(model, ["cpu",
"cpu"])` (gathered-output forward and `dm.loss`) against torch DDP with gloo in
2 spawned processes at the same global batch, with the bare single-process
model as a reference line.

How it is timed: configurations take turns in blocks (rotating who goes
first), each block one untimed step, to bring that configuration's weights
back into cache after the others ran, then `--block` timed steps. Thread
counts are fixed per process before any thread exists (a torch thread keeps
the intra-op thread count it first saw), so each (b) thread setting runs in
its own process; the orchestrator runs one block at a time, so only one
configuration computes at any moment.

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
Step = Callable[[], None]


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
    x = torch.randn(batch, sizes[0], generator=g)
    return x, torch.randint(sizes[-1], (batch,), generator=g)


def bare_step(sizes: Sequence[int], x: torch.Tensor, y: torch.Tensor) -> Step:
    model = make_model(sizes)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step


def pyddp_step(
    sizes: Sequence[int], devices: List[str], x: torch.Tensor, y: torch.Tensor, per_replica: bool
) -> Step:
    dm = pyddp.wrap(make_model(sizes), devices)
    opt = dm.optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)

    def step() -> None:
        loss = dm.loss(F.cross_entropy, x, y) if per_replica else F.cross_entropy(dm(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    step.dm = dm  # type: ignore[attr-defined]  # (how its replicas ran: run_replicas())
    return step


def timed_block(step: Step, n: int) -> List[float]:
    step()  # untimed: brings this configuration's state back into cache
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


# --------------------------------------------------------------- children
def pyddp_child(threads: int, cfg: Dict[str, Any], cmd: Any, res: Any) -> None:
    """One process, one thread setting: the bare model, pyddp gathered, pyddp dm.loss."""
    if threads > 0:
        torch.set_num_threads(threads)
    x, y = make_batch(cfg["sizes"], cfg["batch"])
    steps = {
        "bare": bare_step(cfg["sizes"], x, y),
        "pyddp gathered": pyddp_step(cfg["sizes"], ["cpu", "cpu"], x, y, False),
        "pyddp dm.loss": pyddp_step(cfg["sizes"], ["cpu", "cpu"], x, y, True),
    }
    res.put((0, torch.get_num_threads()))
    while (msg := cmd.get()) is not None:
        name, n = msg
        if name == "run_replicas":  # how each wrapped model's replicas ran
            how = getattr(pyddp.DistributedModel, "run_replicas", None)
            res.put(
                (0, {k: f.dm.run_replicas() for k, f in steps.items() if how and hasattr(f, "dm")})
            )
            continue
        res.put((0, timed_block(steps[name], n)))


def ddp_child(rank: int, init_file: str, cfg: Dict[str, Any], cmd: Any, res: Any) -> None:
    """One of 2 DDP ranks: its half of the global batch; step times taken here."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)  # 2 ranks on 2 cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    x, y = make_batch(cfg["sizes"], cfg["batch"])
    half = cfg["batch"] // 2
    xs, ys = x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half]
    model = DDP(make_model(cfg["sizes"]))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def step() -> None:
        F.cross_entropy(model(xs), ys).backward()
        opt.step()
        opt.zero_grad()

    res.put((rank, torch.get_num_threads()))
    while (msg := cmd.get()) is not None:
        dist.barrier()  # both ranks start the block together; not timed
        res.put((rank, timed_block(step, msg[1])))
    dist.destroy_process_group()


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Environment for children started inside the block: a spawned child reads
    OMP/MKL thread counts when it imports torch, before our code runs."""
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
    """Child processes that run blocks together (one pyddp process, or 2 DDP ranks)."""

    def __init__(self, name: str, procs: List[Any], cmds: List[Any], res: Any):
        self.name, self.procs, self.cmds, self.res = name, procs, cmds, res
        self.threads = 0

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
        self.threads = dict(self._get() for _ in self.procs)[0]

    def block(self, variant: str, steps: int) -> List[float]:
        for c in self.cmds:
            c.put((variant, steps))
        # DDP: rank 0's times (the ranks wait for each other every step).
        return dict(self._get() for _ in self.procs)[0]

    def stop(self) -> None:
        for c in self.cmds:
            c.put(None)
        for p in self.procs:
            p.join(timeout=60)


def start_groups(cfg: Dict[str, Any], tmp: str) -> List[Group]:
    ctx = torch.multiprocessing.get_context("spawn")
    one_thread = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    groups = []
    for threads in (1, 0):
        cmd, res = ctx.Queue(), ctx.Queue()
        with _env(**(one_thread if threads == 1 else {})):
            p = ctx.Process(target=pyddp_child, args=(threads, cfg, cmd, res), daemon=True)
            p.start()
        groups.append(Group(f"pyddp threads={threads or 'default'}", [p], [cmd], res))
    res, cmds, procs = ctx.Queue(), [ctx.Queue(), ctx.Queue()], []
    with _env(**one_thread):
        for rank in range(2):
            args = (rank, os.path.join(tmp, "rendezvous"), cfg, cmds[rank], res)
            procs.append(ctx.Process(target=ddp_child, args=args, daemon=True))
            procs[-1].start()
    groups.append(Group("ddp", procs, cmds, res))
    for g in groups:
        g.wait_ready()
    return groups


# ------------------------------------------------------------------ report
def _ms(s: Dict[str, float]) -> List[float]:
    return [s["median"] * 1e3, s["p10"] * 1e3, s["p90"] * 1e3]


Blocks = Dict[str, List[List[float]]]  # configuration -> rounds -> step times


def rotate_blocks(configs: Dict[str, Callable[[int], List[float]]], rounds: int, block: int):
    """Every configuration runs one block per round, starting point rotating."""
    names = list(configs)
    times: Blocks = {k: [] for k in names}
    for r in range(rounds + 1):  # round 0 is warm-up: allocator, gloo, bucket rebuild
        for name in rotated(names, r):
            ts = configs[name](block)
            if r > 0:
                times[name].append(ts)
    return times


def flat(blocks: List[List[float]]) -> Dict[str, float]:
    return summary([t for b in blocks for t in b])


def round_ratios(num: List[List[float]], den: List[List[float]]) -> Dict[str, float]:
    """Ratio of block medians round by round: neighbours in time, so its spread
    shows how steady the ratio is while the machine drifts."""
    return summary([summary(a)["median"] / summary(b)["median"] for a, b in zip(num, den)])


def part_a(cfg: Dict[str, Any], rounds: int, block: int) -> Dict[str, Any]:
    x, y = make_batch(cfg["sizes"], cfg["batch"])
    wrapped = "pyddp.wrap(['cpu'])"
    steps = {
        "bare": bare_step(cfg["sizes"], x, y),
        wrapped: pyddp_step(cfg["sizes"], ["cpu"], x, y, False),
        # A/A control: a second bare model timed the same way. Its ratio is what
        # this method reads when there is no difference at all.
        "bare, second copy": bare_step(cfg["sizes"], x, y),
    }
    configs = {k: (lambda n, s=s: timed_block(s, n)) for k, s in steps.items()}
    times = rotate_blocks(configs, rounds, block)
    s = {k: flat(v) for k, v in times.items()}
    rows, ratios = [], {}
    for k, v in s.items():
        by_round = round_ratios(times[k], times["bare"])
        ratios[k] = {"of_medians": v["median"] / s["bare"]["median"], "by_round": by_round}
        spread = f"{by_round['p10']:.3f}-{by_round['p90']:.3f}"
        rows.append([k] + _ms(v) + [ratios[k]["of_medians"], spread])
    print(
        f"(a) one replica vs bare model in this process ({torch.get_num_threads()} threads), "
        f"{rounds} rounds x {block} steps each"
    )
    headers = ["variant", "step ms median", "p10", "p90", "÷bare", "÷bare by round p10-p90"]
    print(table(headers, rows))
    print(
        f"goal: {wrapped} ÷ bare <= 1.05 (ratio of medians). The A/A control shows the noise "
        "floor of that ratio here.\n"
    )
    return {"steps": s, "ratios": ratios}


def part_b(cfg: Dict[str, Any], rounds: int, block: int) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        groups = start_groups(cfg, tmp)
        started = time.perf_counter() - t0
        configs: Dict[str, Callable[[int], List[float]]] = {}
        for g in groups[:-1]:
            for variant in ("bare", "pyddp gathered", "pyddp dm.loss"):
                configs[f"{g.name}: {variant}"] = lambda n, g=g, v=variant: g.block(v, n)
        configs["ddp"] = lambda n: groups[-1].block("ddp", n)
        try:
            times = rotate_blocks(configs, rounds, block)
            runs = {g.name: g.block("run_replicas", 0) for g in groups[:-1]}
        finally:
            for g in groups:
                g.stop()
    s = {k: flat(v) for k, v in times.items()}
    ddp = s["ddp"]
    rows = [["torch DDP gloo, 2 procs x 1 thread (rank 0)", cfg["batch"] // 2] + _ms(ddp)]
    rows[0] += [1.0, "-", "-"]
    out: Dict[str, Any] = {
        "ddp_rank0": ddp,
        "configs": {},
        "startup_s": started,
        "run_replicas": runs,
    }
    for g in groups[:-1]:
        bare = s[f"{g.name}: bare"]
        out["configs"][g.name] = {"torch_threads": g.threads}
        for variant in ("bare", "pyddp gathered", "pyddp dm.loss"):
            v = s[f"{g.name}: {variant}"]
            by_round = round_ratios(times[f"{g.name}: {variant}"], times["ddp"])
            out["configs"][g.name][variant] = {"step_s": v, "over_ddp_by_round": by_round}
            label = (
                f"bare model, 1 process, {g.threads} thread(s)"
                if variant == "bare"
                else f"{variant}, 2 replicas x {max(1, g.threads // 2)} thread(s)"
            )
            ratios = [v["median"] / ddp["median"], v["median"] / bare["median"]]
            rows.append([label, cfg["batch"] if variant == "bare" else cfg["batch"] // 2])
            rows[-1] += _ms(v) + ratios[:1] + [f"{by_round['p10']:.2f}-{by_round['p90']:.2f}"]
            rows[-1] += ratios[1:]
    print(
        f"(b) 2 replicas vs torch DDP (gloo), global batch {cfg['batch']}, {rounds} rounds x "
        f"{block} steps per configuration; child start-up {started:.1f} s"
    )
    headers = ["configuration", "batch/replica", "step ms median", "p10", "p90", "÷DDP"]
    print(table(headers + ["÷DDP by round p10-p90", "÷bare same threads"], rows))
    print(
        "goal: pyddp/DDP <= 1.0. Each group runs in a process whose torch thread count is "
        "set before anything ran\n(1 = torch.set_num_threads(1) and OMP/MKL_NUM_THREADS=1; "
        f"otherwise torch's default, {torch.get_num_threads()} here). pyddp's default gives "
        "each replica\nthat count // replicas (at least 1) intra-op threads: 'x N thread(s)'. "
        "DDP ranks time their own steps; rank 0 shown."
    )
    for name, how in runs.items():
        shown = "; ".join(f"{k}: {v}" for k, v in how.items()) or "(this pyddp has no run_replicas)"
        print(f"how the replicas ran ({name}, dmodel.run_replicas()): {shown}")
    return out


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="784,1024,1024,10", help="MLP layer widths")
    p.add_argument("--batch", type=int, default=256, help="global batch")
    p.add_argument("--rounds", type=int, default=10, help="(b) rounds over the configurations")
    p.add_argument("--block", type=int, default=6, help="(b) timed steps per configuration")
    p.add_argument("--rounds-a", type=int, default=30, help="(a) rounds; short blocks: drift")
    p.add_argument("--block-a", type=int, default=2, help="(a) timed steps per variant")
    args = p.parse_args()
    if args.quick:
        args.sizes, args.batch, args.rounds, args.block = "64,32,10", 32, 2, 2
        args.rounds_a, args.block_a = 2, 2
    cfg = {"sizes": [int(s) for s in args.sizes.split(",")], "batch": args.batch}
    print(header())
    print(
        f"MLP {args.sizes}, global batch {args.batch}, SGD lr {LR} momentum {MOMENTUM}; "
        "a step = forward + backward + optimizer step + zero_grad\n"
    )
    a = part_a(cfg, args.rounds_a, args.block_a)
    b = part_b(cfg, args.rounds, args.block)
    write_results("step_time", args, {"config": cfg, "one_replica": a, "two_replicas": b})


if __name__ == "__main__":
    main()
