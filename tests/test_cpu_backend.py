"""In-process CPU all-reduce: closed-form values over a grid of replica
counts x sizes x dtypes (replica r fills r+1, so everyone must read N(N+1)/2)."""

import pytest
import torch

import pyddp

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# 0, 1, odd, and larger than a bucket and than the parallel threshold.
SIZES = [0, 1, 7, 1001, (1 << 20) + 3]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_closed_form(n, size, dtype):
    tensors = [torch.full((size,), float(r + 1), dtype=dtype) for r in range(n)]
    pyddp.all_reduce(tensors, op="sum")
    want = torch.full((size,), n * (n + 1) / 2, dtype=dtype)
    for t in tensors:
        assert torch.equal(t, want)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_avg_closed_form(n, dtype):
    tensors = [torch.full((1001,), float(r + 1), dtype=dtype) for r in range(n)]
    pyddp.all_reduce(tensors, op="avg")
    want = torch.full((1001,), (n + 1) / 2, dtype=dtype)
    for t in tensors:
        assert torch.equal(t, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_accumulates_in_float32(dtype):
    # 16-bit partial sums would lose these: fp16 overflows at 65504 (60000 +
    # 60000), and bf16 cannot hold 256 + 1 exactly. Accumulating in float32 and
    # averaging gives the exact mean back.
    big = 60000.0 if dtype == torch.float16 else 256.0
    a = torch.full((5,), big, dtype=dtype)
    b = torch.full((5,), big, dtype=dtype)
    pyddp.all_reduce([a, b], op="avg")
    assert torch.equal(a, torch.full((5,), big, dtype=dtype))
    vals = [torch.full((3,), v, dtype=dtype) for v in (256.0, 1.0, 1.0)]
    pyddp.all_reduce(vals, op="sum")
    assert vals[0][0].item() == 258.0  # 256 + 1 + 1 in fp32, representable in both


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_values_match_torch_sum(dtype):
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(3000, generator=g).to(dtype) for _ in range(3)]
    # Summed in replica order in the accumulation type (float32 for 16-bit).
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    want = tensors[0].to(acc)
    for t in tensors[1:]:
        want = want + t.to(acc)
    pyddp.all_reduce(tensors)
    assert torch.equal(tensors[0], want.to(dtype))
    assert torch.equal(tensors[1], tensors[0]) and torch.equal(tensors[2], tensors[0])


def test_special_values_propagate():
    a = torch.tensor([float("inf"), float("nan"), 1.0], dtype=torch.float16)
    b = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float16)
    pyddp.all_reduce([a, b])
    assert a[0].item() == float("inf") and torch.isnan(a[1]) and a[2].item() == 0.0


@pytest.mark.parametrize(
    "tensors, message",
    [
        ([], "empty"),
        ([torch.zeros(3), torch.zeros(4)], "tensors\\[1\\]"),
        ([torch.zeros(3), torch.zeros(3, dtype=torch.float64)], "tensors\\[1\\]"),
        ([torch.zeros(3, dtype=torch.int32)] * 1, r"not supported \(floating point only: "),
        # (meta tensors were called overlapping: they share the address 0)
        ([torch.zeros(3, device="meta"), torch.zeros(3, device="meta")], "is on meta"),
        ([torch.zeros(4, 4).t(), torch.zeros(4, 4)], "contiguous"),
    ],
)
def test_bad_arguments(tensors, message):
    with pytest.raises(ValueError, match=message):
        pyddp.all_reduce(tensors)


def test_aliased_buffers_rejected():
    t = torch.ones(4)
    with pytest.raises(ValueError, match=r"tensors\[0\] and tensors\[1\] are the same tensor"):
        pyddp.all_reduce([t, t])


@pytest.mark.parametrize(
    "views, pair",
    [
        (lambda b: [b[0:4], b[2:6]], (0, 1)),  # partial overlap: would sum wrongly
        (lambda b: [b[2:6], b[0:4]], (0, 1)),  # same, listed in the other order
        (lambda b: [b[0:4], b[4:8], b[3:7]], (0, 2)),  # the overlap is not adjacent in the list
        (lambda b: [b[0:4], b.view(2, 4)[0]], (0, 1)),  # same bytes, another view
        (lambda b: [torch.ones(4), b[0:8:2].contiguous(), b[1:5]], None),  # a copy is fine
    ],
    ids=["partial", "reversed", "not-adjacent", "same-bytes", "copy-is-fine"],
)
def test_overlapping_views_rejected(views, pair):
    buf = torch.arange(8, dtype=torch.float32)
    tensors = views(buf)
    if pair is None:
        pyddp.all_reduce(tensors)
        return
    i, j = pair
    with pytest.raises(ValueError, match=rf"tensors\[{i}\] and tensors\[{j}\] overlap in memory"):
        pyddp.all_reduce(tensors)
    assert torch.equal(buf, torch.arange(8, dtype=torch.float32))  # refused before any write


def test_disjoint_views_of_one_buffer_reduce():
    buf = torch.arange(8, dtype=torch.float32)
    pyddp.all_reduce([buf[0:4], buf[4:8]])
    assert torch.equal(buf, torch.tensor([4.0, 6, 8, 10, 4, 6, 8, 10]))


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: sparse CSR is in beta
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_rejected_as_unsupported(layout):
    sparse = torch.eye(3).to_sparse() if layout == "coo" else torch.eye(3).to_sparse_csr()
    with pytest.raises(ValueError, match=r"tensors\[1\] is torch.sparse_.*not supported.*to_dense"):
        pyddp.all_reduce([torch.eye(3), sparse])


# ------------------------------------------------ broadcast, all-gather, reduce-scatter
# Closed forms: replica r fills r+1 (plus its element index, so a block in
# the wrong place shows), over the same grid of counts, sizes and dtypes.


def _filled(n, size, dtype):
    return [
        (torch.arange(size, dtype=torch.float64) % 64 + 100 * (r + 1)).to(dtype) for r in range(n)
    ]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_all_gather_reduce_scatter_closed_form(n, size, dtype):
    for root in {0, n - 1}:
        tensors = _filled(n, size, dtype)
        want = tensors[root].clone()
        pyddp.broadcast(tensors, root=root)
        assert all(torch.equal(t, want) for t in tensors)
    tensors = _filled(n, size, dtype)
    for out in pyddp.all_gather(tensors):
        assert out.shape == (n, size)
        assert all(torch.equal(out[k], tensors[k]) for k in range(n))
    tensors = _filled(n, size * n, dtype)
    reduced = [t.clone() for t in tensors]
    pyddp.all_reduce(reduced)  # reduce-scatter is all_reduce's blocks, bit for bit
    outs = pyddp.reduce_scatter(tensors)
    for r, out in enumerate(outs):
        assert torch.equal(out, reduced[0].view(n, size)[r])
    # Closed form of the sum: sum_r (i % 64 + 100 (r + 1)), exact in every dtype here.
    if size and dtype in (torch.float32, torch.float64):
        i = torch.arange(size * n, dtype=torch.float64) % 64
        want = (n * i + 100 * n * (n + 1) / 2).to(dtype).view(n, size)
        assert all(torch.equal(out, want[r]) for r, out in enumerate(outs))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter_avg_is_all_reduce_avg_block(dtype):
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(3, 700, generator=g).to(dtype) for _ in range(3)]
    reduced = [t.clone() for t in tensors]
    pyddp.all_reduce(reduced, op="avg")
    outs = pyddp.reduce_scatter(tensors, op="avg")
    for r, out in enumerate(outs):
        assert torch.equal(out, reduced[0][r : r + 1])


def test_all_gather_and_reduce_scatter_in_place_on_the_backend():
    # NCCL's in-place layout: the smaller buffer is the rank's own block of
    # the larger; the backend must read every block before writing over it.
    from pyddp import _C

    backend = _C.CpuBackend()
    n, count = 3, (1 << 17) + 5  # large enough for the chunked path
    bigs = [torch.zeros(n * count) for _ in range(n)]
    for r, b in enumerate(bigs):
        b[r * count : (r + 1) * count] = torch.arange(count, dtype=torch.float32) + 1000 * r
    want = torch.cat([bigs[k][k * count : (k + 1) * count] for k in range(n)])
    sends = [b.data_ptr() + r * count * 4 for r, b in enumerate(bigs)]
    backend.all_gather(sends, [b.data_ptr() for b in bigs], [-1] * n, [0] * n, count, "float32")
    assert all(torch.equal(b, want) for b in bigs)
    sums = sum(bigs).clone()
    recvs = [b.data_ptr() + r * count * 4 for r, b in enumerate(bigs)]
    backend.reduce_scatter([b.data_ptr() for b in bigs], recvs, [-1] * n, [0] * n, count,
                           "float32", "sum")  # fmt: skip
    for r, b in enumerate(bigs):
        assert torch.equal(b[r * count : (r + 1) * count], sums[r * count : (r + 1) * count])


def test_collective_shapes_are_checked_by_name():
    from pyddp import _C

    backend = _C.CpuBackend()
    a, b = torch.zeros(8), torch.zeros(8)
    with pytest.raises(RuntimeError, match="root 2 is not one of the 2 ranks"):
        backend.broadcast([a.data_ptr(), b.data_ptr()], [-1, -1], [0, 0], 8, "float32", 2)
    # A send overlapping its receive buffer other than at its own block.
    big = torch.zeros(16)
    with pytest.raises(RuntimeError, match="overlap other than in place"):
        backend.all_gather([big.data_ptr() + 4, a.data_ptr()], [big.data_ptr(), b.data_ptr() - 0],
                           [-1, -1], [0, 0], 4, "float32")  # fmt: skip
    with pytest.raises(ValueError, match="multiple of the 3 replicas"):
        pyddp.reduce_scatter([torch.zeros(4)] * 1 + [torch.zeros(4), torch.zeros(4)])
    with pytest.raises(ValueError, match="root=3 is not an index"):
        pyddp.broadcast([torch.zeros(2), torch.zeros(2)], root=3)
    with pytest.raises(ValueError, match="are the same tensor"):
        pyddp.all_gather([a, a])
    with pytest.raises(ValueError, match="op='max'"):
        pyddp.reduce_scatter([torch.zeros(2), torch.zeros(2)], op="max")


@pytest.mark.parametrize("name", ["all_reduce", "broadcast", "all_gather", "reduce_scatter"])
def test_one_tensor_is_refused_not_taken_for_replicas(name):
    # torch.distributed's spelling, all_reduce(t): iterating over t would
    # take its rows for replicas ([1, 2, 3, 4] summed to [10, 10, 10, 10]).
    t = torch.tensor([1.0, 2.0, 3.0, 4.0])
    with pytest.raises(TypeError, match=rf"one tensor per replica \(pyddp.{name}\(\[t0, t1\]\)\)"):
        getattr(pyddp, name)(t)
    assert torch.equal(t, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    with pytest.raises(TypeError, match="list or tuple of tensors"):
        getattr(pyddp, name)(3)
    # A tuple and a generator of per-replica tensors still work.
    a, b = torch.ones(4), torch.full((4,), 2.0)
    getattr(pyddp, name)(x for x in (a, b))


@pytest.mark.parametrize("name", ["all_reduce", "broadcast"])
def test_in_place_collectives_tell_autograd_they_wrote(name):
    # Found (GradSync probe): the version counter stayed 0, so a tensor saved
    # for backward and reduced since gave a silently wrong gradient (12.0,
    # where the tensor's own value gives 8.0) instead of torch's error.
    w = torch.tensor([2.0], requires_grad=True)
    h = w * torch.ones(3)
    out = (h * h).sum()  # saves h for backward
    tensors = [h.detach(), torch.ones(3)] if name == "all_reduce" else [torch.ones(3), h.detach()]
    getattr(pyddp, name)(tensors)
    assert h._version == 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()
    # One tensor alone is not written: nothing to tell (found in review: a
    # loop written for N replicas, run with one, raised).
    h = w * torch.ones(3)
    out = (h * h).sum()
    getattr(pyddp, name)([h.detach()])
    out.backward()


def test_lazily_negated_views_are_refused_by_name():
    # .conj().imag reads -2 but stores +2: the backend read raw memory and
    # gave +2 (all_reduce, broadcast, all_gather alike).
    neg = torch.tensor([1 + 2j]).conj().imag
    for fn in (pyddp.all_reduce, pyddp.broadcast, pyddp.all_gather):
        with pytest.raises(ValueError, match="lazily negated .*resolve_neg"):
            fn([neg, torch.zeros(1)])
    t = [neg.resolve_neg(), torch.zeros(1)]
    pyddp.all_reduce(t)
    assert t[1].item() == -2.0
