"""`pyddp-bench overlap --processes N`: pyddp across processes against torch
DDP, N processes x 1 CPU replica each, same model and global batch.

The command starts the processes itself through torchrun (`python -m
torch.distributed.run`); each one runs this module's `worker`. Every process
holds both engines side by side: `pyddp.wrap(model, ["cpu"])` (spanning the
processes after `pyddp.init()`) and `DistributedDataParallel` (gloo,
`find_unused_parameters=False`) on its own gloo group, and times them in
interleaved A/B rounds (who goes first alternates each round, so drift hits
both) after an untimed warm-up round. A sample's step time is the slowest
rank's mean over `steps` steps. Rank 0 gathers the samples and writes them to
the file the parent reads; the parent prints the table and writes the JSON.

Overlap figures use the same definitions for both engines (comm = first
launch -> last reduction done, overlap = first launch -> autograd done):
pyddp's from `dm.stats()` over every timed step, DDP's from
`ddp._get_ddp_logging_data()` per iteration, one per sample (DDP records an
iteration's figures at the next forward, with the sample rate set to 1).
pyddp's per-iteration agreement cost is `agree_s`: building the agreement
(unused parameters, the work record) and reading its sums; it rides in the
last bucket's all-reduce and is timed with it. CPU time per step (the
process's, every thread) is reported beside wall time. The launch
order needs no per-iteration exchange: it is the bucket index, on rank 0's
bucket plan agreed once after the first (warm-up) iteration."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

import pyddp

from ._util import make_input, make_model, model_size, rotated
from .multiproc_results import DDP, PYDDP, combine, report

_PSGD_RANK = 4  # --power-sgd-rank's default (given otherwise: only with --processes)


def cores() -> int:
    """The cores this process may run on (the machine's, less any affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_threads(processes: int) -> int:
    return max(1, cores() // processes)


# --------------------------------------------------------------- parent side
def add_options(p: argparse.ArgumentParser) -> None:
    """The overlap subcommand's options for this mode."""
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="N > 1: pyddp across N processes (1 CPU replica each, started through torchrun) "
        "against torch DDP in the same processes; --devices and --caps are then unused",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="with --processes: intra-op threads per process (default: cores // processes)",
    )
    p.add_argument(
        "--comm-hook",
        choices=("fp16", "bf16", "power_sgd"),
        default=None,
        help="with --processes: both engines compress gradients on the wire with torch DDP's "
        "fp16/bf16 compression hook or PowerSGD (rank --power-sgd-rank, compressing from "
        "the second step, error feedback on) (run once without to compare)",
    )
    p.add_argument("--power-sgd-rank", type=int, default=_PSGD_RANK, help="PowerSGD's rank")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.processes < 1:
        parser.error(f"overlap --processes {args.processes}: give 1 (one process) or more")
    if args.threads is not None and args.threads < 1:
        parser.error(f"overlap --threads {args.threads}: give 1 or more")
    if args.processes > 1 and args.no_ddp:
        parser.error("overlap --processes N with --no-ddp: this mode measures pyddp against DDP")
    given = [f"--{k.replace('_', '-')}" for k in ("threads", "comm_hook") if getattr(args, k)]
    given += ["--power-sgd-rank"] * (args.power_sgd_rank != _PSGD_RANK)
    if args.processes == 1 and given:  # (they were recorded in the JSON, unused)
        parser.error(f"overlap {' '.join(given)}: only with --processes N (N > 1)")
    if args.power_sgd_rank < 1:
        parser.error(f"overlap --power-sgd-rank {args.power_sgd_rank}: give 1 or more")


def check_overlap_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """pyddp-bench overlap's arguments (from pyddp.bench.cli): usage errors."""
    check_args(parser, args)
    try:
        caps = [float(c) for c in args.caps.split(",")]
    except ValueError:
        caps = []
    if not caps or any(not 0 < c < float("inf") for c in caps):
        parser.error(f"overlap --caps {args.caps}: bucket caps in MiB, each > 0, comma separated")
    if len({f"{c:g}" for c in caps}) < len(caps):  # (one row per cap: a repeat pooled its samples)
        parser.error(f"overlap --caps {args.caps}: give each cap once")
    replicas = args.processes if args.processes > 1 else len(args.devices)
    if replicas < 2:  # (a probe: five variants of one replica, the same run five times)
        parser.error(
            f"overlap --devices {' '.join(args.devices)}: one replica reduces nothing, so there "
            "is no overlap to measure; give two or more (--devices cpu cpu) or --processes N"
        )
    rows = 2 if args.model == "mlp_bn" else 1  # (BatchNorm's statistics need 2 rows)
    batch = model_size(args)["batch"]  # (--quick's, where it takes fewer)
    if batch < rows * replicas:  # (--processes: one replica each; --devices is not used)
        where = f"{args.processes} --processes" if args.processes > 1 else f"{replicas} --devices"
        each = "two rows per replica for --model mlp_bn" if rows == 2 else "one row per replica"
        parser.error(f"overlap --batch {batch}: at least {each} ({where})")


def command(args: argparse.Namespace, size: Dict[str, int], chart: Path) -> Dict[str, Any]:
    """`pyddp-bench overlap --processes N` (args from pyddp.bench.cli): runs,
    prints the table, draws the chart; returns the results for the JSON."""
    from . import overlap

    # --quick: a few samples of a few steps; process start-up dominates anyway.
    rounds, steps = (5, 4) if args.quick else (args.rounds, args.steps)
    config = {
        "model": args.model,
        **size,
        "processes": args.processes,
        "threads": args.threads or default_threads(args.processes),
        "threads_from": "--threads" if args.threads else "cores // processes",
        "cores": cores(),
        "rounds": rounds,
        "steps": steps,
        "progress": not args.no_progress,
        "comm_hook": args.comm_hook,
        "power_sgd_rank": args.power_sgd_rank,
    }
    result = run(config, args.processes)
    print(report(result))
    if args.quick:
        print("--quick: a tiny model and few samples: this checks that the command runs.")
    print(f"chart {overlap.chart(result, chart)}")
    return result


def run(config: Dict[str, Any], processes: int) -> Dict[str, Any]:
    """Starts `processes` workers under torchrun and returns rank 0's results."""
    env = dict(os.environ)
    # The workers import the same pyddp as this process, wherever it lives.
    root = str(Path(pyddp.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    # Set before torch starts in the workers (torchrun would set 1 and say so).
    env["OMP_NUM_THREADS"] = str(config["threads"])
    with tempfile.TemporaryDirectory(prefix="pyddp-bench-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={processes}",
            f"--master-port={_free_port()}",
            "-m",
            "pyddp.bench.multiproc",
            json.dumps(config),
            str(out),
        ]
        with subprocess.Popen(cmd, env=env) as torchrun:
            try:
                code = torchrun.wait()
            except KeyboardInterrupt:
                _stop(torchrun)
                raise
        if code != 0 or not out.is_file():
            raise RuntimeError(
                f"pyddp-bench overlap --processes {processes}: the workers failed (torchrun "
                f"exit status {code}; their errors are printed above). Command: "
                + " ".join(cmd[:7])
            )
        return json.loads(out.read_text())


def _stop(torchrun: subprocess.Popen) -> None:
    """After a Ctrl-C: torchrun stops its workers, which run in sessions of
    their own (a Ctrl-C reaches torchrun, not them), and this waits for it
    (before, subprocess.run killed torchrun a quarter second in, and the
    workers ran on after the prompt came back). A torchrun the Ctrl-C did
    not reach (a SIGINT sent to this process alone) is asked with SIGTERM;
    a second Ctrl-C kills it and its workers (killing torchrun alone left
    them running: a review)."""
    try:
        try:
            torchrun.wait(timeout=5)  # (the Ctrl-C reached it too: it is stopping them)
        except subprocess.TimeoutExpired:
            torchrun.terminate()
            torchrun.wait(timeout=120)
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        for pid in [*children(torchrun.pid), torchrun.pid]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def children(pid: int) -> List[int]:
    """The processes whose parent is `pid` (Linux's /proc; none elsewhere)."""
    found = []
    entries = os.listdir("/proc") if os.path.isdir("/proc") else []
    for entry in filter(str.isdigit, entries):
        try:
            with open(f"/proc/{entry}/stat") as f:  # pid (name) state ppid ...
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue  # (gone meanwhile)
    return found


def _free_port() -> int:
    # The OS picks an unused port; torchrun binds it a moment later. Another
    # program could take it in between, which then fails loudly, never silently.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- rank side
def worker(cfg: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """One rank's benchmark; returns the combined results on rank 0, else None."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from tqdm.auto import tqdm

    torch.set_num_threads(cfg["threads"])
    pyddp.init()
    rank, world = pyddp.rank(), pyddp.world()
    # The benchmark's own barriers and gathers, and DDP, each on a gloo group
    # of their own: none shares a queue with pyddp's reductions on WORLD.
    bench_group = dist.new_group(backend="gloo")
    ddp_group = dist.new_group(backend="gloo")
    x, y = make_input(cfg["model"], cfg["width"], cfg["batch"])
    rows = _rows(cfg["batch"], rank, world)
    xs, ys = x[rows], y[rows]
    build = (cfg["model"], cfg["width"], cfg["depth"])
    dm = pyddp.wrap(make_model(*build), ["cpu"])
    ddp = DistributedDataParallel(
        make_model(*build), process_group=ddp_group, find_unused_parameters=False
    )
    ddp._set_ddp_runtime_logging_sample_rate(1)  # every iteration's figures, not 1 in 100
    bucket_bytes = sum(p.numel() * p.element_size() for p in dm.module.parameters())
    wire_bytes = float(bucket_bytes)
    hook = cfg.get("comm_hook")
    if hook == "power_sgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        def state(group: Any) -> Any:  # rank r factors from the second step on
            return psgd.PowerSGDState(group, matrix_approximation_rank=cfg["power_sgd_rank"],
                                      start_powerSGD_iter=2)  # fmt: skip

        # PowerSGD issues collectives from its futures' callbacks: on a group
        # of its own (on pyddp's bucket group they could pass the agreement
        # that follows the buckets there, in a different order on each rank).
        dm.register_comm_hook(state(dist.new_group(backend="gloo")), psgd.powerSGD_hook)
        ddp.register_comm_hook(state(ddp_group), psgd.powerSGD_hook)
        wire_bytes = _power_sgd_bytes(dm.module, cfg["power_sgd_rank"])
    elif hook:
        dm.register_comm_hook(None, hook)
        ddp.register_comm_hook(ddp_group, _gloo_hook(hook))
        wire_bytes = bucket_bytes * 0.5  # float32 gradients travel as 16-bit values

    def pyddp_step() -> None:
        F.cross_entropy(dm(xs), ys).backward()
        dm.zero_grad()

    def ddp_step() -> None:
        F.cross_entropy(ddp(xs), ys).backward()
        ddp.zero_grad()

    cases: List[tuple] = [(PYDDP, pyddp_step), (DDP, ddp_step)]
    times: Dict[str, List[float]] = {PYDDP: [], DDP: []}
    cpu: Dict[str, List[float]] = {PYDDP: [], DDP: []}  # this process's CPU time, all threads
    stats: Dict[str, List[Dict[str, float]]] = {PYDDP: [], DDP: []}
    rounds, steps = cfg["rounds"], cfg["steps"]
    bar = tqdm(
        total=rounds * len(cases),
        desc=f"overlap rounds ({world} processes)",
        disable=rank != 0 or not cfg["progress"],
        leave=False,
    )
    # Round 0 is warm-up (thread pools, allocator, both engines' bucket
    # rebuild after their first iteration): untimed.
    for r in range(rounds + 1):
        for name, step in rotated(cases, r):
            step()  # untimed: brings this engine's weights back into cache
            # Why: every rank starts the sample together, so no rank's clock
            # includes waiting for another to arrive from the previous sample.
            dist.barrier(group=bench_group)
            dm.reset_stats()  # pyddp's means cover exactly the timed steps
            start, cpu0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step()
            elapsed = (time.perf_counter() - start) / steps
            if r:
                times[name].append(elapsed)
                cpu[name].append((time.process_time() - cpu0) / steps)
                stats[name].append(_pyddp_stats(dm) if name == PYDDP else _ddp_stats(ddp))
                bar.update(1)
    bar.close()
    mine = {"times": times, "cpu": cpu, "stats": stats, "ddp_logging": _ddp_averages(ddp),
            "bucket_bytes_per_step": bucket_bytes,
            "wire_bytes_per_step": wire_bytes}  # fmt: skip
    gathered: Optional[List[Any]] = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0, group=bench_group)
    dm.close()
    dist.destroy_process_group()
    return combine(cfg, gathered) if rank == 0 else None


def _power_sgd_bytes(model: Any, rank: int, min_rate: float = 2.0) -> float:
    """Bytes PowerSGD all-reduces per step once compressing (torch's
    powerSGD_hook with its defaults): a gradient of one dimension whole; a
    matrix n x m (higher dimensions folded into m) as P (n x rank) and Q
    (m x rank), unless that would not compress it at least `min_rate` times
    (then whole)."""
    total = 0.0
    for p in model.parameters():
        size = p.numel() * p.element_size()
        if p.dim() <= 1:
            total += size
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        if (n + m) * rank * min_rate < n * m:  # torch's _should_compress
            total += (n + m) * min(n, m, rank) * p.element_size()
        else:
            total += size
    return total


def _gloo_hook(name: str) -> Callable[..., Any]:
    """torch DDP's compression hook by name, for DDP on gloo: DDP refuses its
    bf16 hook by name without NCCL, though gloo sums bfloat16."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = getattr(default_hooks, f"{name}_compress_hook")

    def on_gloo(state, bucket):  # unannotated: DDP checks a hook's annotations
        return hook(state, bucket)

    return on_gloo


def _rows(n: int, rank: int, world: int) -> slice:
    """This rank's rows of the global batch (the first n % world ranks get one more)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def _pyddp_stats(dm: pyddp.DistributedModel) -> Dict[str, float]:
    mean = dm.stats()["mean"]
    keys = ("backward_compute_s", "comm_s", "overlap_s", "agree_s")
    return {k: float(mean.get(k, 0.0)) for k in keys}


def _ddp_stats(ddp: Any) -> Dict[str, float]:
    # The iteration before the last forward: DDP records at the next forward.
    d = ddp._get_ddp_logging_data()
    comm = d.get("backward_comm_time", 0) / 1e9
    overlap = d.get("backward_compute_comm_overlap_time", 0) / 1e9
    return {
        "backward_compute_s": d.get("backward_compute_time", 0) / 1e9,
        "comm_s": comm,
        "overlap_s": min(max(overlap, 0.0), comm),  # clipped as pyddp's (pyddp.engine.observe)
        "iteration": d.get("iteration", 0),
    }


def _ddp_averages(ddp: Any) -> Dict[str, int]:
    """DDP's own running averages (ns), warm-up included: kept for reference."""
    d = ddp._get_ddp_logging_data()
    return {k: v for k, v in d.items() if k.startswith("avg_") and isinstance(v, int)}


def _record(fn: Callable[[], None]) -> Callable[[], None]:
    # torchrun's error files: a failing rank's traceback in torchrun's summary.
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn)


@_record
def _main() -> None:
    parser = argparse.ArgumentParser(description="one rank of `pyddp-bench overlap --processes`")
    parser.add_argument("config", help="JSON: the run's configuration")
    parser.add_argument("out", help="where rank 0 writes the results (JSON)")
    args = parser.parse_args()
    try:
        result = worker(json.loads(args.config))
    except KeyboardInterrupt:  # (torchrun passes a Ctrl-C on: the parent says it, once)
        sys.exit(130)
    if result is not None:
        Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    _main()
