"""What pyddp's check of the user's model costs before each training forward
with one replica per process (pyddp/replicas/watch.py): OneReplicaWatch.follow()
on an unchanged model, median of 7 rounds of 200 calls, in microseconds.

    python bench/one_replica_watch.py"""

from __future__ import annotations

import statistics
import time

from torch import nn

from pyddp.replicas.watch import OneReplicaWatch


def cost_us(model: nn.Module, rounds: int = 7, calls: int = 200) -> float:
    watch = OneReplicaWatch(model, [p for p in model.parameters() if p.requires_grad])
    for _ in range(calls):
        watch.follow()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            watch.follow()
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
