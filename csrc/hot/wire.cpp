// pyddp._hot, the cross-process half: a bucket's launch on the link's gloo
// group and its completion, in C++ (c10d from libtorch), without the
// interpreter lock. _C's ProcessGroupBackend calls the launch through a plain
// C entry point (pyddp_hot_launch) on the engine's launcher thread; gloo's
// worker thread completes the bucket in the flight record. Python is asked
// (the entry point answers "not mine") for what needs it: a communication
// hook, reduce-scatter under sharded gradients, the last bucket when the
// agreement's room was not filled at the end of a forward, a link that failed
// (the Python launch raises its error). Python waits on the same record, so
// its own launches (the agreement's tail, hooks) and these complete alike.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/extension.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

int64_t now_ns() {
  // std::chrono::steady_clock is CLOCK_MONOTONIC: Python's time.monotonic_ns.
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The reductions launched in one synced backward and their completion, from
// whichever thread completes them (the Python path's _InFlight, in C++).
// Callbacks hold only this record, never the Wire (and with it the group):
// the last reference to a group dropped on gloo's own thread would join that
// very thread.
class Flight {
 public:
  void launched(int bucket) {
    std::lock_guard<std::mutex> lk(mu_);
    ++pending_;
    order_.push_back(bucket);
  }

  void finished(int bucket, std::optional<std::string> error) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      done_ns_[bucket] = now_ns();
      if (error.has_value()) errors_[bucket] = std::move(*error);
      --pending_;
    }
    cv_.notify_all();
  }

  // Waits at most `seconds` for every launch to complete or one to fail;
  // whether that happened.
  bool settle(double seconds) {
    std::unique_lock<std::mutex> lk(mu_);
    return cv_.wait_for(lk, std::chrono::duration<double>(seconds),
                        [&] { return pending_ == 0 || !errors_.empty(); });
  }

  // (launched in order, errors, still pending, done buckets)
  py::tuple snapshot() {
    std::lock_guard<std::mutex> lk(mu_);
    py::list done;
    for (const auto& kv : done_ns_) done.append(kv.first);
    return py::make_tuple(order_, errors_, pending_, done);
  }

  // Starts the next iteration; returns this one's completion times.
  std::map<int, int64_t> next(int tail) {
    std::lock_guard<std::mutex> lk(mu_);
    std::map<int, int64_t> done;
    for (const auto& kv : done_ns_) {
      if (kv.first != tail) done.insert(kv);
    }
    order_.clear();
    done_ns_.clear();
    return done;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int pending_ = 0;
  std::vector<int> order_;
  std::map<int, std::string> errors_;
  std::map<int, int64_t> done_ns_;
};

// The first line of an error, as pyddp's messages quote it (groups.first_line).
std::string first_line(const std::string& what) {
  const auto end = what.find('\n');
  return end == std::string::npos ? what : what.substr(0, end);
}

class Wire {
 public:
  // `group`: the link's own gloo group (dist.ProcessGroupGloo, a c10d
  // Backend; groups.own_group makes it).
  Wire(const c10::intrusive_ptr<c10d::Backend>& group, int world)
      : group_(group), world_(world), flight_(std::make_shared<Flight>()) {
    TORCH_CHECK(world_ >= 1, "pyddp._hot.Wire: world ", world_);
  }

  // Replica 0's buckets (empty: every launch goes to Python), and `wire`,
  // the last bucket followed by the agreement's room (undefined: it does not
  // ride). Called by Python while no launch runs (between backwards).
  void set_buckets(std::vector<at::Tensor> flats, std::optional<at::Tensor> wire) {
    std::lock_guard<std::mutex> lk(mu_);
    flats_ = std::move(flats);
    wire_ = wire.has_value() ? *wire : at::Tensor();
    armed_.store(false);
  }

  // The agreement's room was filled on the caller's thread (transport.arm).
  void arm(bool on) { armed_.store(on); }
  bool armed() const { return armed_.load(); }
  // Nothing more from C++: a failed link, whose Python launch raises.
  void stop() { stopped_.store(true); }
  int64_t launches() const { return launches_.load(); }
  std::shared_ptr<Flight> flight() const { return flight_; }

  // Whether launch(bucket) would launch it here (not answer 1), as things
  // stand: no Python needed for it.
  bool takes(int bucket) {
    std::lock_guard<std::mutex> lk(mu_);
    return mine_locked(bucket);
  }

  // 0: launched; 1: Python launches it; -1: failed, `msg` says why.
  int launch(int bucket, char* msg, size_t len) {
    try {
      std::lock_guard<std::mutex> lk(mu_);
      if (!mine_locked(bucket)) return 1;
      at::Tensor& flat = flats_[bucket];
      at::Tensor send = flat;
      if (rides_locked(bucket)) {
        armed_.store(false);  // filled once, sent once
        send = wire_;
      }
      {
        at::NoGradGuard no_grad;
        // Averaged across processes (torch DDP's convention), divided before
        // the sum so 16-bit gradients do not overflow in transit.
        if (world_ > 1) flat.div_(world_);
      }
      std::vector<at::Tensor> tensors{send};
      auto work = group_->allreduce(tensors);
      flight_->launched(bucket);
      launches_.fetch_add(1, std::memory_order_relaxed);
      std::shared_ptr<Flight> flight = flight_;
      work->getFuture()->addCallback([flight, bucket](c10::ivalue::Future& f) {
        std::optional<std::string> error;
        if (f.hasError()) error = first_line(f.tryRetrieveErrorMessage());
        flight->finished(bucket, std::move(error));
      });
      return 0;
    } catch (const std::exception& e) {
      std::snprintf(msg, len, "%s", first_line(e.what()).c_str());
      return -1;
    }
  }

 private:
  // The last bucket, when the agreement's room follows it.
  bool rides_locked(int bucket) const {
    return wire_.defined() && static_cast<size_t>(bucket) + 1 == flats_.size();
  }
  // Launched here, not by Python: the link up, the bucket known, and for
  // the riding bucket its room filled (else the rider fills it in Python).
  bool mine_locked(int bucket) const {
    if (stopped_.load() || bucket < 0 || static_cast<size_t>(bucket) >= flats_.size()) return false;
    return !rides_locked(bucket) || armed_.load();
  }

  std::mutex mu_;  // set_buckets vs a launch
  c10::intrusive_ptr<c10d::Backend> group_;
  const int world_;
  std::shared_ptr<Flight> flight_;
  std::vector<at::Tensor> flats_;
  at::Tensor wire_;
  std::atomic<bool> armed_{false};
  std::atomic<bool> stopped_{false};
  std::atomic<int64_t> launches_{0};
};

}  // namespace

// The launch _C's ProcessGroupBackend calls from the launcher thread.
extern "C" int pyddp_hot_launch(void* wire, int bucket, char* msg, size_t len) {
  return static_cast<Wire*>(wire)->launch(bucket, msg, len);
}

// Whether the launch would be made here (_C's engine then launches from the
// thread that completed the bucket).
extern "C" int pyddp_hot_takes(void* wire, int bucket) {
  return static_cast<Wire*>(wire)->takes(bucket) ? 1 : 0;
}

void bind_wire(py::module_& m) {
  py::class_<Flight, std::shared_ptr<Flight>>(m, "Flight")
      .def(py::init<>())
      .def("launched", &Flight::launched, py::arg("bucket"))
      .def("finished", &Flight::finished, py::arg("bucket"), py::arg("error"))
      .def("settle", &Flight::settle, py::arg("seconds"), py::call_guard<py::gil_scoped_release>())
      .def("snapshot", &Flight::snapshot)
      .def("next", &Flight::next, py::arg("tail"));
  py::class_<Wire>(m, "Wire")
      .def(py::init<const c10::intrusive_ptr<c10d::Backend>&, int>(), py::arg("group"),
           py::arg("world"))
      .def("set_buckets", &Wire::set_buckets, py::arg("flats"), py::arg("wire"))
      .def("arm", &Wire::arm, py::arg("on"))
      .def("armed", &Wire::armed)
      .def("stop", &Wire::stop)
      .def("launches", &Wire::launches)
      .def("flight", &Wire::flight)
      .def("entry",
           [](Wire& w) {
             return py::make_tuple(reinterpret_cast<uintptr_t>(&w),
                                   reinterpret_cast<uintptr_t>(&pyddp_hot_launch));
           },
           "(this wire, pyddp_hot_launch): for _C.ProcessGroupBackend's hot launch.")
      .def("takes_entry",
           [](Wire&) { return reinterpret_cast<uintptr_t>(&pyddp_hot_takes); },
           "pyddp_hot_takes(wire, bucket): whether the Wire launches that bucket itself.");
}
