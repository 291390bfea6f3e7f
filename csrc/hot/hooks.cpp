// pyddp._hot: the torch-linked hot path, built against the torch installed at
// build time (docs/design.md, "Layers"). It holds what must not touch Python
// per step: a C++ hook on each parameter's gradient accumulator (the node
// torch DDP's reducer hooks too) that copies a gradient into its bucket view
// when it is not that view yet (the hand-over after zero_grad) and marks it
// ready in pyddp's engine through the engine's plain C entry point (_C's
// pyddp_engine_mark), without taking the interpreter lock. On GPU replicas it
// marks it with the stream that produced it: autograd runs the hook on that
// stream, and the hook reads it from torch's stream state (c10), or from the
// stream source the test suite's simulated driver gives (C functions too).
// Whatever is not that common case (no view yet, a sparse or mismatched
// gradient, sharded gradients, the wrapped model to tell once per backward)
// goes to the Python hook, which does what it always did.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/extension.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;
using torch::autograd::variable_list;

namespace {

using MarkFn = int (*)(void*, int, int, uintptr_t, char*, size_t);
// A stream source other than torch's (the simulated driver's, see
// pyddp/engine/streams.py): the calling thread's current stream of a device;
// the wait before the host writes a bucket view standing in for a kernel on
// it (a CUDA error code, 0: done); a gradient's write still running there.
using CurrentFn = void* (*)(int);
using BeforeWriteFn = int (*)(int);
using ProducedFn = int (*)(int, void*, void*, size_t);

// What every hook of one reducer shares. Python objects are borrowed from the
// HookSet that owns them: hooks use them only while `enabled` is set, and
// HookSet::remove clears it before it lets them go.
struct State {
  std::atomic<bool> enabled{true};
  std::atomic<bool> python_only{false};  // every gradient to the Python hook
  std::atomic<bool> began_due{false};    // tell the wrapped model a backward began
  void* engine = nullptr;
  MarkFn mark = nullptr;
  std::vector<std::vector<at::Tensor>> params;  // [replica][parameter]
  std::vector<std::vector<at::Tensor>> views;   // their bucket views (undefined: none)
  std::vector<std::vector<uintptr_t>> slots;  // where each view was laid out (0: untracked)
  std::vector<uint8_t*> handed;  // per replica: the layout's bytearray (set to None by pyddp)
  std::atomic<int64_t> adopted{0};
  std::atomic<int64_t> marks{0};  // gradients marked from C++ (counted, for the tests)
  PyObject* fallback = nullptr;  // python(replica, param): the Python hook
  PyObject* began = nullptr;     // the wrapped model's, or nullptr
  PyObject* errors[4] = {nullptr, nullptr, nullptr, nullptr};
  // GPU replicas: each replica's CUDA device (empty: CPU replicas), and
  // where their current streams come from: `current` and the rest where
  // given, else torch's (c10), whose stream ids `translate(device, id)`
  // turns into CUstream handles once each (cached).
  std::vector<int> devices;
  CurrentFn current = nullptr;
  BeforeWriteFn before_write = nullptr;
  ProducedFn produced = nullptr;
  PyObject* translate = nullptr;
  std::mutex handles_mu;
  std::vector<std::tuple<int, int64_t, uintptr_t>> handles;  // (device, stream id, CUstream)
};

// A Python error raised inside autograd's thread: torch hands it to the
// thread that called backward() with its type (python_error).
// Fetched here, with the lock held, as autograd would do it itself: the
// error must not depend on this thread's interpreter state outliving it.
[[noreturn]] void raise_python(py::error_already_set& e) {
  e.restore();
  python_error err;
  err.persist();
  throw err;
}

// fn(replica, param), or fn() with replica < 0; Python objects are made only
// once the interpreter lock is held (autograd's threads run without it).
void call_python(PyObject* fn, int replica = -1, int param = -1) {
  py::gil_scoped_acquire gil;
  try {
    auto f = py::reinterpret_borrow<py::object>(fn);
    if (replica < 0) {
      f();
    } else {
      f(replica, param);
    }
  } catch (py::error_already_set& e) {
    raise_python(e);
  }
}

// Raises `type(msg)` in the thread that called backward (see raise_python).
[[noreturn]] void raise_error(PyObject* type, const std::string& msg) {
  py::gil_scoped_acquire gil;
  PyErr_SetString(type, msg.c_str());
  python_error err;
  err.persist();
  throw err;
}

// The CUstream current on this thread for `device` in torch's stream state.
uintptr_t torch_stream(State& st, int device) {
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
                                 ->getStream(c10::Device(c10::DeviceType::CUDA,
                                                         static_cast<c10::DeviceIndex>(device)));
  const int64_t id = stream.id();
  {
    std::lock_guard<std::mutex> lk(st.handles_mu);
    for (const auto& [d, sid, handle] : st.handles) {
      if (d == device && sid == id) return handle;
    }
  }
  uintptr_t handle = 0;
  {
    py::gil_scoped_acquire gil;
    try {
      handle = py::reinterpret_borrow<py::object>(st.translate)(device, id).cast<uintptr_t>();
    } catch (py::error_already_set& e) {
      raise_python(e);
    }
  }
  std::lock_guard<std::mutex> lk(st.handles_mu);
  if (st.handles.size() >= 4096) st.handles.clear();  // external streams come and go
  st.handles.emplace_back(device, id, handle);
  return handle;
}

// A stream source's CUDA error, as torch names a dead context.
[[noreturn]] void raise_cuda(int code, const char* when) {
  raise_error(PyExc_RuntimeError,
              code == 700 ? std::string("CUDA error: an illegal memory access was encountered")
                          : "CUDA error " + std::to_string(code) + " " + when);
}

struct MarkHook : public torch::autograd::FunctionPostHook {
  std::shared_ptr<State> s;
  int r, i;
  MarkHook(std::shared_ptr<State> state, int replica, int param)
      : s(std::move(state)), r(replica), i(param) {}

  variable_list operator()(const variable_list& outputs, const variable_list&) override {
    State& st = *s;
    if (!st.enabled.load(std::memory_order_acquire)) return outputs;
    const at::Tensor& view = st.views[r][i];
    if (st.python_only.load(std::memory_order_relaxed) || !view.defined()) {
      call_python(st.fallback, r, i);
      return outputs;
    }
    at::Tensor& param = st.params[r][i];
    const at::Tensor& grad = param.grad();
    const int device = st.devices.empty() ? -1 : st.devices[r];
    if (st.slots[r][i] != 0 && reinterpret_cast<uintptr_t>(view.data_ptr()) != st.slots[r][i]) {
      call_python(st.fallback, r, i);  // `p.grad.data = ...` after the forward: Python reseats
      return outputs;
    }
    if (!grad.defined() || grad.unsafeGetTensorImpl() != view.unsafeGetTensorImpl()) {
      if (!grad.defined() || grad.is_sparse() || grad.sizes() != view.sizes() ||
          grad.scalar_type() != view.scalar_type() || grad.device() != view.device()) {
        call_python(st.fallback, r, i);  // named there, or handled
        return outputs;
      }
      if (device >= 0 && st.before_write != nullptr) {
        if (const int code = st.before_write(device)) raise_cuda(code, "before a gradient's copy");
      }
      {
        at::NoGradGuard no_grad;
        const_cast<at::Tensor&>(view).copy_(grad);  // one pass over the memory
      }
      param.mutable_grad() = view;  // later backwards accumulate in place
      if (st.handed[r][i]) {
        st.handed[r][i] = 0;  // pyddp set it to None (zero_grad): not counted
      } else {
        st.adopted.fetch_add(1, std::memory_order_relaxed);
      }
    }
    if (st.began != nullptr && st.began_due.exchange(false)) {
      call_python(st.began);
    }
    // Autograd runs this hook on the stream that accumulated the gradient:
    // the reduction waits for that stream, not another.
    uintptr_t stream = 0;
    if (device >= 0) {
      stream = st.current != nullptr ? reinterpret_cast<uintptr_t>(st.current(device))
                                     : torch_stream(st, device);
      if (st.produced != nullptr && view.is_floating_point() && view.numel() > 0) {
        const size_t bytes = static_cast<size_t>(view.numel()) * view.element_size();
        if (const int code = st.produced(device, reinterpret_cast<void*>(stream),
                                         view.data_ptr(), bytes)) {
          raise_cuda(code, "recording a gradient's write");
        }
      }
    }
    char msg[2048];
    const int kind = st.mark(st.engine, r, i, stream, msg, sizeof(msg));
    st.marks.fetch_add(1, std::memory_order_relaxed);
    if (kind != 0) raise_error(st.errors[kind], msg);
    return outputs;
  }
};

// One reducer's hooks. Owns the accumulators (keeping each hook's node alive,
// as torch DDP's reducer does) and the Python objects the hooks borrow.
class HookSet {
 public:
  HookSet(std::vector<std::vector<at::Tensor>> params, uintptr_t engine, uintptr_t mark,
          py::object fallback, py::object began, py::object reduce_error,
          py::object usage_error, std::vector<py::bytearray> handed, std::vector<int> devices,
          std::optional<std::tuple<uintptr_t, uintptr_t, uintptr_t>> source, py::object translate)
      : state_(std::make_shared<State>()),
        fallback_(std::move(fallback)),
        began_(std::move(began)),
        reduce_error_(std::move(reduce_error)),
        usage_error_(std::move(usage_error)),
        handed_(std::move(handed)),
        translate_(std::move(translate)) {
    State& s = *state_;
    s.engine = reinterpret_cast<void*>(engine);
    s.mark = reinterpret_cast<MarkFn>(mark);
    s.fallback = fallback_.ptr();
    s.began = began_.is_none() ? nullptr : began_.ptr();
    s.errors[1] = reduce_error_.ptr();
    s.errors[2] = usage_error_.ptr();
    s.errors[3] = PyExc_RuntimeError;
    s.params = std::move(params);
    TORCH_CHECK(devices.empty() || devices.size() == s.params.size(),
                "pyddp._hot: a device per replica, or none (CPU replicas)");
    s.devices = std::move(devices);
    if (source.has_value()) {
      s.current = reinterpret_cast<CurrentFn>(std::get<0>(*source));
      s.before_write = reinterpret_cast<BeforeWriteFn>(std::get<1>(*source));
      s.produced = reinterpret_cast<ProducedFn>(std::get<2>(*source));
      TORCH_CHECK(s.current != nullptr, "pyddp._hot: a stream source without current()");
    } else if (!s.devices.empty()) {
      TORCH_CHECK(!translate_.is_none(), "pyddp._hot: GPU replicas need translate or a source");
    }
    s.translate = translate_.is_none() ? nullptr : translate_.ptr();
    s.views.resize(s.params.size());
    s.slots.resize(s.params.size());
    TORCH_CHECK(handed_.size() == s.params.size(), "pyddp._hot: one bytearray per replica");
    accumulators_.resize(s.params.size());
    for (size_t r = 0; r < s.params.size(); ++r) {
      s.views[r].resize(s.params[r].size());
      s.slots[r].resize(s.params[r].size());
      auto* bytes = reinterpret_cast<uint8_t*>(PyByteArray_AsString(handed_[r].ptr()));
      TORCH_CHECK(static_cast<size_t>(PyByteArray_Size(handed_[r].ptr())) == s.params[r].size(),
                  "pyddp._hot: a handed bytearray per parameter");
      s.handed.push_back(bytes);
      accumulators_[r].resize(s.params[r].size());
      refresh(static_cast<int>(r));
    }
  }

  // Replica r's hooks on the accumulators its parameters have now. torch
  // makes a parameter a new one when its data changes dtype or device
  // (Module._apply: .half().float(), .to(...)); the old one never runs
  // again. Called before each forward (Reducer.prepare), on the thread and
  // with the streams the replica's forward runs with: a C++ loop.
  //
  // On GPUs an accumulator runs on the stream that was current when torch
  // made it, and holding it (as these hooks must) keeps that stream. Made at
  // wrap on the default stream, it would make every later backward on
  // another stream wait on the default stream, and a backward captured into a
  // CUDA graph fail ("operation would make the legacy stream depend on a
  // capturing blocking stream", seen on an H200). So an accumulator made on
  // another stream than this forward's is let go, and the one torch then
  // makes here is hooked instead; where a graph still holds the old one
  // (a loss kept alive), it stays, hook and all.
  void refresh(int r) {
    State& s = *state_;
    TORCH_CHECK(r >= 0 && static_cast<size_t>(r) < s.params.size(), "replica out of range");
    std::optional<c10::Stream> now;  // torch's streams on GPU replicas (not a source's)
    if (!s.devices.empty() && s.current == nullptr) {
      now = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
                ->getStream(c10::Device(c10::DeviceType::CUDA,
                                        static_cast<c10::DeviceIndex>(s.devices[r])));
    }
    for (size_t i = 0; i < s.params[r].size(); ++i) {
      auto& held = accumulators_[r][i];
      auto acc = torch::autograd::impl::grad_accumulator(s.params[r][i]);
      // None while frozen (requires_grad=False): no gradient to mark; the
      // model's follow names what changed (replicas/mirror.py).
      if (!acc) continue;
      if (acc.get() == held.get()) {
        const auto made_on = acc->stream();
        if (!now.has_value() || !made_on.has_value() || *made_on == *now) continue;
        // Held by a graph too (beyond `acc` and `held`; the parameter holds
        // it weakly): it stays, hooked already. (use_count: torch's node
        // pointer is a shared_ptr in some versions, an intrusive_ptr in others.)
        if (acc.use_count() > 2) continue;
        acc.reset();
        held.reset();  // the node goes: torch makes the next one on this stream
        acc = torch::autograd::impl::grad_accumulator(s.params[r][i]);
        if (!acc) continue;
        rebound_.fetch_add(1);
      }
      acc->add_post_hook(std::make_unique<MarkHook>(state_, r, static_cast<int>(i)));
      held = std::move(acc);
    }
  }

  // The bucket views of replica r (None where it has none) and where each was
  // laid out (0: untracked; a view elsewhere goes to Python), after each layout.
  void set_views(int r, const std::vector<std::optional<at::Tensor>>& views,
                 const std::vector<uintptr_t>& slots) {
    State& s = *state_;
    TORCH_CHECK(r >= 0 && static_cast<size_t>(r) < s.views.size(), "replica out of range");
    TORCH_CHECK(views.size() == s.views[r].size() && slots.size() == views.size(),
                "one view and one address per parameter");
    for (size_t i = 0; i < views.size(); ++i) {
      s.views[r][i] = views[i].has_value() ? *views[i] : at::Tensor();
      s.slots[r][i] = slots[i];
    }
  }

  // One view of replica r and where it lies (a gradient reseated in its slice).
  void set_view(int r, int i, const at::Tensor& view, uintptr_t slot) {
    State& s = *state_;
    TORCH_CHECK(r >= 0 && static_cast<size_t>(r) < s.views.size(), "replica out of range");
    TORCH_CHECK(i >= 0 && static_cast<size_t>(i) < s.views[r].size(), "parameter out of range");
    s.views[r][i] = view;
    s.slots[r][i] = slot;
  }

  void set_python_only(bool on) { state_->python_only.store(on); }
  void arm_began() { state_->began_due.store(true); }
  int64_t adopted() const { return state_->adopted.load(); }
  int64_t marks() const { return state_->marks.load(); }
  int64_t rebound() const { return rebound_.load(); }

  // Hooks do nothing from now on; the nodes (and with them the hooks) go
  // once no graph holds them.
  void remove() {
    state_->enabled.store(false, std::memory_order_release);
    accumulators_.clear();
  }

 private:
  std::shared_ptr<State> state_;
  std::atomic<int64_t> rebound_{0};  // accumulators let go for one on the forward's stream
  std::vector<
      std::vector<decltype(torch::autograd::impl::grad_accumulator(std::declval<at::Tensor>()))>>
      accumulators_;  // [replica][parameter]
  py::object fallback_, began_, reduce_error_, usage_error_;
  std::vector<py::bytearray> handed_;
  py::object translate_;
};

}  // namespace

void bind_wire(py::module_& m);  // wire.cpp

PYBIND11_MODULE(_hot, m) {
  m.doc() = "pyddp's torch-linked hot path (private; see pyddp.runtime.libraries.hot)";
  m.attr("TORCH_VERSION") = PYDDP_TORCH_VERSION;
  py::class_<HookSet>(m, "HookSet")
      .def(py::init<std::vector<std::vector<at::Tensor>>, uintptr_t, uintptr_t, py::object,
                    py::object, py::object, py::object, std::vector<py::bytearray>,
                    std::vector<int>, std::optional<std::tuple<uintptr_t, uintptr_t, uintptr_t>>,
                    py::object>(),
           py::arg("params"), py::arg("engine"), py::arg("mark"), py::arg("fallback"),
           py::arg("began"), py::arg("reduce_error"), py::arg("usage_error"), py::arg("handed"),
           py::arg("devices") = std::vector<int>{}, py::arg("source") = py::none(),
           py::arg("translate") = py::none())
      .def("set_views", &HookSet::set_views, py::arg("replica"), py::arg("views"),
           py::arg("slots"))
      .def("set_view", &HookSet::set_view, py::arg("replica"), py::arg("param"), py::arg("view"),
           py::arg("slot"))
      .def("set_python_only", &HookSet::set_python_only, py::arg("on"))
      .def("arm_began", &HookSet::arm_began)
      .def("adopted", &HookSet::adopted)
      .def("marks", &HookSet::marks)
      .def("rebound", &HookSet::rebound)
      .def("refresh", &HookSet::refresh, py::arg("replica"))
      .def("remove", &HookSet::remove);
  bind_wire(m);
}
