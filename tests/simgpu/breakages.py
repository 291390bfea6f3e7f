"""Shows that the simulated-GPU tests bite: applies one deliberate defect at a
time to a copy of the repository, builds it into a temporary directory (the
installed pyddp is not touched), runs `pytest -m simgpu` against it, and
prints which tests failed. Every breakage must fail at least one test.

    python tests/simgpu/breakages.py            # all breakages, ~8 min each
    python tests/simgpu/breakages.py no-fence   # one
    python tests/simgpu/breakages.py no-fence --tests test_simgpu.py  # those files only
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> (file, exact text, replacement, what the defect is); a tuple of
# texts and one of replacements for a defect that changes several places.
BREAKAGES = {
    "no-wait-on-ready-events": (
        "csrc/gpu_backend.cpp",
        "for (int i = 0; i < s.used; ++i) {",
        "for (int i = 0; i < 0; ++i) {",
        "the communication stream does not wait for the producing streams' events",
    ),
    "ready-event-on-wrong-stream": (
        "pyddp/engine/hooks.py",
        "        mark(r, i, current(device))",
        "        mark(r, i, 0)",
        "the Python hook (PYDDP_HOT=0) records the ready event on the default stream, "
        "not the producing one",
    ),
    "nccl-launch-outside-group": (
        "csrc/gpu_backend.cpp",
        (
            "    PYDDP_NCCL(n.ncclGroupStart());\n    ncclResult_t launched = kNcclSuccess;",
            "    const ncclResult_t ended = n.ncclGroupEnd();",
        ),
        (
            "    ncclResult_t launched = kNcclSuccess;",
            "    const ncclResult_t ended = kNcclSuccess;",
        ),
        "one thread launches every GPU's NCCL collective outside ncclGroupStart/End (on real "
        "NCCL the first call waits for ranks the thread never reaches)",
    ),
    "reduce-one-grid-pass": (
        "csrc/reduce_kernels.cu",
        "  // Grid-stride loop: any grid covers any count.\n"
        "  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; "
        "i += stride) {",
        "  // Grid-stride loop: any grid covers any count.\n"
        "  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; "
        "i = count + stride) {",
        "the shared-GPU all-reduce kernel makes one pass of the grid: past 4096 blocks of "
        "256 elements per replica the rest is never reduced",
    ),
    "ready-event-on-wrong-stream-hot": (
        "csrc/hot/hooks.cpp",
        "st.mark(st.engine, r, i, stream, msg, sizeof(msg));",
        "st.mark(st.engine, r, i, 0, msg, sizeof(msg));",
        "pyddp._hot's C++ hook records the ready event on the default stream, "
        "not the producing one",
    ),
    "no-fence": (
        "csrc/gpu_backend.cpp",
        "      wait_fence_locked(reinterpret_cast<CUstream>(w), comm_index_[r]);",
        "      (void)w;",
        "writing streams do not wait for the reductions at the end of backward",
    ),
    "no-context-switch-in-record": (
        "csrc/gpu_backend.cpp",
        "  set_device(devices_[replica]);\n  Slot& s = slot(replica, key);",
        "  Slot& s = slot(replica, key);",
        "the producing thread records events without making the replica's context current",
    ),
    "swapped-f16-bf16-enums": (
        "csrc/cuda_api.h",
        "kNcclFloat16 = 6, kNcclFloat32 = 7, kNcclFloat64 = 8, kNcclBfloat16 = 9",
        "kNcclFloat16 = 9, kNcclFloat32 = 7, kNcclFloat64 = 8, kNcclBfloat16 = 6",
        "ncclFloat16 and ncclBfloat16 swapped",
    ),
    "no-poll-after-in-progress": (
        "csrc/gpu_backend.cpp",
        "    wait_comms(n, set.comms,\n               std::chrono::steady_clock::now() +\n"
        "                   std::chrono::duration_cast<std::chrono::steady_clock::duration>(\n"
        "                       std::chrono::duration<double>(timeout_s())),\n"
        "               launching.c_str());",
        "    (void)0;",
        "no poll of ncclCommGetAsyncError after a non-blocking launch returned ncclInProgress",
    ),
    "workers-ignore-caller-stream": (
        "pyddp/replicas/workers.py",
        "            stack.enter_context(provider.use(streams))\n",
        "            pass\n",
        "replica workers do not inherit the caller's current streams",
    ),
    "fence-on-one-device": (
        "csrc/gpu_backend.cpp",
        "      wait_fence_locked(reinterpret_cast<CUstream>(w), comm_index_[r]);",
        "      wait_fence_locked(reinterpret_cast<CUstream>(w), 0);",
        "every replica's writers wait for the first GPU's reductions only (caught by the "
        "skewed completion of collectives)",
    ),
    "no-recovery-on-zero-grad": (
        "csrc/engine.cpp",
        "  backend_->recover();",
        "",
        "a failed GPU backend is never rebuilt",
    ),
    "kernel-writes-past-the-end": (
        "csrc/reduce_kernels.cu",
        "i < count; i += stride) {\n    A acc",
        "i <= count; i += stride) {\n    A acc",
        "the reduce kernel's loop runs one element past the bucket (caught by the guard zones)",
    ),
    "collective-count-past-the-end": (
        "csrc/gpu_backend.cpp",
        "static_cast<size_t>(bufs[r].count),",
        "static_cast<size_t>(bufs[r].count) + 1,",
        "NCCL is given one element more than the bucket holds (caught by the bounds check)",
    ),
    "buffer-broadcast-on-the-first-gpu": (
        "pyddp/_link/route.py",
        "parts = [self.provider.zeros(words, torch.float16, d) for d in self.devices]",
        "parts = [self.provider.zeros(words, torch.float16, first) for d in self.devices]",
        "the device buffer broadcast gives every local GPU a buffer on the first GPU",
    ),
    "buffer-broadcast-root-by-process-rank": (
        "pyddp/_link/processes.py",
        "self._route.broadcast(tensors, sum(self.local_counts[:root]))",
        "self._route.broadcast(tensors, root)",
        "the device buffer broadcast names its root by process rank, not by NCCL rank (with 2 "
        "GPUs per process, process 1's root is rank 2)",
    ),
    "broadcast-root-as-replica-index": (
        "pyddp/engine/collectives.py",
        "    rank = place.backend.rank_of(root)",
        "    rank = root",
        "pyddp.broadcast passes the replica's index as NCCL's root, not its rank (NCCL numbers "
        "GPUs by device: replicas on [2, 0, 1] are ranks 2, 0, 1)",
    ),
    "all-gather-sendcount-is-the-total": (
        "csrc/gpu_backend.cpp",
        "return n.ncclAllGather(sends[r].data, recvs[r].data, static_cast<size_t>(count),",
        "return n.ncclAllGather(sends[r].data, recvs[r].data, static_cast<size_t>(count * "
        "comm_ranks()),",
        "ncclAllGather is given the receive count (ranks x count) as its send count (NCCL "
        "reads and writes past both buffers)",
    ),
    "reduce-scatter-kernel-reads-block-zero": (
        "csrc/reduce_kernels.cu",
        (
            "A acc = K::load(((const T*)p.p[0])[r * count + i]);",
            "acc += K::load(((const T*)p.p[k])[r * count + i]);",
        ),
        ("A acc = K::load(((const T*)p.p[0])[i]);", "acc += K::load(((const T*)p.p[k])[i]);"),
        "the on-device reduce-scatter sums block 0 of every send for every replica",
    ),
    "buckets-freed-without-record-stream": (
        "pyddp/engine/streams.py",
        "                self.provider.retire(tensors, self.devices[r])",
        "                pass",
        "replaced buckets are dropped without Tensor.record_stream on the streams that used "
        "them (their allocation stream may hand them out again at once)",
    ),
    "sharded-gather-slot-by-replica-index": (
        "pyddp/engine/faces.py",
        "            return self._r._backend.rank_of(replica)",
        "            return sum(self.ranks.replicas_per_rank[: self.ranks.rank]) + replica",
        "a GPU replica's shard is its index among the process's replicas, not its rank in the "
        "all-gather (on [2, 0, 1] the blocks land on the wrong parameters)",
    ),
    "scatter-block-by-replica-index": (
        "csrc/engine.cpp",
        "recvs[r].data = static_cast<char*>(sends[r].data) + block * backend_->rank_of(r) * es;",
        "recvs[r].data = static_cast<char*>(sends[r].data) + block * r * es;",
        "ZeRO stage 2's reduce-scatter gives replica r block r, not its NCCL rank's (on "
        "[2, 0, 1] the blocks and the shards disagree)",
    ),
    "scatter-piece-by-replica-index": (
        "pyddp/engine/scattered.py",
        "start = self.offset[i] + lo - self.rank_of[r] * self.block[b]",
        "start = self.offset[i] + lo - r * self.block[b]",
        "ZeRO stage 2's optimizer reads replica r's pieces as if its block were block r, not "
        "its NCCL rank's (the reduce-scatter lands block rank(r) in replica r's blocks)",
    ),
    "join-buffers-from-rank-zero-on-gpus": (
        "pyddp/_link/processes.py",
        "self._route.broadcast(tensors, sum(self.local_counts[:root]))",
        "self._route.broadcast(tensors, sum(self.local_counts[:0]))",
        "under Join the device buffer broadcast takes rank 0's buffers (joined, stale) instead "
        "of the highest rank with inputs'",
    ),
    "compress-before-ready-wait": (
        "csrc/gpu_backend.cpp",
        "    wait_ready_locked(set, key);\n"
        "    const unsigned long long captured = one_capture_locked(set);\n"
        "    if (before) before(set);",
        "    if (before) before(set);\n    wait_ready_locked(set, key);\n"
        "    const unsigned long long captured = one_capture_locked(set);",
        "the compression kernel is queued before the communication stream waits for the "
        "gradients (reads them before autograd's late writes land)",
    ),
    "decompress-before-nccl-is-queued": (
        "csrc/gpu_backend.cpp",
        (
            "    wait_comms(n, set.comms,",
            "launching.c_str());\n    if (after) after(set);",
        ),
        (
            "    if (after) after(set);\n    wait_comms(n, set.comms,",
            "launching.c_str());",
        ),
        "the kernel copying the reduced 16-bit values back is queued before the non-blocking "
        "communicators have queued the all-reduce",
    ),
    "wire-copy-one-short": (
        "pyddp/engine/buckets.py",
        "wires.append(self._zeros(count, self.wire_dtype, r))",
        "wires.append(self._zeros(max(count - 1, 1), self.wire_dtype, r))",
        "the 16-bit copy of a bucket is one element short (the kernels and NCCL run past it)",
    ),
    "syncbn-reads-stats-before-their-stream": (
        "pyddp/replicas/syncbn.py",
        "self._sum(r, (buf, streams.current(devices[r])), what)",
        "self._sum(r, (buf, 0), what)",
        "SyncBatchNorm's device sum is ordered after the legacy default stream, not the "
        "replica's current stream that computed the statistics",
    ),
    "zero-gather-reads-before-the-sum-lands": (
        "pyddp/_link/route.py",
        "        for d in set(self.devices):\n            self.provider.before_host_write(d)",
        "        for d in ():\n            self.provider.before_host_write(d)",
        "a sharded optimizer's replicas copy the gathered parameters back before their "
        "streams are past the all-gather (the other shards' elements read stale values)",
    ),
    "no-agreement-wait-when-missing": (
        "pyddp/_link/processes.py",
        "        if self.agreement.missing_here:",
        "        if False:",
        "a GPU rank missing a gradient does not wait for the agreement (a parameter nobody "
        "used keeps a zero gradient instead of None)",
    ),
    "sticky-only-on-faulting-kernels": (
        "csrc/cuda_api.cpp",
        "return r == 700 || r == 702 || (r >= 714 && r <= 719) || r == 214 || r == 220 || "
        "r == 999;",
        "return r == 700 || (r >= 714 && r <= 719);",
        "a launch timeout, uncorrectable ECC or NVLink error or unknown error is not treated "
        "as a dead context (no advice to restart, communicators rebuilt on it)",
    ),
    "sticky-noted-by-the-watchdog-only": (
        "csrc/cuda_api.cpp",
        'throw ReduceError(cu_failure(r, -1, detail::concat("pyddp: ", call, " at ", file, ":", '
        "line)));",
        'throw ReduceError(detail::concat(cu_error_text(r), " in ", call, " at ", file, ":", '
        "line));",
        "a sticky error first returned by a checked driver call (a stream wait, an event "
        "record) is not noted: pyddp reports whatever fails next and rebuilds on the dead "
        "context",
    ),
    "compression-divides": (
        "csrc/reduce_kernels.cu",
        "dst[i] = K::store(K::load(K::store(src[i])) * inv);",
        "dst[i] = K::store(K::load(K::store(src[i])) / (float)n);",
        "the wire compression divides by the ranks where torch's CUDA div_ multiplies by the "
        "float reciprocal (other float16 subnormals for 14, 26, 28, ... ranks)",
    ),
    "captured-launches-watched": (
        "csrc/gpu_backend.cpp",
        "  if (captured != 0) {",
        "  if (false) {",
        "launches captured into a CUDA graph are watched like eager ones: the watch queries "
        "their events, which belong to the graph (CUDA fails the query, 907)",
    ),
    "watch-queries-in-global-capture-mode": (
        "csrc/gpu_backend.cpp",
        "  RelaxedCaptureMode relaxed;\n",
        "",
        "pyddp's watch queries its events in the thread's default (global) capture mode: a "
        "capture under way on any thread fails the query (900) and is invalidated",
    ),
    "nccl-ranks-split-across-a-capture": (
        "csrc/gpu_backend.cpp",
        "  if (std::adjacent_find(ids.begin(), ids.end(), std::not_equal_to<>()) == ids.end()) {",
        "  if (true) {",
        "an NCCL launch whose ranks' streams are partly in a CUDA graph capture goes ahead: "
        "the ranks launched now wait for ranks that run only at a replay",
    ),
    "captured-stream-waits-on-eager-fence": (
        "csrc/gpu_backend.cpp",
        "  if (capture_id(stream) != fence_capture_[comm_index]) return;\n",
        "",
        "a stream capturing a graph waits on the fence an eager step recorded, and an eager "
        "one on a fence recorded in a capture (CUDA's isolation error, 905, the capture "
        "invalidated; or the stream pulled into the capture)",
    ),
    "finish-fences-only-the-gradients-streams": (
        "csrc/engine.cpp",
        "    for (int r = 0; r < num_replicas_; ++r) backend_->use_stream(r, streams[r]);\n",
        "",
        "finish() fences only the streams that wrote the gradients, not the caller's current "
        "streams: on a GPU autograd writes them on the forward's streams, from its device "
        "threads, and the optimizer reads them on the caller's",
    ),
    "torch-streams-retire-without-record-stream": (
        "pyddp/engine/streams.py",
        "            t.record_stream(stream)",
        "            pass",
        "pyddp's GPU stream provider (TorchStreams) drops replaced buckets without "
        "Tensor.record_stream",
    ),
    "shared-gpu-followers-not-copied": (
        "pyddp/optim/replicated.py",
        "            torch._foreach_copy_(list(compress(into, changed)), "
        "list(compress(froms, changed)))",
        "            pass",
        "replicas sharing a GPU with the replica that steps do not take its parameters "
        "after the step (they skip the step and keep their old parameters)",
    ),
    "join-sharded-step-on-own-gradients": (
        "pyddp/optim/zero.py",
        "                        p.grad = g if g is None or r == 0 else g.to(p.device, copy=True)",
        "                        pass",
        "under Join, a joined rank steps its shard of a sharded optimizer with its own "
        "gradients, not those broadcast by the highest rank with inputs",
    ),
    "python-hook-before-ready-events": (
        "csrc/gpu_backend.cpp",
        "    wait_ready_locked(*launch.set, key);\n    if (one_capture_locked(*launch.set) != 0) {",
        "    if (one_capture_locked(*launch.set) != 0) {",
        "a Python communication hook's stream does not wait for the bucket's ready events "
        "(the hook reduces gradients still being written)",
    ),
    "python-hook-off-its-stream": (
        "pyddp/_link/transport.py",
        "        with provider.on(device, stream):",
        "        with provider.on(device, provider.current(device)):",
        "a Python communication hook runs on the launcher thread's current stream, not on the "
        "stream that waited for the bucket's gradients",
    ),
    "python-hook-result-not-awaited": (
        "csrc/gpu_backend.cpp",
        "  PYDDP_CU(d.cuStreamWaitEvent(comm_stream(*launch.set, 0), hook_out_, 0));\n",
        "",
        "the communication stream (and so the step after backward) is not ordered after the "
        "Python communication hook's stream: a result the hook's collective writes late is "
        "read before it lands",
    ),
    "shared-gpu-followers-counters-not-moved": (
        "pyddp/optim/replicated.py",
        "            increment_versions(list(compress(into, map(extra.__lt__, moved))))",
        "            pass",
        "the replicas that copy the stepping replica's parameters move their version "
        "counters by the copy's one only, so the model's mirror copies every parameter again "
        "before each forward (same values, the work the step-once optimizer saves)",
    ),
}


def copy_tree(dst: str) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for f in files:
        if not os.path.exists(os.path.join(ROOT, f)):
            continue
        os.makedirs(os.path.dirname(os.path.join(dst, f)) or dst, exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), os.path.join(dst, f))


# Breakages of the Python path where pyddp._hot takes the same work: their
# tests run with the hot path switched off.
PYTHON_PATH = {"ready-event-on-wrong-stream"}


def apply(src: str, name: str) -> None:
    path, old, new, _ = BREAKAGES[name]
    full = os.path.join(src, path)
    with open(full) as f:
        text = f.read()
    olds, news = (old, new) if isinstance(old, tuple) else ((old,), (new,))
    for o, n in zip(olds, news):
        if o not in text:
            raise SystemExit(f"{name}: the code it breaks changed ({path}); update BREAKAGES")
        text = text.replace(o, n, 1)
    with open(full, "w") as f:
        f.write(text)


def shadow_editable_install(site: str) -> None:
    """An editable install (`pip install -e .`) imports pyddp through a finder
    that comes before PYTHONPATH, so the tests would run the unbroken tree: a
    sitecustomize in `site` (imported after .pth files, in every subprocess
    the tests start) drops that finder."""
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(
            "import sys\n"
            "sys.meta_path[:] = [f for f in sys.meta_path\n"
            "                    if not type(f).__module__.startswith('_editable_')]\n"
        )


def run(name: str, files: tuple = ()) -> list:
    with tempfile.TemporaryDirectory(prefix=f"pyddp-break-{name}-") as tmp:
        src, site = os.path.join(tmp, "src"), os.path.join(tmp, "site")
        copy_tree(src)
        apply(src, name)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-build-isolation",
                "--no-deps",
                "--target",
                site,
                src,
            ],
            check=True,
            capture_output=True,
        )
        shadow_editable_install(site)
        env = dict(os.environ, PYTHONPATH=site + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if name in PYTHON_PATH:
            env["PYDDP_HOT"] = "0"
        where = subprocess.run(
            [sys.executable, "-c", "import pyddp; print(pyddp.__file__)"],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp,
        ).stdout.strip()
        if not where.startswith(site):
            raise SystemExit(f"{name}: the tests would import pyddp from {where}, not the copy")
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-m",
                "simgpu",
                "-p",
                "no:cacheprovider",
                # every simgpu test, whichever feature's file (or those asked for)
                *([os.path.join(src, "tests", f) for f in files] or [os.path.join(src, "tests")]),
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp,
        )
        return [
            line.split(" ")[1].rsplit("tests/", 1)[-1]  # test_file.py::test_name[params]
            for line in out.stdout.splitlines()
            if line.startswith("FAILED")
        ]


def main(argv: list) -> int:
    files: tuple = ()
    if "--tests" in argv:
        at = argv.index("--tests")
        argv, files = argv[:at], tuple(argv[at + 1 :])
    names = argv or list(BREAKAGES)
    missed = 0
    for name in names:
        failed = run(name, files)
        missed += not failed
        print(f"{name}: {BREAKAGES[name][3]}")
        listed = ", ".join(failed) if failed else "NONE (the tests miss it)"
        print(f"  {len(failed)} failed: {listed}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
