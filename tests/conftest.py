"""Shared test helpers: the mixed model the equivalence tests train, and
single-device reference training."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from torch import nn


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        # Tests that share a module-scoped fixture of ours (one torchrun
        # launch read by several tests) run on one pytest-xdist worker
        # (--dist loadgroup): one group per module, so the fixture runs
        # once, not once per worker. (pytest's own, such as
        # tmp_path_factory, have no baseid.)
        info = getattr(item, "_fixtureinfo", None)
        defs = [info.name2fixturedefs.get(n) for n in item.fixturenames] if info else []
        if any(d and d[-1].scope != "function" and d[-1].baseid for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


class Mixed(nn.Module):
    """Linear, Conv, Embedding and LayerNorm; `shared` is applied twice; `rare`
    is used only for samples whose first token is 0 (so on some replicas and
    in some steps only); `never` is never used."""

    def __init__(self, vocab: int = 11, dim: int = 8, classes: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.conv = nn.Conv1d(dim, dim, kernel_size=3, padding=1)
        self.norm = nn.LayerNorm(dim)
        self.shared = nn.Linear(dim, dim)
        self.rare = nn.Linear(dim, dim)
        self.never = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)

    def features(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)  # (B, T, D)
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = self.norm(torch.relu(h)).mean(dim=1)
        return torch.tanh(self.shared(torch.tanh(self.shared(h))))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.features(tokens)
        mask = tokens[:, 0] == 0
        if bool(mask.any()):
            h = torch.where(mask[:, None], self.rare(h), h)
        return self.head(h)


def exact_blocks(n: int, size: int, dtype: torch.dtype, device: str = "cpu") -> list:
    """n replicas' values for the collectives' closed forms: replica r's
    i-th value is i % 16 + 16 (r + 1), so a block in the wrong place shows,
    and every sum over up to 4 replicas is an integer under 256: exact in
    every dtype, bfloat16 included, in any order of summation."""
    i = torch.arange(size, dtype=torch.float64, device=device) % 16
    return [(i + 16 * (r + 1)).to(dtype) for r in range(n)]


def make_batches(steps: int, batch: int, seed: int = 0, vocab: int = 11, seq: int = 6):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        y = torch.randint(0, 5, (batch,), generator=g)
        out.append((x, y))
    return out


@pytest.fixture
def mixed_model():
    torch.manual_seed(0)
    return Mixed()


class SharedAcrossDepth(nn.Module):
    """An ALBERT-style layer applied `depth` times, each under checkpoint()."""

    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.inp, self.shared, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x, depth=3):
        h = self.inp(x)
        for _ in range(depth):
            h = torch.utils.checkpoint.checkpoint(self._layer, h, use_reentrant=self.reentrant)
        return self.out(h)

    def _layer(self, h):
        return torch.tanh(self.shared(h))
