"""The selftest's checks of the -0.0 trick on real NCCL. pyddp broadcasts
device buffers as an all-reduce sum in which every rank but the root adds
-0.0 (x + -0.0 == x for every x, +0.0 and -0.0 included), so every rank gets
the root's buffer bit for bit, provided the reduction is IEEE addition. Ring
and tree kernels add in the GPUs' float units; NVLS (NVLink SHARP) adds in
the NVSwitch, whose arithmetic NVIDIA does not document. Checked here per
dtype, bitwise: signed zeros, subnormals (flushed?), NaN payloads,
infinities and ordinary values, from the first and the last rank as root.

NCCL reads NCCL_ALGO when a communicator is created, so each algorithm runs
in a child process of its own (`python -m pyddp.doctor.minus_zero`), which prints
one JSON line after MARK."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable, Dict, List, Optional

import torch

MARK = "PYDDP-MINUS-ZERO "
# dtype name -> (dtype, integer view of the same width, exponent bits, mantissa bits)
DTYPES = {
    "float32": (torch.float32, torch.int32, 8, 23),
    "float16": (torch.float16, torch.int16, 5, 10),
    "bfloat16": (torch.bfloat16, torch.int16, 8, 7),
    "float64": (torch.float64, torch.int64, 11, 52),
}
Reduce = Callable[[List[torch.Tensor]], None]  # sums in place, done when it returns
Place = Callable[[int, torch.Tensor], torch.Tensor]  # rank, host tensor -> that rank's copy


class Skipped(Exception):
    """The check cannot run on this machine (said in the selftest's table)."""


def value_classes(name: str) -> Dict[str, List[int]]:
    """The root's values by class, as unsigned bit patterns."""
    _, _, e, m = DTYPES[name]
    sign, inf, quiet = 1 << (e + m), ((1 << e) - 1) << m, 1 << (m - 1)
    one = ((1 << (e - 1)) - 1) << m
    return {
        "signed zeros": [0, sign, 0, sign],
        "subnormals": [1, (1 << m) - 1, sign | 1, sign | (quiet + 1)],
        "NaN payloads": [inf | quiet | 1, sign | inf | quiet | (quiet - 1), inf | quiet],
        "infinities": [inf, sign | inf],
        "normals": [one, sign | one | 1, 1 << m, inf - 1, sign | (inf - 1)],
    }


def _as_tensor(name: str, bits: List[int]) -> torch.Tensor:
    dtype, itype, e, m = DTYPES[name]
    width = 1 + e + m
    signed = [b - (1 << width) if b >> (width - 1) else b for b in bits]
    return torch.tensor(signed, dtype=itype).view(dtype)


def run_trick(all_reduce: Reduce, place: Place, n: int) -> Dict[str, Dict[str, str]]:
    """For each dtype and class: "ok", or the first bit pattern that came back
    changed (which rank, which root)."""
    results: Dict[str, Dict[str, str]] = {}
    for name, (dtype, itype, e, m) in DTYPES.items():
        mask = (1 << (1 + e + m)) - 1
        per_class = {}
        for cls, bits in value_classes(name).items():
            root_value = _as_tensor(name, bits)
            problem = None
            for root in sorted({0, n - 1}):
                minus_zero = torch.full_like(root_value, -0.0)
                ts = [place(r, root_value if r == root else minus_zero) for r in range(n)]
                all_reduce(ts)
                for r, t in enumerate(ts):
                    got = t.detach().cpu().view(itype)
                    changed = (got != root_value.view(itype)).nonzero()
                    if problem is None and len(changed):
                        i = int(changed[0])
                        # A NaN still NaN lost its payload only (a sum may quiet it).
                        kind = "payload" if bool(torch.isnan(got.view(dtype)[i])) else "changed"
                        problem = (
                            f"{kind} {hex(bits[i])} -> {hex(int(got[i]) & mask)} on rank {r} "
                            f"(root {root})"
                        )
            per_class[cls] = problem or "ok"
        results[name] = per_class
    return results


def child(all_reduce: Reduce, place: Place, n: int) -> None:
    """The child's work: the trick, one JSON line on stdout (or the error)."""
    try:
        out = {"results": run_trick(all_reduce, place, n)}
    except Exception as e:  # reported by the parent, which knows the algorithm
        out = {"error": f"{type(e).__name__}: {e}"}
    print(MARK + json.dumps(out), flush=True)


def check(algo: str, n: int, command: Optional[List[str]] = None, timeout: float = 300) -> str:
    """Runs the trick on n GPUs in a child with NCCL_ALGO=`algo`; raises
    AssertionError naming what changed, or Skipped when NCCL cannot run
    NVLS here. `command`: the child (default: this module on real GPUs)."""
    env = dict(os.environ, NCCL_ALGO=algo)
    env.setdefault("NCCL_DEBUG", "INFO")  # its NVLS lines say what NCCL chose
    command = command or [sys.executable, "-m", "pyddp.doctor.minus_zero", str(n)]
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    text = out.stdout + out.stderr
    said = [line.strip()[-160:] for line in text.splitlines() if "NVLS" in line][:2]
    hint = f" (NCCL said: {' | '.join(said)})" if said else ""
    lines = [line[len(MARK) :] for line in out.stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        tail = text.strip().splitlines()[-3:]
        raise AssertionError(f"the child (exit {out.returncode}) printed no result: {tail}")
    report = json.loads(lines[-1])
    if "error" in report:
        first = report["error"].splitlines()[0][:200]
        if algo.upper() == "NVLS":
            raise Skipped(
                f"NCCL_ALGO=NVLS did not run here: {first}{hint}. NVLS needs NVLink SHARP "
                "(NVSwitch systems such as H100/H200 SXM), NCCL >= 2.17 and CUDA >= 12.1"
            )
        raise AssertionError(f"NCCL_ALGO={algo}: {first}")
    found = [
        (f"{name} {cls}: {what}", what.startswith("payload"))
        for name, per_class in report["results"].items()
        for cls, what in per_class.items()
        if what != "ok"
    ]
    bad = [text for text, payload_only in found if not payload_only]
    if bad:
        raise AssertionError(f"NCCL_ALGO={algo}, not bitwise: " + "; ".join(bad) + hint)
    # A NaN that stays NaN with another payload breaks no training: said, not failed.
    notes = [text for text, _ in found]
    kept = f"; NaN payloads not kept: {'; '.join(notes)}" if notes else ""
    return (
        f"bitwise on {n} GPUs: {len(DTYPES)} dtypes x signed zeros, subnormals, NaN "
        f"payloads, infinities, normals{kept}{hint}"
    )


def main(argv: List[str]) -> int:
    """The child on real GPUs: `python -m pyddp.doctor.minus_zero N`."""
    import pyddp

    n = int(argv[0]) if argv else torch.cuda.device_count()
    devices = [f"cuda:{i}" for i in range(n)]

    def all_reduce(ts: List[torch.Tensor]) -> None:
        pyddp.all_reduce(ts)
        torch.cuda.synchronize()  # the selftest reads the results on the host

    child(all_reduce, lambda r, t: t.to(devices[r]), n)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
