"""Random streams of a Trainer's ranks and replicas: each rank (and each GPU
replica, which has a generator of its own) gets its own stream derived from
TrainConfig.seed, so ranks draw different dropout masks, as one device
drawing for the whole batch would; checkpoints keep every rank's state.

CPU replicas in one process share torch's one CPU generator (torch has no
per-thread generator): their draws are different numbers, but which replica
gets which depends on thread timing, so such runs are not bitwise
reproducible."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np
import torch


def stream_seed(seed: int, rank: int, replica: int = 0) -> int:
    """Seed of rank `rank`'s replica `replica`: the config's own seed for rank
    0's first (a single-device run is seeded exactly as before), independent
    streams (numpy's SeedSequence) for the others."""
    if rank == 0 and replica == 0:
        return seed
    return derived_seed(seed, rank, replica)


def derived_seed(*parts: int) -> int:
    """An independent stream's seed for `parts` (numpy's SeedSequence), in
    [0, 2**63)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1, np.uint64)[0] >> 1)


def seed_generators(seed: int, rank: int, devices: Sequence[torch.device]) -> None:
    """Seeds this rank's CPU generator and each of its GPU replicas' own."""
    torch.manual_seed(stream_seed(seed, rank))
    for replica, device in enumerate(devices):
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(stream_seed(seed, rank, replica))


def cuda_rng_states(devices: Sequence[torch.device]) -> List[torch.Tensor]:
    """The generator state of each GPU replica's device, in replica order."""
    return [torch.cuda.get_rng_state(d) for d in devices if d.type == "cuda"]


def restore_generators(saved: Dict[str, Any], rank: int, devices: Sequence[torch.device]) -> None:
    """This rank's states from a checkpoint's "rng" entry (every rank's)."""
    ranks = saved["ranks"]
    if rank >= len(ranks):  # more processes than the run had (resume_if_changed)
        seed_generators(int(torch.initial_seed()), rank, devices)
        return
    mine = ranks[rank]
    torch.set_rng_state(mine["torch"])
    cuda = [d for d in devices if d.type == "cuda"]
    for device, state in zip(cuda, mine["cuda"]):
        torch.cuda.set_rng_state(state, device)


def rng_states(devices: Sequence[torch.device]) -> tuple:
    """This process's CPU generator state and its GPU replicas' (put back by
    set_rng_states)."""
    return torch.get_rng_state(), cuda_rng_states(devices)


def set_rng_states(states: tuple, devices: Sequence[torch.device]) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    for device, state in zip([d for d in devices if d.type == "cuda"], cuda):
        torch.cuda.set_rng_state(state, device)
