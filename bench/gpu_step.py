"""One GPU, one process: the training step of the plain model against
`pyddp.wrap(model, [dev])` and `pyddp.wrap(model, [dev, dev])` (2 replicas
sharing the GPU, each with half the batch: the same GPU work as plain), and
"2 copies": those 2 replicas written by hand without pyddp (TwoCopies), so
that wrap x2 minus 2 copies is pyddp's own share of the step; eager,
compiled and captured (the whole step, optimizer included, captured once into
a CUDA graph with torch.cuda.graph after eager warm-up steps on a side
stream, then replayed: docs/gpus.md, "Captured steps"), interleaved. Per
variant: the step time (CUDA-synchronized wall time per step), the host time
(until the last step's Python returned, before the synchronize: what the
host spends launching a step) and the GPU busy time (the sum of kernel times
per step, from torch.profiler). A step whose host time is close to its step
time while the GPU is busy for much less is host-bound; the host time per
phase (forward with the loss, backward, optimizer step) shows where it goes. Then an equivalence
check: 5 AdamW steps in float32 (TF32 off), plain against 2 replicas, their
relative parameter difference.

The models are issue 44's: an MLP 1024x6 (batch 256, float32) and a 6-layer
transformer (d 768, 12 heads, vocabulary 8192, 16 x 256 tokens, bfloat16
autocast), AdamW. On a machine without a GPU, `--device cpu --quick` runs
the same machinery at toy sizes (the GPU busy column is then empty): that is
what CI checks; the figures mean something only on a GPU.

    python bench/gpu_step.py [--device cuda:0] [--models mlp,transformer]
        [--modes eager,compiled,captured] [--rounds 8] [--steps 5] [--quick] [--profile]

On the CPU, `--device cpu --quick --models mlp --rounds 30 --steps 10`
times the toy MLP, whose step is host-bound as a GPU step of these models is:
the phases and pyddp's share there are the host work the GPU step pays.

Part of bench/gpu_check.sh (the one-command GPU check). Results:
bench/results/gpu_step.json unless --out."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from _common import DecoderLM, header, parser, rotated, summary, table, write_results
from torch import nn

import pyddp

Step = Callable[..., None]
VARIANTS = ["plain", "2 copies", "wrap x1", "wrap x2"]
PHASES = ["forward", "backward", "optimizer"]


def build(name: str, quick: bool) -> Tuple[nn.Module, torch.Tensor, torch.Tensor, bool]:
    """(model, inputs, targets, autocast) at issue 44's sizes (toy ones if quick)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        width, depth, batch = (64, 3, 16) if quick else (1024, 6, 256)
        layers: List[nn.Module] = []
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(width, 10))
        x = torch.randn(batch, width, generator=g)
        return model, x, torch.randint(10, (batch,), generator=g), False
    vocab, d, heads, depth, rows, seq = (
        (256, 32, 4, 2, 4, 16) if quick else (8192, 768, 12, 6, 16, 256)
    )
    model = DecoderLM(vocab, d, heads, depth, seq)
    tokens = torch.randint(vocab, (rows, seq + 1), generator=g)
    return model, tokens[:, :-1], tokens[:, 1:], True


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


def make_step(
    variant: str, name: str, mode: str, device: torch.device, quick: bool, lr: float = 1e-4
) -> Tuple[Step, Any]:
    """A training step of `variant` (one of VARIANTS) in `mode` ("eager",
    "compiled", "captured": a CUDA graph's replay) and what to close after.
    The step takes an optional list to which it appends its phases' host
    clock readings (start, forward and loss done, backward done, optimizer
    done); a replay appends nothing."""
    model, x, y, autocast = build(name, quick)
    model, x, y = model.to(device), x.to(device), y.to(device)
    cast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if autocast and device.type == "cuda"
        else contextlib.nullcontext()
    )
    captured = mode == "captured"  # (AdamW's step must be capturable then)
    dm = None
    if variant == "plain":
        run = torch.compile(model) if mode == "compiled" else model
        opt = torch.optim.AdamW(model.parameters(), lr=lr, capturable=captured)
    elif variant == "2 copies":
        run, opt = two_copies(model, mode == "compiled", lr, captured)
    else:
        dm = pyddp.wrap(model, [str(device)] * (2 if variant == "wrap x2" else 1))
        if mode == "compiled":
            dm.compile()
        run, opt = dm, dm.optimizer(torch.optim.AdamW, lr=lr, capturable=captured)

    def step(marks: Optional[List[Tuple[float, ...]]] = None) -> None:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with cast:
            loss = loss_of(run(x), y)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        opt.step()
        if marks is not None:
            marks.append((start, forward, backward, time.perf_counter()))

    return (capture(step, device) if captured else step), dm


class TwoCopies:
    """Two replicas sharing one device written by hand, without pyddp: two
    copies of the model, each on half the batch, their outputs concatenated
    for one loss; after backward the second copy's gradients are added to
    the first's (the loss is the whole batch's mean, so each copy holds its
    half's share), one AdamW step on the first, then its parameters copied
    to the second (one foreach op each). The host work every 2-replica step
    needs; "wrap x2" above it is pyddp's own share."""

    def __init__(self, model: nn.Module, compiled: bool, lr: float, capturable: bool):
        import copy

        self.copies = [model, copy.deepcopy(model)]
        self.runs = [torch.compile(m) if compiled else m for m in self.copies]
        self.params = [list(m.parameters()) for m in self.copies]
        self.opt = torch.optim.AdamW(self.params[0], lr=lr, capturable=capturable)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        halves = x.chunk(2)
        return torch.cat([run(h) for run, h in zip(self.runs, halves)])

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)
        for p in self.params[1]:
            p.grad = None

    def step(self) -> None:
        first, second = self.params
        with torch.no_grad():
            torch._foreach_add_([p.grad for p in first], [p.grad for p in second])
            self.opt.step()
            torch._foreach_copy_(second, first)


def two_copies(model: nn.Module, compiled: bool, lr: float, capturable: bool) -> Tuple[Any, Any]:
    copies = TwoCopies(model, compiled, lr, capturable)
    return copies, copies


def capture(step: Step, device: torch.device) -> Step:
    """torch's recipe: eager warm-up steps on a side stream (pyddp lays its
    buckets out again after the first synced backward), then `step` captured
    once; returns the replay. The replay keeps `step` (and with it the model,
    the optimizer and the static inputs the graph reads and writes) alive:
    memory freed under a graph is handed to the next allocation while every
    replay still writes it (on an H200, a captured model's parameters freed
    this way overwrote the next model's targets)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    def replay(marks: Any = None) -> None:
        graph.replay()

    replay.keep = step  # type: ignore[attr-defined]
    return replay


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_busy_ms(step: Step, device: torch.device, steps: int) -> Optional[float]:
    """Kernel time per step (torch.profiler's device events), or None off GPUs."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync(device)
    total_us = sum(
        e.self_device_time_total for e in prof.key_averages() if e.self_device_time_total > 0
    )
    return total_us / 1000.0 / steps


@contextlib.contextmanager
def no_tf32() -> Iterator[None]:
    """float32 matrix products in float32 (TF32 off) inside, as it was after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def equivalence(name: str, device: torch.device, quick: bool, steps: int = 5) -> float:
    """Relative parameter difference (the norm of the difference over the
    norm of plain's parameters) after `steps` float32 AdamW steps (TF32
    off, no autocast): plain against 2 replicas sharing `device`."""
    with no_tf32():
        ref, x, y, _ = build(name, quick)
        model, _, _, _ = build(name, quick)
        ref, model, x, y = ref.to(device), model.to(device), x.to(device), y.to(device)
        dm = pyddp.wrap(model, [str(device)] * 2)
        opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        for _ in range(steps):
            loss_of(dm(x), y).backward()
            opt.step()
            opt.zero_grad()
            loss_of(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        # Over all parameters at once: per parameter, attention's key bias
        # (whose gradient is zero but for rounding) would dominate, as Adam
        # turns the sign of rounding noise into a full step.
        diff = relative_difference(dm.module, ref)
        dm.close()
        return diff


def relative_difference(model: nn.Module, ref: nn.Module) -> float:
    """|model - ref| / |ref| over all parameters at once (float64 sums)."""
    pairs = list(zip(model.parameters(), ref.parameters()))
    with torch.no_grad():
        diff = sum(float((p - q).double().square().sum()) for p, q in pairs) ** 0.5
        norm = sum(float(q.double().square().sum()) for _, q in pairs) ** 0.5
    return diff / norm


def captured_equivalence(
    name: str, device: torch.device, quick: bool, steps: int = 5
) -> Dict[str, Any]:
    """Relative parameter difference after 3 eager warm-up steps and `steps`
    replays of the captured step, against the same steps run eagerly on a
    copy (2 replicas sharing `device`, float32, TF32 off, AdamW capturable in
    both): the captured step is the eager one with the host taken out. And
    the same eager steps run twice ("eager_vs_eager"): the floor that
    nondeterministic kernels (atomics in a backward) set. Then both again
    under torch.use_deterministic_algorithms (warn only) with attention's
    math kernel ("deterministic"), naming the operations torch warned
    about: a difference that vanishes there came from such kernels, not
    from the capture."""
    got: Dict[str, Any] = _captured_vs_eager(name, device, quick, steps)
    got["captured"] = device.type == "cuda"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with deterministic():
                got["deterministic"] = _captured_vs_eager(name, device, quick, steps)
        except Exception as e:  # a deterministic kernel that cannot be captured, say
            got["deterministic"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    got["deterministic"]["nondeterministic_ops"] = sorted(
        {str(w.message).splitlines()[0][:160] for w in caught if "determinis" in str(w.message)}
    )
    return got


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """torch's deterministic algorithms (warning where an operation has
    none) and the math attention kernel, as they were after."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    saved = (
        torch.are_deterministic_algorithms_enabled(),
        (torch.is_deterministic_algorithms_warn_only_enabled()),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


def _captured_vs_eager(name: str, device: torch.device, quick: bool, steps: int) -> Dict[str, Any]:
    with no_tf32():
        models = []
        for replay in (False, False, True):
            model, x, y, _ = build(name, quick)
            model, x, y = model.to(device), x.to(device), y.to(device)
            dm = pyddp.wrap(model, [str(device)] * 2)
            on_gpu = device.type == "cuda"
            opt = dm.optimizer(torch.optim.AdamW, lr=1e-3, capturable=on_gpu)

            def step(dm=dm, opt=opt, x=x, y=y) -> None:
                opt.zero_grad(set_to_none=True)
                loss_of(dm(x), y).backward()
                opt.step()

            if replay and on_gpu:
                run = capture(step, device)  # warm-up (3 steps) + capture (none)
            else:  # (off GPUs, --quick: the same steps, uncaptured)
                for _ in range(3):
                    step()
                run = step
            for _ in range(steps):
                run()
            sync(device)
            models.append((dm, run))
        (eager, _), (again, _), (replayed, _) = models
        got = {
            "captured_vs_eager": relative_difference(replayed.module, eager.module),
            "eager_vs_eager": relative_difference(again.module, eager.module),
        }
        for dm, _ in models:
            dm.close()
        return got


def measure(
    name: str, mode: str, device: torch.device, rounds: int, steps: int, quick: bool
) -> Dict[str, Dict[str, Any]]:
    built = {v: make_step(v, name, mode, device, quick) for v in VARIANTS}
    wall: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    host: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    marks: Dict[str, List[Tuple[float, ...]]] = {v: [] for v in VARIANTS}
    # Warm-up: compilation, the allocator, pyddp's bucket rebuild, and
    # run_replicas="auto" settling (it times both ways over its first 21
    # calls of each kind), so the rounds time what it chose.
    warm = 3 if quick else 25
    for v in VARIANTS:
        for _ in range(warm):
            built[v][0]()
        if built[v][1] is not None:
            built[v][1].reset_stats()  # the means below: the timed rounds' only
    for r in range(rounds):
        for v in rotated(VARIANTS, r):
            step = built[v][0]
            step()  # untimed: this variant's memory back in cache
            sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                step(marks[v])
            launched = time.perf_counter()
            sync(device)
            done = time.perf_counter()
            wall[v].append((done - start) / steps * 1e3)
            host[v].append((launched - start) / steps * 1e3)
    out: Dict[str, Dict[str, Any]] = {}
    plain = summary(wall["plain"])["median"]
    for v in VARIANTS:
        busy = gpu_busy_ms(built[v][0], device, steps)
        w = summary(wall[v])
        out[v] = {
            "step_ms": w,
            "host_ms": summary(host[v]),
            "gpu_busy_ms": busy,
            "vs_plain": w["median"] / plain,
            # Host time per phase, median over every timed step (none when
            # replayed): where a host-bound step's time goes.
            "phase_host_ms": {
                phase: statistics.median((m[k + 1] - m[k]) * 1e3 for m in marks[v])
                for k, phase in enumerate(PHASES)
            }
            if marks[v]
            else None,
        }
        if built[v][1] is not None:
            out[v]["run_replicas"] = built[v][1].run_replicas()
            # The host's wait at the end of backward for the last reductions
            # (engine.finish; none with one replica): part of the backward phase.
            mean = built[v][1].stats()["mean"]
            out[v]["finish_wait_ms"] = mean["finish_wait_s"] * 1e3 if mean else None
            built[v][1].close()
    # pyddp's own share of a step of 2 replicas: what it costs above the
    # same two replicas written by hand, as a fraction of the plain step.
    out["wrap x2"]["pyddp_share"] = (
        summary(wall["wrap x2"])["median"] - summary(wall["2 copies"])["median"]
    ) / plain
    return out


def profile(name: str, device: torch.device, quick: bool) -> List[str]:
    """cProfile of eager steps of 2 replicas (after warm-up; 100, or 20 if
    quick), on the caller's thread only (a replica's worker thread is not
    profiled): the functions with the most own time, as pstats prints them.
    Where a host-bound step's Python goes, on the machine that runs it."""
    steps = 20 if quick else 100
    import cProfile
    import io
    import pstats

    step, dm = make_step("wrap x2", name, "eager", device, quick)
    for _ in range(3 if quick else 25):
        step()
    sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    sync(device)
    prof.disable()
    dm.close()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    body = text.getvalue().split("\n")
    start = next(i for i, line in enumerate(body) if line.lstrip().startswith("ncalls"))
    return [f"{steps} steps of wrap x2, eager ({name})"] + [ln for ln in body[start:] if ln.strip()]


def phase_rows(results: Dict[str, Any]) -> List[List[str]]:
    """Per model, eager or compiled: each variant's host ms per phase."""
    rows = []
    for key, got in results.items():
        if not isinstance(got, dict) or "plain" not in got:
            continue
        for v in VARIANTS:
            phases = got[v].get("phase_host_ms")
            if phases:
                wait = got[v].get("finish_wait_ms")
                rows.append(
                    [
                        *key.split(" ", 1),
                        v,
                        *(f"{phases[p]:.3f}" for p in PHASES),
                        "-" if wait is None else f"{wait:.3f}",
                    ]
                )
    return rows


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default="mlp,transformer")
    p.add_argument(
        "--modes",
        default=None,
        help="of eager,compiled,captured (default: all on a GPU; eager with --quick)",
    )
    p.add_argument(
        "--profile", action="store_true", help="cProfile 2 replicas' eager step of each model"
    )
    p.add_argument("--rounds", type=int, default=None, help="default 8 (2 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="default 5 (2 with --quick)")
    args = p.parse_args()
    # cuBLAS's deterministic workspace setting, which torch's deterministic
    # mode asks for (captured_equivalence): read when cuBLAS starts, so set
    # before the first product; the same for every variant timed.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device(args.device)
    modes = (args.modes or ("eager" if args.quick else "eager,compiled,captured")).split(",")
    if "captured" in modes and device.type != "cuda":
        p.error("--modes captured needs a CUDA device (it captures a CUDA graph)")
    rounds = args.rounds or (2 if args.quick else 8)
    steps = args.steps or (2 if args.quick else 5)
    print(header())
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.version.cuda} CUDA")
    results: Dict[str, Any] = {}
    heads = ["model", "mode", "variant", "step ms", "p10-p90", "host ms", "GPU busy ms"]
    rows: List[List[str]] = []
    names = args.models.split(",")
    # Compiled last, and each row printed as it is measured: a check cut off
    # by its time limit (compilation is the slow part) keeps what it had.
    order = [(n, m) for m in modes if m != "compiled" for n in names]
    order += [(n, "compiled") for n in names if "compiled" in modes]
    for name, mode in order:
        try:
            got = measure(name, mode, device, rounds, steps, args.quick)
        except Exception as e:  # a mode that fails leaves the others' figures
            results[f"{name} {mode}"] = {"error": f"{type(e).__name__}: {e}"}
            rows.append([name, mode, "failed", f"{type(e).__name__}: {e}"[:60], "", "", "", ""])
            print("measured:", " | ".join(rows[-1]), flush=True)
            continue
        results[f"{name} {mode}"] = got
        for v, m in got.items():
            busy = m["gpu_busy_ms"]
            rows.append(
                [
                    name,
                    mode,
                    v,
                    f"{m['step_ms']['median']:.2f}",
                    f"{m['step_ms']['p10']:.2f}-{m['step_ms']['p90']:.2f}",
                    f"{m['host_ms']['median']:.2f}",
                    "-" if busy is None else f"{busy:.2f}",
                    f"{m['vs_plain']:.2f}x",
                ]
            )
            print("measured:", " | ".join(rows[-1]), flush=True)
        if f"{name} equivalence" not in results:
            results[f"{name} equivalence"] = diff = equivalence(name, device, args.quick)
            print(f"measured: {name} equivalence {diff:.2e}", flush=True)
        # Off GPUs (--quick, CI's dry run): the same comparison uncaptured,
        # so its machinery (the deterministic mode included) runs.
        dry = device.type != "cuda" and f"{name} captured equivalence" not in results
        if mode == "captured" or dry:
            try:
                got = captured_equivalence(name, device, args.quick)
            except Exception as e:
                got = f"{type(e).__name__}: {e}"
            results[f"{name} captured equivalence"] = got
            print(f"measured: {name} captured vs eager {_shown(got)}", flush=True)
    print(table(heads + ["vs plain"], rows))
    print("host ms per phase (medians over the timed steps; a captured step has none):")
    print(table(["model", "mode", "variant", *PHASES, "finish wait"], phase_rows(results)))
    for key, got in results.items():
        if isinstance(got, dict) and "wrap x2" in got:
            print(
                f"{key}: pyddp's own share of a 2-replica step (wrap x2 - 2 copies, "
                f"over the plain step): {got['wrap x2']['pyddp_share']:+.2f}"
            )
    if args.profile:
        for name in names:
            try:
                lines = profile(name, device, args.quick)
            except Exception as e:
                lines = [f"profile of {name} failed: {type(e).__name__}: {e}"]
            results[f"{name} profile"] = lines
            print("\n".join(lines))
    for name in names:
        diff = results.get(f"{name} equivalence")  # (none where every mode failed)
        if diff is not None:
            print(f"{name}: 2 replicas vs plain after 5 float32 AdamW steps: {diff:.2e} (relative)")
        got = results.get(f"{name} captured equivalence")
        if got is not None:
            print(
                f"{name}: captured vs eager, 2 replicas, 3 + 5 float32 AdamW steps: {_shown(got)}"
            )
    print(
        "host ms: until the last step's Python returned (before synchronizing); a step whose "
        "host ms is near its step ms, with the GPU busy for much less, is host-bound."
    )
    write_results("gpu_step", args, results)


def _shown(got: Any) -> str:
    """A captured equivalence as printed: the error, or the differences."""
    if isinstance(got, str):
        return got
    text = (
        ("" if got.get("captured") else "(no GPU: uncaptured) ")
        + f"{got['captured_vs_eager']:.2e} relative (eager steps run twice: "
        + f"{got['eager_vs_eager']:.2e})"
    )
    det = got.get("deterministic")
    if det is None:
        return text
    if "error" in det:
        return f"{text}; deterministic: {det['error']}"
    ops = "; ".join(det["nondeterministic_ops"]) or "none"
    return (
        f"{text}; deterministic algorithms, math attention: {det['captured_vs_eager']:.2e} "
        f"(twice: {det['eager_vs_eager']:.2e}; torch warned about: {ops})"
    )


if __name__ == "__main__":
    main()
