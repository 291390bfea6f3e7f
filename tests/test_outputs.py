"""What the gathered output of a wrapped model holds: a loss the model
computes itself (HF style), keyword inputs to dmodel.loss, and non-tensor
values, which one replica cannot speak for."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyddp


class SelfLoss(nn.Module):
    """Returns its own mean loss when given labels, like a transformers model."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, input_ids=None, labels=None):
        logits = self.lin(input_ids)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def grads(m):
    return [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("replicas,batch", [(2, 8), (3, 7), (2, 5)])
def test_a_scalar_loss_output_is_the_full_batch_mean(replicas, batch):
    # 0-dim outputs are weighted by shard size: for a per-row mean loss this is
    # the full-batch mean exactly, on uneven shards too (7 rows = 3 + 2 + 2).
    torch.manual_seed(0)
    model = SelfLoss()
    ref = copy.deepcopy(model)
    dm = pyddp.wrap(model, ["cpu"] * replicas)
    x, y = torch.randn(batch, 4), torch.randint(0, 3, (batch,))
    out = dm(input_ids=x, labels=y)
    want = ref(input_ids=x, labels=y)
    assert out["loss"].dim() == 0
    torch.testing.assert_close(out["loss"], want["loss"], rtol=1e-6, atol=1e-7)
    out["loss"].backward()
    want["loss"].backward()
    for g, w in zip(grads(dm.module), grads(ref)):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)  # float32 reassociation
    with torch.no_grad():  # not differentiable: the same rule
        torch.testing.assert_close(dm(input_ids=x, labels=y)["loss"], want["loss"].detach())
    dm.close()


def test_loss_takes_keyword_inputs():
    torch.manual_seed(0)
    model = SelfLoss()
    ref = copy.deepcopy(model)
    x, y = torch.randn(7, 4), torch.randint(0, 3, (7,))

    def loss_fn(out, labels):
        return F.cross_entropy(out["logits"], labels)

    for n in (1, 2, 3):
        with pyddp.wrap(copy.deepcopy(model), ["cpu"] * n) as dm:
            loss = dm.loss(loss_fn, {"input_ids": x}, y)
            torch.testing.assert_close(loss, loss_fn(ref(input_ids=x), y))
            loss.backward()
            ref.zero_grad()
            loss_fn(ref(input_ids=x), y).backward()
            for g, w in zip(grads(dm.module), grads(ref)):
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
        with (
            pyddp.wrap(copy.deepcopy(model), ["cpu"] * n) as dm,
            pytest.raises(TypeError, match="str"),
        ):
            dm.loss(loss_fn, {0: x}, y)


class Returns(nn.Module):
    def __init__(self, extra):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.extra = extra

    def forward(self, x):
        return self.lin(x), self.extra(x)


@pytest.mark.parametrize(
    "extra",
    [
        lambda x: x.shape[0],  # equal on equal shards: still not the batch's
        lambda x: float(x.sum().item()),
        lambda x: {1, 2},
        lambda x: (i for i in range(2)),
        lambda x: SimpleNamespace(n=1),
        lambda x: True,
    ],
    ids=["int", "float", "set", "generator", "object", "bool"],
)
def test_non_tensor_outputs_are_refused(extra):
    dm = pyddp.wrap(Returns(extra), ["cpu", "cpu"])
    with dm, pytest.raises(TypeError, match=r"output\[1\].*not the batch's"):
        dm(torch.randn(8, 2))


def test_constant_strings_and_none_pass_through():
    with pyddp.wrap(Returns(lambda x: ("tag", None)), ["cpu", "cpu"]) as dm:
        out = dm(torch.randn(6, 2))
        assert out[1] == ("tag", None)
    dm = pyddp.wrap(Returns(lambda x: str(x.shape[0])), ["cpu", "cpu"])
    with dm, pytest.raises(TypeError, match="str"):
        dm(torch.randn(5, 2))  # "3" and "2": replicas disagree


def test_integer_scalars_are_stacked_per_replica():
    with pyddp.wrap(Returns(lambda x: (x[:, 0] > 0).sum()), ["cpu", "cpu"]) as dm:
        x = torch.tensor([[1.0, 0], [-1, 0], [1, 0], [1, 0], [-1, 0]])
        out = dm(x)
        assert out[1].tolist() == [2, 1]  # one count per replica's shard (3 + 2 rows)


def test_compile_compiles_each_replica_with_no_graph_break():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    counters.clear()
    with pyddp.wrap(model, ["cpu", "cpu"]) as dm:
        dm.compile(backend="eager")  # dynamo's tracing without code generation: fast
        F.cross_entropy(dm(x), y).backward()
        F.cross_entropy(ref(x), y).backward()
        for g, w in zip(grads(dm.module), grads(ref)):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 2  # it did compile (each replica)
