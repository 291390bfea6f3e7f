// pybind11 glue for pyddp._C: no logic here. C++ exceptions map to Python ones
// and the GIL is released around every call that can wait.
#include <cstdio>

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bucket_plan.h"
#include "cpu_backend.h"
#include "cuda_api.h"
#include "device_kernel.h"
#include "engine.h"
#include "gpu_backend.h"
#include "process_group_backend.h"
#include "stress.h"

namespace py = pybind11;
using namespace pyddp;

namespace {

std::vector<DType> dtypes_from_names(const std::vector<std::string>& names) {
  std::vector<DType> out;
  out.reserve(names.size());
  for (const auto& n : names) out.push_back(dtype_from_name(n));
  return out;
}

LaunchOrder launch_order_from_name(const std::string& name) {
  if (name == "ready") return LaunchOrder::kReady;
  if (name == "index") return LaunchOrder::kIndex;
  if (name == "after_backward") return LaunchOrder::kAfterBackward;
  throw UsageError("unknown reduce order '" + name +
                   "': use 'ready', 'index' or 'after_backward'");
}

BufferRef make_buffer(uintptr_t ptr, int64_t count, const std::string& dtype, int device,
                      uintptr_t wire = 0) {
  BufferRef b;
  b.wire = reinterpret_cast<void*>(wire);
  b.data = reinterpret_cast<void*>(ptr);
  b.count = count;
  b.dtype = dtype_from_name(dtype);
  b.device = device;
  return b;
}

std::vector<BufferRef> make_buffers(const std::vector<uintptr_t>& ptrs, const std::vector<int>& devices,
                                    int64_t count, const std::string& dtype) {
  PYDDP_ENFORCE(ptrs.size() == devices.size(), "ptrs and devices differ in length");
  std::vector<BufferRef> bufs;
  for (size_t i = 0; i < ptrs.size(); ++i) bufs.push_back(make_buffer(ptrs[i], count, dtype, devices[i]));
  return bufs;
}

// One collective outside the engine, ordered on `streams` (one per replica):
// after what each stream queued so far, and each stream waits for the
// result. Runs without the GIL.
void stream_ordered(Backend& self, const std::vector<uintptr_t>& streams,
                    const std::function<void()>& collective) {
  py::gil_scoped_release release;
  for (size_t i = 0; i < streams.size(); ++i) {
    self.use_stream(static_cast<int>(i), streams[i]);
    self.record_ready(static_cast<int>(i), -1, {streams[i]});
  }
  try {
    collective();
  } catch (...) {
    // Kernels may be queued already: order the streams after them.
    self.fence();
    throw;
  }
  self.fence();
  self.check();
}

// The engine's mark_ready for the torch-linked hot path (pyddp._hot), which
// calls it from C++ gradient hooks without Python: a plain C function, so no
// C++ type or exception crosses between the two modules. Returns 0, or 1
// (ReduceError) / 2 (UsageError) / 3 (anything else) with the message in msg.
extern "C" int pyddp_engine_mark(void* engine, int replica, int param, uintptr_t stream,
                                 char* msg, size_t cap) {
  try {
    static_cast<Engine*>(engine)->mark_ready(replica, param, stream);
    return 0;
  } catch (const ReduceError& e) {
    std::snprintf(msg, cap, "%s", e.what());
    return 1;
  } catch (const UsageError& e) {
    std::snprintf(msg, cap, "%s", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::snprintf(msg, cap, "%s", e.what());
    return 3;
  }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pyddp engine (private; use the pyddp package)";

  auto usage = py::register_exception<UsageError>(m, "UsageError", PyExc_RuntimeError);
  py::register_exception<ReduceError>(m, "ReduceError", PyExc_RuntimeError);
  (void)usage;

  m.def("now_ns", &now_ns, "Steady-clock time in nanoseconds (the engine's stats clock).");

  m.def(
      "plan_buckets",
      [](const std::vector<int64_t>& numels, const std::vector<std::string>& dtypes,
         const std::vector<int>& order, int64_t first_cap, int64_t cap, bool taper) {
        return plan_buckets(numels, dtypes_from_names(dtypes), order, first_cap, cap, taper);
      },
      py::arg("numels"), py::arg("dtypes"), py::arg("order"), py::arg("first_cap_bytes"),
      py::arg("cap_bytes"), py::arg("taper") = false);

  m.def(
      "stress_engine",
      [](int replicas, int params, int64_t cap_bytes, bool index_order, int iterations,
         int threads, uint64_t seed, double skip_fraction) {
        StressResult r;
        {
          py::gil_scoped_release release;
          r = stress_engine(replicas, params, cap_bytes, index_order, iterations, threads, seed,
                            skip_fraction);
        }
        py::dict d;
        d["iterations"] = r.iterations;
        d["wrong_values"] = r.wrong_values;
        d["reductions"] = r.reductions;
        d["first_error"] = r.first_error;
        return d;
      },
      py::arg("replicas"), py::arg("params"), py::arg("cap_bytes"), py::arg("index_order"),
      py::arg("iterations"), py::arg("threads"), py::arg("seed"), py::arg("skip_fraction"));
  m.def("bench_mark_ready", &bench_mark_ready, py::arg("replicas"), py::arg("params"),
        py::arg("iterations"), py::call_guard<py::gil_scoped_release>());

  py::class_<Backend, std::shared_ptr<Backend>>(m, "Backend")
      .def_property_readonly("name", &Backend::name)
      .def_property_readonly("captured_launches", &Backend::captured_launches,
                             "Launches made into a CUDA graph capture (they run at each replay).")
      .def("check", &Backend::check, "Raises ReduceError if a reduction failed or timed out.")
      .def(
          "reduce",
          [](Backend& self, const std::vector<uintptr_t>& ptrs, const std::vector<int>& devices,
             const std::vector<uintptr_t>& streams, int64_t count, const std::string& dtype,
             const std::string& op) {
            PYDDP_ENFORCE(streams.size() == devices.size(), "streams and devices differ in length");
            const auto bufs = make_buffers(ptrs, devices, count, dtype);
            const ReduceOp rop = reduce_op_from_name(op);
            stream_ordered(self, streams, [&] { self.all_reduce(bufs, rop, -1); });
          },
          py::arg("ptrs"), py::arg("devices"), py::arg("streams"), py::arg("count"),
          py::arg("dtype"), py::arg("op") = "sum",
          "One stream-ordered in-place all-reduce outside the engine (collectives API).")
      .def(
          "broadcast",
          [](Backend& self, const std::vector<uintptr_t>& ptrs, const std::vector<int>& devices,
             const std::vector<uintptr_t>& streams, int64_t count, const std::string& dtype,
             int root) {
            PYDDP_ENFORCE(streams.size() == devices.size(), "streams and devices differ in length");
            const auto bufs = make_buffers(ptrs, devices, count, dtype);
            stream_ordered(self, streams, [&] { self.broadcast(bufs, root, -1); });
          },
          py::arg("ptrs"), py::arg("devices"), py::arg("streams"), py::arg("count"),
          py::arg("dtype"), py::arg("root"),
          "One stream-ordered in-place broadcast from rank `root` (see rank_of).")
      .def(
          "all_gather",
          [](Backend& self, const std::vector<uintptr_t>& sends, const std::vector<uintptr_t>& recvs,
             const std::vector<int>& devices, const std::vector<uintptr_t>& streams, int64_t count,
             const std::string& dtype) {
            PYDDP_ENFORCE(streams.size() == devices.size(), "streams and devices differ in length");
            const int64_t total = count * self.ranks(static_cast<int>(devices.size()));
            const auto s = make_buffers(sends, devices, count, dtype);
            const auto r = make_buffers(recvs, devices, total, dtype);
            stream_ordered(self, streams, [&] { self.all_gather(s, r, -1); });
          },
          py::arg("sends"), py::arg("recvs"), py::arg("devices"), py::arg("streams"),
          py::arg("count"), py::arg("dtype"),
          "One stream-ordered all-gather: `count` elements from every rank into each "
          "receive buffer (ranks * count elements, in rank order).")
      .def(
          "reduce_scatter",
          [](Backend& self, const std::vector<uintptr_t>& sends, const std::vector<uintptr_t>& recvs,
             const std::vector<int>& devices, const std::vector<uintptr_t>& streams, int64_t count,
             const std::string& dtype, const std::string& op) {
            PYDDP_ENFORCE(streams.size() == devices.size(), "streams and devices differ in length");
            const int64_t total = count * self.ranks(static_cast<int>(devices.size()));
            const auto s = make_buffers(sends, devices, total, dtype);
            const auto r = make_buffers(recvs, devices, count, dtype);
            const ReduceOp rop = reduce_op_from_name(op);
            stream_ordered(self, streams, [&] { self.reduce_scatter(s, r, rop, -1); });
          },
          py::arg("sends"), py::arg("recvs"), py::arg("devices"), py::arg("streams"),
          py::arg("count"), py::arg("dtype"), py::arg("op") = "sum",
          "One stream-ordered reduce-scatter: each receive buffer gets `count` elements, the "
          "reduction of its rank's block of every send buffer (ranks * count elements).")
      .def("ranks", &Backend::ranks, py::arg("replicas"),
           "How many ranks the collectives span, for `replicas` buffers from this process.")
      .def("rank_of", &Backend::rank_of, py::arg("replica"),
           "Replica's rank among them (blocks and broadcast roots are by rank).")
      .def("close", &Backend::close, py::call_guard<py::gil_scoped_release>(),
           "Releases threads and communicators now; later use raises.");

  py::class_<CpuBackend, Backend, std::shared_ptr<CpuBackend>>(m, "CpuBackend")
      .def(py::init<int>(), py::arg("threads") = 0)
      .def_property_readonly("threads", &CpuBackend::threads);

  py::class_<NcclBackend, Backend, std::shared_ptr<NcclBackend>>(m, "NcclBackend")
      .def(py::init([](std::vector<int> devices, std::string nccl_path, double timeout_s,
                       py::bytes id, int nranks, int first_rank) {
             NcclRendezvous rdzv{std::string(id), nranks, first_rank};
             py::gil_scoped_release release;  // communicator init can wait for peers
             return std::make_shared<NcclBackend>(std::move(devices), nccl_path, timeout_s,
                                                  std::move(rdzv));
           }),
           py::arg("devices"), py::arg("nccl_path"), py::arg("timeout_s"),
           py::arg("id") = py::bytes(), py::arg("nranks") = 0, py::arg("first_rank") = 0,
           "One replica per GPU. With `id` (nccl_unique_id() from one process, given to "
           "all): one communicator across processes, this process's GPUs being ranks "
           "first_rank.. of nranks.")
      .def("set_compression", &NcclBackend::set_compression, py::arg("dtype"),
           py::arg("nvrtc_path"), py::call_guard<py::gil_scoped_release>(),
           "Wire compression of float32 buckets ('float16' or 'bfloat16'; 'float32': none), "
           "as torch DDP's fp16/bf16 compression hooks: each buffer's `wire` holds the "
           "16-bit copy NCCL reduces. The kernels are compiled with NVRTC.")
      .def_property_readonly("compression", &NcclBackend::compression)
      .def("set_hook", &NcclBackend::set_hook, py::arg("hook"), py::arg("stream"),
           py::call_guard<py::gil_scoped_release>(),
           "A communication hook outside the core, run on `stream` (a CUstream of the "
           "caller's): each bucket's all-reduce makes `stream` wait for the bucket's ready "
           "events, calls hook(bucket) on the engine's launcher thread, whose work must be "
           "queued on `stream` when it returns, then orders the communication stream after "
           "`stream`. One GPU per process.");
  m.def(
      "nccl_unique_id",
      [](const std::string& nccl_path) { return py::bytes(nccl_unique_id(nccl_path)); },
      py::arg("nccl_path"), "ncclGetUniqueId, as bytes to pass to the other processes.");
  py::class_<SharedGpuBackend, Backend, std::shared_ptr<SharedGpuBackend>>(m, "SharedGpuBackend")
      .def(py::init<int, int, double, std::string>(), py::arg("device"), py::arg("replicas"),
           py::arg("timeout_s"), py::arg("nvrtc_path"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("kernel", &SharedGpuBackend::kernel_description);

  // Run-time discovery for pyddp.doctor and backend selection.
  m.def("cuda_driver_version", &cuda::driver_version);
  m.def("cuda_device_count", &cuda::device_count);
  m.def("cuda_device_name", &cuda::device_name, py::arg("device"));
  m.def("nccl_version", &cuda::nccl_version, py::arg("path"));
  m.def("nccl_loaded_path", &cuda::nccl_path);
  m.def("cuda_driver_library", &cuda::driver_library);
  m.def("cuda_driver_simulated", &cuda::driver_is_simulated);
  m.def("cuda_capture_supported", &cuda::capture_supported,
        "Whether the CUDA driver has what a captured step uses (capture info, capture modes).");
  m.def("cuda_compute_capability", &cuda::compute_capability, py::arg("device"));
  m.def("nvrtc_version", &cuda::nvrtc_version, py::arg("path"));
  m.def(
      "load_device_kernel",
      [](int device, const std::string& nvrtc_path) {
        return device_kernels(device, nvrtc_path).how;
      },
      py::arg("device"), py::arg("nvrtc_path"), py::call_guard<py::gil_scoped_release>(),
      "Compiles (NVRTC) and loads (cuModuleLoadData) the reduction kernel on a device; "
      "returns what was built.");

  py::class_<ProcessGroupBackend, Backend, std::shared_ptr<ProcessGroupBackend>>(m, "ProcessGroupBackend")
      .def(py::init([](std::shared_ptr<Backend> local, py::function launch, std::string name,
                       int first_rank, int nranks, py::object hot) {
             // Runs on the engine's launcher thread: takes the GIL for the
             // Python launch, and turns its exception into a ReduceError (the
             // engine names the bucket) instead of a Python error object
             // crossing threads.
             std::shared_ptr<py::function> held(new py::function(std::move(launch)),
                                                [](py::function* f) {
                                                  py::gil_scoped_acquire gil;
                                                  delete f;
                                                });
             // `hot`: pyddp._hot's Wire, whose plain C entry point launches
             // a bucket without the GIL, or answers 1 (Python launches it).
             // Held here: the backend outlives no launch of it.
             using HotLaunch = int (*)(void*, int, char*, size_t);
             HotLaunch hot_fn = nullptr;
             void* hot_ctx = nullptr;
             std::shared_ptr<py::object> hot_owner;
             if (!hot.is_none()) {
               auto entry = hot.attr("entry")().cast<std::pair<uintptr_t, uintptr_t>>();
               hot_ctx = reinterpret_cast<void*>(entry.first);
               hot_fn = reinterpret_cast<HotLaunch>(entry.second);
               hot_owner.reset(new py::object(std::move(hot)), [](py::object* o) {
                 py::gil_scoped_acquire gil;
                 delete o;
               });
             }
             std::function<void(int)> call = [held, hot_fn, hot_ctx, hot_owner](int key) {
               if (hot_fn != nullptr) {
                 char msg[2048] = {0};
                 const int rc = hot_fn(hot_ctx, key, msg, sizeof(msg));
                 if (rc == 0) return;
                 if (rc < 0) throw ReduceError(msg);
               }
               py::gil_scoped_acquire gil;
               try {
                 (*held)(key);
               } catch (py::error_already_set& e) {
                 throw ReduceError(e.what());
               }
             };
             // The buckets the Wire launches itself only enqueue: the engine
             // launches them from the thread that completes them. Not on
             // GPUs (their buckets go to Python, the Wire's bypass).
             std::function<bool(int)> cheap;
             if (hot_fn != nullptr && !local->asynchronous()) {
               using HotTakes = int (*)(void*, int);
               auto takes = reinterpret_cast<HotTakes>(
                   hot_owner->attr("takes_entry")().cast<uintptr_t>());
               cheap = [takes, hot_ctx, hot_owner](int key) { return takes(hot_ctx, key) != 0; };
             }
             return std::make_shared<ProcessGroupBackend>(std::move(local), std::move(call),
                                                   std::move(name), first_rank, nranks,
                                                   std::move(cheap));
           }),
           py::arg("local"), py::arg("launch"), py::arg("name"), py::arg("first_rank"),
           py::arg("nranks"), py::arg("hot") = py::none(),
           "Local reduction, then launch(bucket) starts the cross-process one (hot: from C++ "
           "where pyddp._hot's Wire can, else Python).");

  py::class_<Engine>(m, "Engine")
      .def(py::init([](int num_replicas, const std::vector<std::string>& names,
                       const std::vector<int64_t>& numels, const std::vector<std::string>& dtypes,
                       std::vector<std::vector<int>> buckets, const std::string& order,
                       const std::string& op, std::shared_ptr<Backend> backend) {
             PYDDP_ENFORCE(names.size() == numels.size() && dtypes.size() == numels.size(),
                           "names, numels and dtypes differ in length: ", names.size(), ", ",
                           numels.size(), ", ", dtypes.size());
             std::vector<ParamInfo> params;
             for (size_t i = 0; i < names.size(); ++i) {
               params.push_back(ParamInfo{names[i], numels[i], dtype_from_name(dtypes[i])});
             }
             return std::make_unique<Engine>(num_replicas, std::move(params), std::move(buckets),
                                             launch_order_from_name(order),
                                             reduce_op_from_name(op), std::move(backend));
           }),
           py::arg("num_replicas"), py::arg("names"), py::arg("numels"), py::arg("dtypes"),
           py::arg("buckets"), py::arg("order"), py::arg("op"), py::arg("backend"))
      .def("set_buckets", &Engine::set_buckets, py::arg("buckets"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "set_buffer",
          [](Engine& self, int replica, int bucket, uintptr_t ptr, int64_t count,
             const std::string& dtype, int device, uintptr_t wire) {
            self.set_buffer(replica, bucket, make_buffer(ptr, count, dtype, device, wire));
          },
          py::arg("replica"), py::arg("bucket"), py::arg("ptr"), py::arg("count"),
          py::arg("dtype"), py::arg("device") = -1, py::arg("wire") = 0)
      .def("release_buffer", &Engine::release_buffer, py::arg("replica"), py::arg("bucket"),
           "Sharded gradients: the bucket's buffer was freed (launching it again raises).")
      .def("set_recv", &Engine::set_recv, py::arg("replica"), py::arg("bucket"), py::arg("recv"),
           "Sharded gradients: the replica's block of the bucket lands at `recv` (0: in place).")
      .def("take_completed", &Engine::take_completed,
           "Buckets whose reduction call returned since the last call (CPU: reduced).")
      // Holds the GIL: it only counts (no waiting), and a release/reacquire
      // would cost more than the call itself.
      .def("mark_ready", &Engine::mark_ready, py::arg("replica"), py::arg("param"),
           py::arg("stream") = 0)
      .def(
          "hot_entry",
          [](Engine& self) {
            return py::make_tuple(reinterpret_cast<uintptr_t>(&self),
                                  reinterpret_cast<uintptr_t>(&pyddp_engine_mark));
          },
          "(this engine's address, the address of pyddp_engine_mark): for pyddp._hot's "
          "gradient hooks; valid while this object lives")
      .def(
          "finish",
          [](Engine& self, const std::vector<uintptr_t>& streams) {
            Engine::Settled s;
            {
              py::gil_scoped_release release;
              s = self.finish(streams);
            }
            return py::make_tuple(s.no_grad, s.settled);
          },
          py::arg("streams") = std::vector<uintptr_t>{})
      .def("check", &Engine::check, py::call_guard<py::gil_scoped_release>())
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>())
      .def("abort", &Engine::abort, py::call_guard<py::gil_scoped_release>())
      .def("set_sync", &Engine::set_sync, py::arg("enabled"))
      .def("set_scatter", &Engine::set_scatter, py::arg("ranks"),
           "Sharded gradients: buckets reduce-scatter over `ranks` ranks (0: all-reduce); "
           "buffers hold padded_count(bucket) elements.")
      .def_property_readonly("scatter_ranks", &Engine::scatter_ranks)
      .def_property_readonly("inline_launches", &Engine::inline_launches,
                             "Buckets launched from the thread that completed them (tests)")
      .def("padded_count", &Engine::padded_count, py::arg("bucket"))
      .def_property_readonly("sync_enabled", &Engine::sync_enabled)
      // May rebuild NCCL communicators (seconds): other threads keep running.
      .def("clear_grads", &Engine::clear_grads, py::arg("set_to_none"),
           py::call_guard<py::gil_scoped_release>())
      .def("note_grad", &Engine::note_grad, py::arg("param"), py::arg("has_grad"))
      .def("has_grad", &Engine::has_grad, py::arg("param"))
      .def("unmarked", &Engine::unmarked)
      .def("learn_counts", &Engine::learn_counts,
           "static_graph: the next synced backward counts each gradient's arrivals")
      .def_property_readonly("learning", &Engine::learning)
      .def_property_readonly("expected_counts", &Engine::expected_counts,
                             "Arrivals that make each gradient ready, [replica * P + param]")
      .def_property_readonly("active", &Engine::active)
      .def("take_reduced_copy", &Engine::take_reduced_copy, py::arg("replica"))
      .def("holds_reduced_copy", &Engine::holds_reduced_copy, py::arg("replica"))
      .def("restore_reduced_copy", &Engine::restore_reduced_copy, py::arg("replica"),
           py::arg("held"))
      .def_property_readonly("partial", &Engine::partial)
      .def_property_readonly("failed", &Engine::failed,
                             "A failed or late backward's refusal, kept until zero_grad()")
      .def("clear_failed", &Engine::clear_failed,
           "Lifts that refusal: the caller saw every gradient cleared since")
      .def_property_readonly("partial_reason", &Engine::partial_reason)
      .def("inject_fault", &Engine::inject_fault, py::arg("bucket"), py::arg("message"))
      .def("use_stream", &Engine::use_stream, py::arg("replica"), py::arg("stream"))
      .def_property_readonly("buckets", &Engine::buckets)
      .def_property_readonly("num_replicas", &Engine::num_replicas)
      .def_property_readonly("num_params", &Engine::num_params)
      .def_property_readonly("backend_name", &Engine::backend_name)
      .def("ready_order", &Engine::ready_order)
      .def("note_forward_end", &Engine::note_forward_end)
      .def("set_timeline", &Engine::set_timeline, py::arg("enabled"))
      .def("last_timeline",
           [](const Engine& self) {
             const Engine::Timeline t = self.last_timeline();
             py::dict d;
             d["bucket_ready_ns"] = t.bucket_ready_ns;
             d["bucket_launch_ns"] = t.bucket_launch_ns;
             d["bucket_done_ns"] = t.bucket_done_ns;
             d["param_ready_ns"] = t.param_ready_ns;
             return d;
           })
      .def("last_stats", [](const Engine& self) {
        const IterationStats s = self.last_stats();
        py::dict d;
        d["iteration"] = s.iteration;
        d["bytes"] = s.bytes;
        d["launches"] = s.launches;
        d["buckets"] = s.buckets;
        d["forward_end_ns"] = s.forward_end_ns;
        d["first_ready_ns"] = s.first_ready_ns;
        d["first_launch_ns"] = s.first_launch_ns;
        d["last_done_ns"] = s.last_done_ns;
        d["finish_start_ns"] = s.finish_start_ns;
        d["finish_end_ns"] = s.finish_end_ns;
        d["wait_ns"] = s.wait_ns;
        return d;
      });
}
