"""What pyddp's check of the user's model costs before each forward with one
replica per process (pyddp/replicas/mirror.py): ReplicaMirror.follow() on an
unchanged model, median of 7 rounds of 200 calls, in microseconds.

    python bench/mirror_check.py"""

from __future__ import annotations

import statistics
import time

from torch import nn

from pyddp.replicas.mirror import ReplicaMirror


def cost_us(model: nn.Module, rounds: int = 7, calls: int = 200) -> float:
    mirror = ReplicaMirror([model], [n for n, _ in model.named_parameters()])
    for _ in range(calls):
        mirror.follow()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            mirror.follow()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    mlp = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                        nn.Linear(128, 10))  # fmt: skip
    models = {
        "MLP 128x3": mlp,
        "GPT-2 12 layers": transformers.GPT2LMHeadModel(transformers.GPT2Config()),
    }
    for name, model in models.items():
        n = sum(1 for _ in model.parameters())
        print(f"{name}: {cost_us(model):.1f} us per forward ({n} parameters)")


if __name__ == "__main__":
    main()
