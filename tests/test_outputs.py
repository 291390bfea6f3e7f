"""What the gathered output of a wrapped model holds: a loss the model
computes itself (HF style), keyword inputs to dmodel.loss, and non-tensor
values, which one replica cannot speak for."""

from __future__ import annotations

import copy
import warnings
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
    with dm, pytest.raises(TypeError, match=r"output\[1\] is of type .*no replica's value is the"):
        dm(torch.randn(8, 2))


def test_unjoinable_output_message_is_complete_and_names_the_remedy():
    dm = pyddp.wrap(Returns(lambda x: SimpleNamespace(n=x.shape[0])), ["cpu", "cpu"])
    with dm, pytest.raises(TypeError) as info:
        dm(torch.randn(5, 2))
    text = str(info.value)
    assert "output[1] is of type types.SimpleNamespace" in text
    assert "<SimpleNamespace>, <SimpleNamespace>" in text
    assert "register_pytree_node" in text and "use_cache=False" in text
    assert text.endswith(".") and text.count("(") == text.count(")")


def test_one_replica_returns_any_value_as_it_is():
    # One replica computed on the whole batch: its value is the batch's.
    marker = SimpleNamespace(n=1)
    with pyddp.wrap(Returns(lambda x: marker), ["cpu"]) as dm:
        assert dm(torch.randn(4, 2))[1] is marker


class Pair:
    """A user type registered with torch's pytree: pyddp joins its tensors."""

    def __init__(self, a, b, tag):
        self.a, self.b, self.tag = a, b, tag


torch.utils._pytree.register_pytree_node(
    Pair, lambda p: ([p.a, p.b], p.tag), lambda children, tag: Pair(*children, tag)
)


class KVCache:
    """Shaped like a model's key/value cache (its name ends in "Cache"): batch-
    major tensors in plain objects, with attributes describing it."""

    def __init__(self, layers):
        self.layers = layers
        self.dtype = torch.float32
        self.seen_tokens = 3


class Layer:
    def __init__(self, keys):
        self.keys = keys
        self.initialized = True


def test_pytree_types_and_caches_are_joined_like_any_output():
    torch.manual_seed(0)
    model = Returns(lambda x: (Pair(x * 2, x.sum(1), "t"), KVCache([Layer(x + 1), Layer(x - 1)])))
    x = torch.randn(5, 2)
    with pyddp.wrap(copy.deepcopy(model), ["cpu", "cpu"]) as dm:
        out, (pair, cache) = dm(x)
    ref, (want_pair, want_cache) = model(x)
    torch.testing.assert_close(out, ref)
    assert isinstance(pair, Pair) and pair.tag == "t"
    torch.testing.assert_close(pair.a, want_pair.a)
    torch.testing.assert_close(pair.b, want_pair.b)
    assert isinstance(cache, KVCache) and cache.seen_tokens == 3 and cache.dtype is torch.float32
    for got, want in zip(cache.layers, want_cache.layers):
        assert isinstance(got, Layer) and got.initialized
        torch.testing.assert_close(got.keys, want.keys)


def test_cache_attributes_that_differ_between_replicas_are_refused():
    model = Returns(lambda x: _with_length(KVCache([Layer(x)]), x.shape[0]))  # 3 and 2
    with pyddp.wrap(model, ["cpu", "cpu"]) as dm, pytest.raises(TypeError, match="seen_tokens"):
        dm(torch.randn(5, 2))


def _with_length(cache, n):
    cache.seen_tokens = n
    return cache


class Filling(nn.Module):
    """Fills the cache passed to it in place, as transformers' DynamicCache
    fills (layer.keys grows along the sequence); returns it or not."""

    def __init__(self, returns=True):
        super().__init__()
        self.lin, self.returns = nn.Linear(2, 2), returns

    def forward(self, x, cache):
        layer = cache.layers[0]
        k = self.lin(x).unsqueeze(1)  # (rows, 1 step, 2)
        layer.keys = k if layer.keys is None else torch.cat([layer.keys, k], 1)
        cache.seen_tokens = layer.keys.shape[1]
        out = self.lin(x) + layer.keys.sum(1)
        return (out, cache) if self.returns else out


@pytest.mark.parametrize("replicas", [2, 3])
def test_a_cache_passed_in_is_filled_as_on_one_device(replicas):
    # A probe: the caller's cache stayed empty (each replica filled its own
    # shard's copy), so the next step ran without the prefix, silently.
    torch.manual_seed(0)
    model = Filling()
    xs = [torch.randn(7, 2) for _ in range(3)]
    mine, want = KVCache([Layer(None)]), KVCache([Layer(None)])
    ref = copy.deepcopy(model)
    with pyddp.wrap(model, ["cpu"] * replicas) as dm, torch.no_grad():
        for x in xs:
            out, returned = dm(x, mine)
            ref_out, _ = ref(x, want)
            torch.testing.assert_close(out, ref_out)  # each step saw the whole prefix
            assert mine.seen_tokens == want.seen_tokens and returned is mine  # (as one device)
            torch.testing.assert_close(mine.layers[0].keys, want.layers[0].keys)
    assert mine.layers[0].keys.shape == (7, 3, 2)
    with pyddp.wrap(Twice(), ["cpu"] * replicas) as dm:  # (a review: one of two was not)
        out = dm(torch.randn(7, 2), mine)
    assert out[1] is mine and out[2]["again"] is mine


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x, cache):
        cache.layers[0].keys = cache.layers[0].keys + 1  # (filled: returned twice)
        return self.lin(x), cache, {"again": cache}


def test_a_cache_filled_in_place_and_not_returned_is_refused():
    dm = pyddp.wrap(Filling(returns=False), ["cpu", "cpu"])
    with dm, pytest.raises(RuntimeError, match="changed the KVCache passed to it in place"):
        dm(torch.randn(5, 2), KVCache([Layer(None)]))
    # Preallocated, written at a position it advances (a static cache): its
    # shapes stay, its position moves (a review: neither refused nor refilled).
    dm = pyddp.wrap(Positioned(), ["cpu", "cpu"])
    with dm, pytest.raises(RuntimeError, match="changed the PositionCache passed to it"):
        dm(torch.randn(5, 2), PositionCache(5))


class PositionCache:
    def __init__(self, rows):
        self.buffer, self.position = torch.zeros(rows, 4, 2), 0


class Positioned(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x, cache):
        cache.buffer[:, cache.position] = self.lin(x).detach()
        cache.position += 1
        return self.lin(x) + cache.buffer.sum(1)


def test_an_empty_selection_on_one_replica_joins():
    # A review: a selection of no row returned as an empty 1-D tensor (as
    # `h.new_zeros(0)`), which torch.cat passes over, was refused.
    x = torch.tensor([[1.0, 0], [2, 0], [3, 0], [-4, 0], [-5, 0], [-6, 0]])
    pick = Returns(lambda x: x[x[:, 0] > 0] if (x[:, 0] > 0).any() else x.new_zeros(0))
    with pyddp.wrap(pick, ["cpu", "cpu"]) as dm:
        torch.testing.assert_close(dm(x)[1], x[:3])


def test_an_in_batch_similarity_is_refused_by_name():
    # A probe: CLIP's logits_per_image on 7 rows over 2 replicas ((4, 4) and
    # (3, 3)) failed in torch.cat, naming neither the output nor why.
    model = Returns(lambda x: {"sim": x @ x.T})
    with pyddp.wrap(model, ["cpu", "cpu"]) as dm:
        match = r"output\[1\]\['sim'\] has shapes \(4, 4\), \(3, 3\)"
        with pytest.raises(RuntimeError, match=match):
            dm(torch.randn(7, 2))


def test_an_output_that_is_not_batch_major_is_warned_about():
    # A probe: x.mean(0) on 7 rows over 3 replicas came back (6,) for one
    # device's (2,), silently. Rows that vary with the data (a selection:
    # 3, 1 and 0 rows here) join as one device's, without a warning.
    x = torch.tensor([[1.0, 0], [2, 0], [3, 0], [4, 0], [-5, 0], [-6, 0], [-7, 0]])
    statistic = pyddp.wrap(Returns(lambda x: (x.mean(0), x[x[:, 0] > 0])), ["cpu"] * 3)
    match = r"output\[1\]\[0\] has shapes \(2,\), \(2,\)"
    with statistic as dm, pytest.warns(UserWarning, match=match) as caught:
        out = dm(x)
        for _ in range(3):  # once: a review saw it at every step where a library reset
            with warnings.catch_warnings():  # warnings' registry (as catch_warnings does)
                dm(x)
    assert out[1][0].shape == (6,) and len(caught) == 1  # (as it was: warned)
    assert caught[0].filename == __file__  # (the caller's line, not pyddp's)
    other = pyddp.wrap(Returns(lambda x: (x.std(0), x)), ["cpu"] * 3)  # (its own: a review)
    with other as dm, pytest.warns(UserWarning, match=match):
        dm(x)
    selection = pyddp.wrap(Returns(lambda x: x[x[:, 0] > 0]), ["cpu"] * 3)
    with selection as dm, warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(dm(x)[1], x[:4])


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


@pytest.mark.parametrize("replicas", [1, 2])
def test_torch_compile_of_the_wrapped_model_compiles_each_replica(replicas):
    # torch.compile(dmodel), as torch.compile(DDP(model)) is written (and
    # Lightning Fabric's setup of a compiled model does): pyddp's forward
    # stays out of dynamo (across processes it broke inside pyddp with a
    # RecursionError), and each replica runs through the compile's settings.
    from torch._dynamo.eval_frame import OptimizedModule

    graphs = []

    def backend(gm, inputs):  # a new one per test: dynamo's cache cannot hide a compile
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    with pyddp.wrap(model, ["cpu"] * replicas) as dm:
        compiled = torch.compile(dm, backend=backend)
        for _ in range(2):
            x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
            F.cross_entropy(compiled(x), y).backward()
            F.cross_entropy(ref(x), y).backward()
            for g, w in zip(grads(dm.module), grads(ref)):
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
        assert all(isinstance(c, OptimizedModule) for c in dm._callables)
        assert all(c._orig_mod is r for c, r in zip(dm._callables, dm.replicas))
        assert all(c.dynamo_ctx is compiled.dynamo_ctx for c in dm._callables)
        assert dm(x).shape == (6, 3)  # the wrapper itself, called directly, too
    assert graphs and all(isinstance(g, torch.fx.GraphModule) for g in graphs)


@pytest.mark.parametrize("run_replicas", ["threads", "in_turn"])
def test_a_compiled_function_stepping_pyddps_optimizer_steps_every_replica_eagerly(run_replicas):
    # torch's "compile the optimizer step" recipe on dmodel.optimizer: traced,
    # replica 0's step ran compiled on the calling thread and the others'
    # eagerly on their workers; with inductor the replicas drifted apart
    # (a probe: 2.1e-6 after 200 Adam steps). The step is a graph break now.
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    with pyddp.wrap(model, ["cpu", "cpu"], run_replicas=run_replicas) as dm:
        opt = dm.optimizer(torch.optim.Adam, lr=0.01)
        step = torch.compile(opt.step, backend=backend)
        for _ in range(3):
            x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
            F.cross_entropy(dm(x), y).backward()
            step()
            opt.zero_grad()
        assert graphs == []  # nothing of the step was traced
        for p, q in zip(*(r.parameters() for r in dm.replicas)):
            assert torch.equal(p, q)
        assert opt.state[model[0].weight]["step"] == 3


class _SequenceFirst(nn.Module):
    """A sequence-first layer (batch_first=False), fed (sequence, batch,
    features) as given, or `transposed` from (batch, sequence, features)."""

    def __init__(self, layer: nn.Module, transposed: bool = False) -> None:
        super().__init__()
        self.layer, self.transposed = layer, transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(0, 1) if self.transposed else x
        out = self.layer(x)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(0, 1) if self.transposed else out


def _sequence_first_layers():
    return {
        "LSTM": nn.LSTM(4, 5),
        "GRU": nn.GRU(4, 5, num_layers=2),
        "TransformerEncoderLayer": nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0),
        "MultiheadAttention": _SelfAttention(),
    }


class _SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x)[0]


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("name", ["LSTM", "GRU", "TransformerEncoderLayer", "MultiheadAttention"])
def test_a_sequence_first_input_split_along_its_sequence_is_refused(name, grad):
    # Found by a probe: a (sequence, batch, features) input to a layer with
    # batch_first=False was split along the sequence, each replica running a
    # piece of every sequence: outputs of the right shape, 0.20 (LSTM) and
    # 0.41 (TransformerEncoderLayer) off one device, silently, in training
    # and evaluation alike.
    torch.manual_seed(0)
    dm = pyddp.wrap(_SequenceFirst(_sequence_first_layers()[name]), ["cpu", "cpu"])
    x = torch.randn(10, 3, 4)  # 10 steps of a batch of 3
    with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match="batch_first=False"):
        dm(x)
    with pytest.raises(RuntimeError, match=r"\(5, 3, 4\).*5 of 10 rows"):
        dm.loss(lambda out, y: F.mse_loss(out, y), x, torch.zeros(10, 3, 5 if "U" in name else 4))
    dm.module(x)  # the model alone is the user's to run as they like
    copy.deepcopy(dm.module)(x)  # (the guard copies as nothing)
    dm.close()


@pytest.mark.parametrize("name", ["LSTM", "GRU", "TransformerEncoderLayer", "MultiheadAttention"])
def test_a_batch_first_input_transposed_for_a_sequence_first_layer_is_split_by_rows(name):
    # The same layers fed batch first and transposed inside forward: split
    # by rows, as one device (float32 rounding: 1e-6).
    torch.manual_seed(0)
    model = _SequenceFirst(_sequence_first_layers()[name], transposed=True)
    ref = copy.deepcopy(model)
    dm = pyddp.wrap(model, ["cpu", "cpu"])
    x = torch.randn(6, 10, 4)  # a batch of 6 sequences of 10 steps
    torch.testing.assert_close(dm(x), ref(x), atol=1e-6, rtol=1e-5)
    dm(x).sum().backward()
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)
    dm.close()
