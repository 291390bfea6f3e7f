// A host-side simulation of the slice of the CUDA driver API, NCCL and NVRTC
// that pyddp loads, for testing pyddp's GPU path on machines without a GPU.
// Test double only: built by the test suite, selected through
// PYDDP_CUDA_LIBRARY / PYDDP_NCCL_LIBRARY / PYDDP_NVRTC_LIBRARY, never shipped.
//
// It implements the documented semantics, and every rule it enforces cites the
// documentation it comes from ([CUDA] = CUDA Driver API reference, [PG] = CUDA
// C++ Programming Guide, [NCCL] = NCCL user guide / nccl.h, [NVRTC] = NVRTC
// user guide). "Device memory" is host memory. Each stream is a host thread
// running its queue in order, with an optional per-stream delay so a missing
// wait produces wrong values instead of passing by luck. Kernels run a host
// compilation of pyddp's reduce_kernels.cu over the launch's grid. Rule
// violations return the documented error code and are also logged for the
// tests (simgpu_violations).
//
// Ranks finish a collective at different times (SIMGPU_SKEW_US per rank), as
// on real hardware; late gradient writes on producing streams are the test
// stream provider's part (simgpu.py, SimStreams.produced).
//
// Simplifications (documented so nobody mistakes them for the real thing): the
// legacy default stream does not synchronise implicitly with other blocking
// streams; collectives reduce in rank order with one rounding per hop; what is
// not modelled at all is listed in docs/gpus.md.
// Communicators meet through POSIX shared memory named after the unique id, so
// ncclCommInitRank works across processes as well as within one.
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernel_shim.h"

thread_local simgpu_dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace simk {
#include "reduce_kernels.cu"
}

#define API extern "C" __attribute__((visibility("default")))

namespace {

// ---------------------------------------------------------------- errors
enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_DEINITIALIZED = 4,
  CUDA_ERROR_INVALID_IMAGE = 200,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_NO_BINARY_FOR_GPU = 209,
  CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_ILLEGAL_ADDRESS = 700,
  CUDA_ERROR_INVALID_DEVICE = 101,
};
enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
};

std::mutex g_log_mu;
std::vector<std::string> g_violations;
std::map<std::string, long> g_counters;
std::atomic<bool> g_unloaded{false};

int violation(int code, const std::string& what) {
  std::lock_guard<std::mutex> lk(g_log_mu);
  g_violations.push_back(what);
  std::fprintf(stderr, "simgpu: rule violated: %s\n", what.c_str());
  return code;
}
// The test harness's own waits (SimStreams draining a stream in place of
// torch's stream order) are not the host waits pyddp makes: not counted.
thread_local bool t_harness = false;

void bump(const char* name) {
  std::lock_guard<std::mutex> lk(g_log_mu);
  ++g_counters[name];
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}
double hang_s() {
  const char* v = std::getenv("SIMGPU_HANG_S");
  return v && *v ? std::atof(v) : 5.0;
}

// ---------------------------------------------------------------- driver
std::atomic<bool> g_initialized{false};
constexpr int kMaxDevices = 8;

struct Ctx {
  int device;
};
Ctx g_ctx[kMaxDevices] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
thread_local Ctx* t_current = nullptr;  // [CUDA] "the calling CPU thread's current context"

int num_devices() { return std::min(kMaxDevices, env_int("SIMGPU_DEVICES", 4)); }
int driver_version() { return env_int("SIMGPU_DRIVER_VERSION", 12040); }
int compute_capability() { return env_int("SIMGPU_CC", 80); }

// Which work is ordered before which: a vector clock per stream (stream id ->
// the last position of that stream known to have run before this point),
// advanced as a stream runs its ops and merged through event waits. It is
// what the caching allocator's reuse rule below is checked against, so the
// verdict depends on the order the program asked for, never on timing.
using Clock = std::map<int, uint64_t>;
void merge(Clock& into, const Clock& from) {
  for (const auto& [id, pos] : from) into[id] = std::max(into[id], pos);
}

struct Event {
  Ctx* ctx;
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;   // generation of the latest cuEventRecord
  uint64_t completed = 0;  // generation the stream reached
  std::map<uint64_t, Clock> clocks;  // generation -> the recording stream's clock there
  unsigned flags = 0;
  std::chrono::steady_clock::time_point at;  // when the latest completed generation completed
  struct Capture* captured_in = nullptr;  // last recorded in this capture (g_capture_mu)
};

struct Op {
  std::function<void()> run;  // a kernel, a copy, a collective
  // Captured: called at each graph launch as the op is queued again (an
  // NCCL collective counts itself pending on its communicator there).
  std::function<void()> replayed;
  Event* wait = nullptr;      // cuStreamWaitEvent: wait until completed >= gen
  Event* record = nullptr;    // cuEventRecord: completed = gen
  uint64_t gen = 0;
};

struct Stream {
  Ctx* ctx;
  int id = 0;
  Clock clock;  // guarded by mu
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Op> queue;
  uint64_t enqueued = 0, done = 0;
  std::atomic<long> delay_us{0};
  bool destroyed = false;
  std::thread thread;
  struct Capture* capture = nullptr;  // the capture it belongs to (g_capture_mu)
};

// ---------------------------------------------------------------- stream capture
// [CUDA Programming Guide, "Stream Capture"; cuStreamBeginCapture]: between
// cuStreamBeginCapture and cuStreamEndCapture on a stream, the work queued on
// it is recorded into a graph, not run; a stream that waits on an event
// recorded in the capture joins it ("cross-stream dependencies"), and every
// stream that joined must be joined back into the origin stream before the
// capture ends. Rules enforced, each with the driver's error:
// - querying or synchronizing a capturing stream: 900 (UNSUPPORTED), and the
//   capture is invalidated (its end returns 901 and no graph);
// - querying or synchronizing an event last recorded in a capture: 907;
// - waiting from a capturing stream on an event recorded outside the capture
//   (without cudaEventWaitExternal): 905 (ISOLATION), invalidating;
// - waiting from one capture on another's event: 902 (MERGE);
// - ending on a stream other than the origin: 903 (UNMATCHED); from another
//   thread unless the mode is relaxed: 908; with a joined stream's last work
//   not waited for by the origin: 904 (UNJOINED) and no graph;
// - a query or synchronize of any event or stream from a thread barred by
//   a capture's mode (unsafe_during_capture below): 900, invalidating;
// - the test provider's allocations and host writes on a capturing stream
//   (pyddp must allocate and write before capture): refused by name.
// NCCL collectives on a capturing stream are captured and run at each launch.
// A joined stream counts as joined back when some op of the origin follows
// its last captured op, through stream order and event waits (across any
// number of streams).
// A graph launch replays the captured work in capture order: the origin's on
// the launch stream, every other stream's on a stream of the graph's own
// (same device), with the captured events as events of the graph's own.
enum CapKind { kCapRun, kCapRecord, kCapWait };
struct CapOp {
  Stream* stream;
  CapKind kind;
  std::function<void()> run;
  Event* event = nullptr;
  std::function<void()> replayed;  // Op::replayed
};
struct Capture {
  Stream* origin;
  int mode;
  std::thread::id thread;
  std::vector<CapOp> ops;
  std::map<Stream*, size_t> last;  // member -> index of its last op
  std::set<Stream*> members;
  std::set<Event*> events;
  int error = 0;
  unsigned long long id = 0;
};
struct Graph {
  Stream* origin;
  std::vector<CapOp> ops;
};
struct GraphExec {
  Stream* origin;
  std::vector<CapOp> ops;
  std::map<Stream*, Stream*> streams;  // captured stream -> the graph's own
  std::map<Event*, Event*> events;     // captured event -> the graph's own
};
std::mutex g_capture_mu;
std::set<void*> g_graphs, g_execs;
std::set<Capture*> g_active;  // begun, not yet ended (invalidated ones too)
unsigned long long g_next_capture_id = 1;
constexpr int CU_STREAM_CAPTURE_MODE_GLOBAL = 0;
constexpr int CU_STREAM_CAPTURE_MODE_RELAXED = 2;
// [CUDA] cuThreadExchangeStreamCaptureMode: this thread's capture mode.
thread_local int t_capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;

std::mutex g_handles_mu;
std::set<void*> g_streams, g_events;
Stream* g_null_stream[kMaxDevices] = {};
std::atomic<long> g_default_delay_us{0};
std::atomic<int> g_next_stream_id{1};
thread_local Stream* t_stream = nullptr;  // the stream whose op this thread runs
thread_local uint64_t t_pos = 0;          // and that op's position in it

void stream_loop(Stream* s) {
  for (;;) {
    Op op;
    uint64_t pos;
    {
      std::unique_lock<std::mutex> lk(s->mu);
      s->cv.wait(lk, [&] { return !s->queue.empty() || s->destroyed; });
      if (s->queue.empty()) return;  // destroyed and drained: resources released
      op = std::move(s->queue.front());
      pos = s->done + 1;
    }
    const long delay = s->delay_us.load();
    if (delay > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
    if (op.wait) {
      Clock before;
      {
        std::unique_lock<std::mutex> lk(op.wait->mu);
        op.wait->cv.wait(lk, [&] { return op.wait->completed >= op.gen; });
        auto it = op.wait->clocks.lower_bound(op.gen);
        if (it != op.wait->clocks.end()) before = it->second;
      }
      std::lock_guard<std::mutex> lk(s->mu);
      merge(s->clock, before);
    }
    {
      std::lock_guard<std::mutex> lk(s->mu);
      s->clock[s->id] = pos;
    }
    t_stream = s;
    t_pos = pos;
    if (op.run) op.run();
    // The op is done for every observer at once: an event found complete
    // means its stream is past it (cuStreamQuery idle if nothing follows),
    // and a synchronised stream has completed its events.
    std::lock_guard<std::mutex> lk(s->mu);
    if (op.record) {
      std::lock_guard<std::mutex> le(op.record->mu);
      auto& clocks = op.record->clocks;
      clocks[op.gen] = s->clock;
      while (clocks.size() > 64) clocks.erase(clocks.begin());
      if (op.gen > op.record->completed) op.record->at = std::chrono::steady_clock::now();
      op.record->completed = std::max(op.record->completed, op.gen);
      op.record->cv.notify_all();
    }
    s->queue.pop_front();
    ++s->done;
    s->cv.notify_all();
  }
}

Stream* new_stream(Ctx* ctx) {
  auto* s = new Stream;
  s->ctx = ctx;
  s->id = g_next_stream_id++;
  s->delay_us = g_default_delay_us.load();
  s->thread = std::thread(stream_loop, s);
  s->thread.detach();  // lives until destroyed and drained
  std::lock_guard<std::mutex> lk(g_handles_mu);
  g_streams.insert(s);
  return s;
}

// Resolves a stream handle. 0 (and CU_STREAM_LEGACY = 1, CU_STREAM_PER_THREAD
// = 2) name the default stream of the *current* context [CUDA, "Stream
// synchronization behavior"], so they need one.
int resolve(void* handle, Stream** out) {
  const auto h = reinterpret_cast<uintptr_t>(handle);
  if (h <= 2) {
    if (t_current == nullptr) {
      return violation(CUDA_ERROR_INVALID_CONTEXT,
                       "the default stream (handle 0) used with no current context");
    }
    std::lock_guard<std::mutex> lk(g_handles_mu);
    Stream*& s = g_null_stream[t_current->device];
    if (s == nullptr) {
      s = new Stream;
      s->ctx = t_current;
      s->id = g_next_stream_id++;
      s->delay_us = g_default_delay_us.load();
      s->thread = std::thread(stream_loop, s);
      s->thread.detach();
      g_streams.insert(s);
    }
    *out = s;
    return CUDA_SUCCESS;
  }
  std::lock_guard<std::mutex> lk(g_handles_mu);
  if (!g_streams.count(handle)) {
    return violation(CUDA_ERROR_INVALID_HANDLE, "unknown or destroyed stream handle");
  }
  *out = static_cast<Stream*>(handle);
  return CUDA_SUCCESS;
}

// Under g_capture_mu: ends `c` for every stream and event in it.
void end_capture_locked(Capture* c) {
  for (Stream* m : c->members) m->capture = nullptr;
  for (Event* e : c->events) {
    if (e->captured_in == c) e->captured_in = nullptr;
  }
}
// A call the capture rules forbid on `s` while it captures: `code`, the
// capture invalidated (its end returns 901 and no graph).
int capture_forbids(Stream* s, int code, const std::string& what) {
  {
    std::lock_guard<std::mutex> lc(g_capture_mu);
    Capture* c = s->capture;
    if (c == nullptr) return CUDA_SUCCESS;
    if (c->error == 0) c->error = code;
  }
  return violation(code, what);
}

// [CUDA] cuThreadExchangeStreamCaptureMode / cuStreamBeginCapture's mode:
// a thread is prohibited from "potentially unsafe API calls" (here: a
// query or synchronize of an event or a stream) while it has a capture of
// its own begun in a mode other than RELAXED, unless its thread mode is
// RELAXED; and, in the GLOBAL thread mode (the default), while any other
// thread has a capture begun in GLOBAL mode. Such a call fails with 900
// and invalidates that capture: torch's NCCL watchdog querying its events
// during a capture on another thread is the known case (c10d queries them
// in the thread-local mode since). The test harness's own waits are exempt.
int unsafe_during_capture(const std::string& what) {
  if (t_harness) return CUDA_SUCCESS;
  const auto me = std::this_thread::get_id();
  Capture* hit = nullptr;
  {
    std::lock_guard<std::mutex> lc(g_capture_mu);
    for (Capture* c : g_active) {
      const bool own = c->thread == me && c->mode != CU_STREAM_CAPTURE_MODE_RELAXED &&
                       t_capture_mode != CU_STREAM_CAPTURE_MODE_RELAXED;
      const bool other = c->thread != me && c->mode == CU_STREAM_CAPTURE_MODE_GLOBAL &&
                         t_capture_mode == CU_STREAM_CAPTURE_MODE_GLOBAL;
      if (own || other) {
        hit = c;
        if (c->error == 0) c->error = 900;
        break;
      }
    }
  }
  if (hit == nullptr) return CUDA_SUCCESS;
  return violation(900, what + " while a capture in global mode is under way (a potentially unsafe "
                               "call: make it from a thread in the thread-local or relaxed capture "
                               "mode, cuThreadExchangeStreamCaptureMode, or not during capture)");
}

int check_event(void* handle) {
  std::lock_guard<std::mutex> lk(g_handles_mu);
  if (!g_events.count(handle)) {
    return violation(CUDA_ERROR_INVALID_HANDLE, "unknown or destroyed event handle");
  }
  return CUDA_SUCCESS;
}

// Returns the op's position in the stream (a capturing stream records a
// run op into its capture instead: 0).
uint64_t enqueue(Stream* s, Op op) {
  if (op.run && !op.wait && !op.record) {
    std::lock_guard<std::mutex> lc(g_capture_mu);
    if (Capture* c = s->capture) {
      c->last[s] = c->ops.size();
      c->ops.push_back(CapOp{s, kCapRun, std::move(op.run), nullptr, std::move(op.replayed)});
      return 0;
    }
  }
  std::lock_guard<std::mutex> lk(s->mu);
  s->queue.push_back(std::move(op));
  ++s->enqueued;
  s->cv.notify_all();
  return s->enqueued;
}

// A stream handle resolved in `device`'s context (0: its default stream).
int resolve_on(int device, void* handle, Stream** out) {
  Ctx* saved = t_current;
  t_current = &g_ctx[device];
  const int rc = resolve(handle, out);
  t_current = saved;
  return rc;
}

// ---------------------------------------------------------------- memory
// Device memory: allocations made through the test stream provider
// (SimStreams.zeros, simgpu.py) are registered here with their device and the
// stream they were allocated on, and carry canary bytes before and after,
// checked after every kernel and every collective. Rules:
// - every buffer a collective or a kernel touches lies inside one live
//   allocation of the device it runs on: anything else is another device's
//   memory, memory the GPU cannot address, or a write past an allocation, an
//   illegal address. [CUDA, "Error handling"]: cudaErrorIllegalAddress /
//   CUDA_ERROR_ILLEGAL_ADDRESS "leaves the process in an inconsistent state
//   and any further CUDA work will return the same error": the device's
//   context is dead for good (sticky), every later call on it returns 700, and
//   NCCL reports ncclUnhandledCudaError.
// - torch's caching allocator: a freed block goes back to the pool of the
//   stream it was allocated on and the next allocation on that stream may take
//   it at once; its new owner's work is ordered after that stream's work only.
//   Every earlier use of the block by another stream must therefore be ordered
//   before the reuse, through the allocation stream's waits or through
//   Tensor.record_stream (SimStreams.retire), which delays the reuse until the
//   recorded streams pass the point of the free [torch, "CUDA semantics:
//   memory management" and Tensor.record_stream]. The simulation frees nothing
//   early (host memory has no streams): it checks the rule with the streams'
//   vector clocks when the free's markers have run, whatever the timing.
constexpr unsigned char kCanary = 0xA5;
enum BlockState { kLive = 0, kFreeing, kFreedUnsafely, kReleasable };
struct Guarded {
  char* base;
  size_t lead, body, tail;
  int device;
  Stream* alloc = nullptr;  // the allocation stream
  std::map<int, uint64_t> uses;  // stream id -> last position that used the block
  std::map<int, int> pending;    // stream id -> NCCL calls using it, not queued there yet
  BlockState state = kLive;
};
std::mutex g_mem_mu;
std::map<uintptr_t, Guarded> g_guarded;  // by body address
std::map<int, int> g_stream_device;      // stream id -> device, for messages
std::atomic<int> g_sticky[kMaxDevices] = {};
std::atomic<int> g_free_checks{0};  // frees whose markers have not all run
// What the host saw complete (a stream or event synchronised, an event found
// complete): work ordered before a later free by the host itself.
Clock g_host_clock;  // guarded by g_mem_mu
void host_saw(const Clock& c) {
  std::lock_guard<std::mutex> lk(g_mem_mu);
  merge(g_host_clock, c);
}
void host_saw_stream(Stream* s) {
  Clock c;
  {
    std::lock_guard<std::mutex> lk(s->mu);
    c = s->clock;
  }
  host_saw(c);
}
void host_saw_event(Event* e, uint64_t gen) {
  Clock c;
  {
    std::lock_guard<std::mutex> lk(e->mu);
    auto it = e->clocks.find(gen);
    if (it == e->clocks.end()) return;
    c = it->second;
  }
  host_saw(c);
}

bool canary_intact(const char* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (static_cast<unsigned char>(p[i]) != kCanary) return false;
  }
  return true;
}

void kill_context(int device, const std::string& what) {
  int expected = 0;
  if (g_sticky[device].compare_exchange_strong(expected, CUDA_ERROR_ILLEGAL_ADDRESS)) {
    violation(CUDA_ERROR_ILLEGAL_ADDRESS, what + " (cuda:" + std::to_string(device) +
                                              "'s context is dead from now on)");
  }
}

// After a kernel or a collective on `device`: every guard zone intact?
void check_guards(int device, const char* after) {
  std::lock_guard<std::mutex> lk(g_mem_mu);
  for (auto& [addr, g] : g_guarded) {
    if (!canary_intact(g.base, g.lead) || !canary_intact(g.base + g.lead + g.body, g.tail)) {
      kill_context(device, std::string("illegal address: a write past an allocation of ") +
                               std::to_string(g.body) + " bytes on cuda:" +
                               std::to_string(g.device) + ", seen after " + after);
      std::memset(g.base, kCanary, g.lead);  // reported once
      std::memset(g.base + g.lead + g.body, kCanary, g.tail);
    }
  }
}

// The allocation [p, p + 1) lies in (body, guard zones included), or null.
// Caller holds g_mem_mu.
Guarded* block_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (auto it = g_guarded.upper_bound(a + (1u << 20)); it != g_guarded.begin();) {
    --it;
    const Guarded& g = it->second;
    const auto lo = reinterpret_cast<uintptr_t>(g.base), hi = it->first + g.body + g.tail;
    if (a >= lo && a < hi) return &it->second;
    if (hi + (1u << 20) < a) break;  // guard zones are far smaller than 1 MiB
  }
  return nullptr;
}

std::string stream_name(int id) {
  return "stream #" + std::to_string(id) + " of cuda:" + std::to_string(g_stream_device[id]);
}

// Before a collective or a kernel on `device` uses [p, p + bytes): inside one
// live allocation of that device? Records the use by `s` at `pos` (0: at the
// time it runs, see note_use).
bool device_memory(int device, const void* p, size_t bytes, const char* what) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::string wrong;
  {
    std::lock_guard<std::mutex> lk(g_mem_mu);
    Guarded* g = block_of(p);
    const auto body = g ? reinterpret_cast<uintptr_t>(g->base) + g->lead : 0;
    if (g == nullptr) {
      wrong = std::string("not memory of a simulated GPU: ") + what + " of " +
              std::to_string(bytes) +
              " bytes at an address no provider allocation holds (every buffer a collective or "
              "kernel touches comes from the stream provider, which gives it a device)";
    } else if (g->device != device) {
      wrong = std::string("cuda:") + std::to_string(g->device) + "'s memory given to cuda:" +
              std::to_string(device) + ": " + what + " of " + std::to_string(bytes) + " bytes";
    } else if (a < body || a + bytes > body + g->body) {
      wrong = std::string("illegal address: ") + what + " of " + std::to_string(bytes) +
              " bytes outside its allocation of " + std::to_string(g->body) + " bytes";
    } else if (g->state != kLive) {
      wrong = std::string("use after free: ") + what + " of " + std::to_string(bytes) +
              " bytes in an allocation of cuda:" + std::to_string(device) +
              " the program already freed";
    }
  }
  if (wrong.empty()) return true;
  kill_context(device, wrong);
  return false;
}

// An op that uses [p, ...) was queued on `s` at position `pos`, recorded for
// the allocator rule at once, so a free checked before the op runs still
// sees it (pos 0: captured, recorded when a graph launch runs it).
void note_use_at(Stream* s, const void* p, uint64_t pos) {
  if (s == nullptr || pos == 0 || p == nullptr) return;
  std::lock_guard<std::mutex> lk(g_mem_mu);
  if (Guarded* g = block_of(p)) {
    uint64_t& last = g->uses[s->id];
    last = std::max(last, pos);
    g_stream_device[s->id] = g->device;
  }
}
// The op running on this stream thread used [p, ...) (a graph's op, whose
// queueing recorded nothing, or one queued before its pointers were known).
void note_use(const void* p) { note_use_at(t_stream, p, t_pos); }
// An NCCL call on `s` uses [p, ...) but a non-blocking communicator queues it
// only later (`delta` +1 at the call, -1 once queued).
void note_pending(Stream* s, const void* p, int delta) {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lk(g_mem_mu);
  if (Guarded* g = block_of(p)) {
    g->pending[s->id] += delta;
    g_stream_device[s->id] = g->device;
  }
}

// Every marker of a free has run: was each other stream's use of the block
// ordered before the point where the allocation stream may hand it out again?
struct FreeCheck {
  std::mutex mu;
  uintptr_t body = 0;
  int remaining = 0;
  Clock reached;  // merged clocks of the markers (allocation stream + recorded ones)
};
void finish_free(FreeCheck* chk) {
  std::vector<std::string> unsafe;
  {
    std::lock_guard<std::mutex> lk(g_mem_mu);
    auto it = g_guarded.find(chk->body);
    if (it != g_guarded.end()) {
      Guarded& g = it->second;
      for (const auto& [id, n] : g.pending) {
        if (n <= 0) continue;
        unsafe.push_back("an allocation of " + std::to_string(g.body) + " bytes on cuda:" +
                         std::to_string(g.device) + " freed while an NCCL call that uses it is "
                         "not yet queued on " + stream_name(id) + " (its non-blocking "
                         "communicator still in progress): nothing can order it before the "
                         "allocation stream's next allocation");
      }
      for (const auto& [id, pos] : g.uses) {
        if (id == g.alloc->id) continue;  // stream order
        const auto r = chk->reached.find(id);
        if (r != chk->reached.end() && r->second >= pos) continue;
        unsafe.push_back("an allocation of " + std::to_string(g.body) + " bytes on cuda:" +
                         std::to_string(g.device) + " freed while " + stream_name(id) +
                         " may still use it: torch's caching allocator gives it to the next "
                         "allocation on " + stream_name(g.alloc->id) +
                         " (where it was allocated) at once, and that use (its op " +
                         std::to_string(pos) + ") is not ordered before (record_stream, or a wait "
                         "of the allocation stream; ordered up to its op " +
                         std::to_string(r == chk->reached.end() ? 0 : r->second) + ")");
      }
      g.state = unsafe.empty() ? kReleasable : kFreedUnsafely;
    }
  }
  for (const auto& u : unsafe) violation(0, u);
  delete chk;
  --g_free_checks;
}
int sticky(int device) { return device >= 0 && device < kMaxDevices ? g_sticky[device].load() : 0; }
int sticky_current() { return t_current == nullptr ? 0 : sticky(t_current->device); }

int live() {
  if (g_unloaded.load()) {
    // Called while the process tears down its statics: [CUDA] returns
    // CUDA_ERROR_DEINITIALIZED once the driver is shutting down.
    return violation(CUDA_ERROR_DEINITIALIZED, "driver called during process teardown");
  }
  // [CUDA] cuInit: "must be called before any other function from the driver API".
  return g_initialized.load() ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}
#define LIVE()                 \
  do {                         \
    const int rc_ = live();    \
    if (rc_ != 0) return rc_;  \
  } while (0)

// Fault injection (simgpu_fail_next_driver_call): the next call named `call`
// on `device` is the first to report a sticky error `code`; the context is
// dead from then on, as after kill_context.
std::mutex g_fail_call_mu;
std::map<std::pair<std::string, int>, int> g_fail_call;  // (call, device) -> code
int sticky_in(int device, const char* call) {
  if (device < 0 || device >= kMaxDevices) return 0;
  std::lock_guard<std::mutex> lk(g_fail_call_mu);
  auto it = g_fail_call.find({call, device});
  if (it != g_fail_call.end() && !t_harness) {
    int expected = 0;
    g_sticky[device].compare_exchange_strong(expected, it->second);
    g_fail_call.erase(it);
  }
  return sticky(device);
}
#define STICKY(device)                              \
  do {                                              \
    const int st_ = sticky_in((device), __func__);  \
    if (st_ != 0) return st_;                       \
  } while (0)

// ---------------------------------------------------------------- kernels
uint64_t fnv1a(const char* data, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(data[i])) * 1099511628211ull;
  return h;
}

using Invoke = void (*)(void** params);
template <typename... A>
struct Invoker {
  template <void (*F)(A...), size_t... I>
  static void call(void** p, std::index_sequence<I...>) {
    F(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(p[I])...);
  }
};
template <typename Sig, Sig F>
struct Bind;
template <typename... A, void (*F)(A...)>
struct Bind<void (*)(A...), F> {
  static void invoke(void** p) {
    Invoker<A...>::template call<F>(p, std::index_sequence_for<A...>{});
  }
};
#define KERNEL(name) \
  { #name, &Bind<decltype(&simk::name), &simk::name>::invoke }
const std::map<std::string, Invoke> kKernels = {
    KERNEL(pyddp_reduce_f32), KERNEL(pyddp_reduce_f64), KERNEL(pyddp_reduce_f16),
    KERNEL(pyddp_reduce_bf16), KERNEL(pyddp_compress_f16), KERNEL(pyddp_compress_bf16),
    KERNEL(pyddp_decompress_f16), KERNEL(pyddp_decompress_bf16),
    KERNEL(pyddp_broadcast_b16), KERNEL(pyddp_broadcast_b32), KERNEL(pyddp_broadcast_b64),
    KERNEL(pyddp_all_gather_b16), KERNEL(pyddp_all_gather_b32), KERNEL(pyddp_all_gather_b64),
    KERNEL(pyddp_reduce_scatter_f32), KERNEL(pyddp_reduce_scatter_f64),
    KERNEL(pyddp_reduce_scatter_f16), KERNEL(pyddp_reduce_scatter_bf16)};

// The memory one of pyddp's kernels touches: (pointer index, bytes) for
// each pointer it uses, from its name and its (n, count) arguments, so a
// launch over more than the buffers hold is caught at the launch.
std::vector<std::pair<int, size_t>> kernel_extents(const std::string& name, int n, long long count) {
  const std::string suffix = name.substr(name.rfind('_') + 1);
  const size_t es = suffix == "f64" || suffix == "b64" ? 8 : suffix == "f32" || suffix == "b32" ? 4 : 2;
  const size_t c = static_cast<size_t>(count);
  std::vector<std::pair<int, size_t>> out;
  if (name.find("decompress") != std::string::npos) return {{0, c * 2}, {1, c * 4}};
  if (name.find("compress") != std::string::npos) return {{0, c * 4}, {1, c * 2}};
  const bool gather = name.find("all_gather") != std::string::npos;
  const bool scatter = name.find("reduce_scatter") != std::string::npos;
  for (int i = 0; i < n; ++i) out.push_back({i, c * es * (scatter ? n : 1)});
  if (gather || scatter) {
    for (int i = 0; i < n; ++i) out.push_back({n + i, c * es * (gather ? n : 1)});
  }
  return out;
}

struct Module {
  Ctx* ctx;
};
struct Function {
  Ctx* ctx;
  Invoke invoke;
  std::string name;
};

// Highest PTX ISA a driver of this CUDA version JIT-compiles ([PTX ISA]
// release notes: ISA 8.0 = CUDA 12.0 ... 8.8 = 12.9, 9.0 = 13.0).
int max_ptx_isa(int driver) {
  const int major = driver / 1000, minor = (driver % 1000) / 10;
  if (major >= 13) return 90;
  if (major == 12) return std::min(88, 80 + minor - (minor >= 6 ? 1 : 0));
  return 78;
}

// ---------------------------------------------------------------- NCCL
// Ranks meet in a POSIX shared-memory segment named after the unique id, so a
// communicator's ranks may live in one process or in several (NCCL's
// ncclCommInitRank with the id passed between processes). Data moves through
// per-rank chunks; every rank computes the same reduction in rank order.
constexpr int kMaxRanks = 8;
constexpr size_t kChunk = 256 * 1024;  // bytes per rank per step

struct ShmSlot {
  std::atomic<uint64_t> arrived;   // last step whose chunk this rank posted
  std::atomic<uint64_t> departed;  // last step this rank finished reading
  std::atomic<int> device;
  uint64_t count;
  int dtype, op, kind, root;
};
struct Shm {
  std::atomic<int> ready;  // the creator initialised the header
  std::atomic<int> nranks;
  std::atomic<int> joined;
  ShmSlot slot[kMaxRanks];
  char data[kMaxRanks][kChunk];
};

struct Comm {
  Shm* shm = nullptr;
  std::string name;
  int rank = 0;
  int nranks = 0;
  int device = 0;
  bool blocking = true;
  uint64_t step = 0;  // touched by this rank's stream thread only
  std::atomic<int> state{ncclInProgress};
  std::atomic<bool> aborted{false};
  std::atomic<bool> destroyed{false};
  std::atomic<int> pending{0};  // collectives enqueued and not finished
  std::atomic<uint64_t> user{0};  // thread inside a call on this communicator
};

std::mutex g_nccl_mu;
std::set<int> g_stalled;  // devices whose ranks never arrive (fault injection)
std::map<int, int> g_fail_next;  // device -> async error for its next collective

uint64_t self_id() { return std::hash<std::thread::id>()(std::this_thread::get_id()) | 1; }

// [NCCL] "Using the same communicator from multiple threads concurrently is
// not safe": two threads inside calls on one communicator are a violation.
struct Enter {
  Comm* comm;
  bool ok = true;
  explicit Enter(Comm* c) : comm(c) {
    uint64_t expected = 0;
    const uint64_t me = self_id();
    if (!comm->user.compare_exchange_strong(expected, me) && expected != me) {
      ok = false;
      violation(0, "two threads inside calls on one NCCL communicator at once");
      comm = nullptr;
    }
  }
  ~Enter() {
    if (comm) comm->user.store(0);
  }
};

size_t nccl_size(int dtype) {
  switch (dtype) {
    case 0: case 1: return 1;
    case 2: case 3: return 4;
    case 4: case 5: return 8;
    case 6: return 2;
    case 7: return 4;
    case 8: return 8;
    case 9: return 2;
    default: return 0;
  }
}

// Independent float16/bfloat16 conversions (IEEE 754 binary16, round to
// nearest even), written for the simulation, not shared with pyddp.
float h2f(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  float v = e == 0 ? std::ldexp(static_cast<float>(m), -24)
            : e == 31 ? (m ? NAN : INFINITY)
                      : std::ldexp(static_cast<float>(m | 1024), e - 25);
  return s ? -v : v;
}
uint16_t f2h(float f) {
  _Float16 h = static_cast<_Float16>(f);  // the compiler's IEEE conversion (RNE)
  uint16_t out;
  std::memcpy(&out, &h, 2);
  return out;
}
float b2f(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t f2b(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  const uint64_t rounded = static_cast<uint64_t>(u) + 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

double load_elem(const char* p, int dtype, size_t i) {
  switch (dtype) {
    case 6: { uint16_t h; std::memcpy(&h, p + 2 * i, 2); return h2f(h); }
    case 7: { float f; std::memcpy(&f, p + 4 * i, 4); return f; }
    case 8: { double d; std::memcpy(&d, p + 8 * i, 8); return d; }
    default: { uint16_t b; std::memcpy(&b, p + 2 * i, 2); return b2f(b); }
  }
}
double round_to(double v, int dtype) {
  switch (dtype) {
    case 6: return h2f(f2h(static_cast<float>(v)));
    case 7: return static_cast<float>(v);
    case 9: return b2f(f2b(static_cast<float>(v)));
    default: return v;
  }
}
void store_elem(char* p, int dtype, size_t i, double v) {
  switch (dtype) {
    case 6: { uint16_t h = f2h(static_cast<float>(v)); std::memcpy(p + 2 * i, &h, 2); break; }
    case 7: { float f = static_cast<float>(v); std::memcpy(p + 4 * i, &f, 4); break; }
    case 8: std::memcpy(p + 8 * i, &v, 8); break;
    default: { uint16_t b = f2b(static_cast<float>(v)); std::memcpy(p + 2 * i, &b, 2); break; }
  }
}

// Polls (as a kernel spins on its peers) until every rank's `field` reached
// `step`; false if this rank's communicator was aborted meanwhile.
bool wait_all(Comm* c, std::atomic<uint64_t> ShmSlot::*field, uint64_t step) {
  for (int spins = 0;; ++spins) {
    if (c->aborted.load()) return false;
    bool all = true;
    for (int r = 0; r < c->nranks && all; ++r) all = (c->shm->slot[r].*field).load() >= step;
    if (all) return true;
    if (spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

struct Pending {  // a call deferred to ncclGroupEnd [NCCL, "Group calls"]
  Comm* comm;
  std::function<void()> launch;
};
thread_local int t_group_depth = 0;
thread_local std::vector<Pending> t_group;
thread_local std::vector<Comm*> t_group_inits;

// The four collectives, and what one rank sends and receives (in elements,
// `count` being the call's count argument) [NCCL, "Collective Operations"].
enum Kind { kAllReduce, kBroadcast, kAllGather, kReduceScatter };
const char* kKindNames[] = {"ncclAllReduce", "ncclBroadcast", "ncclAllGather", "ncclReduceScatter"};
size_t send_elems(int kind, size_t count, int nranks) {
  return kind == kReduceScatter ? count * nranks : count;
}
size_t recv_elems(int kind, size_t count, int nranks) {
  return kind == kAllGather ? count * nranks : count;
}

// Runs on the rank's stream thread. Data moves in rounds: every rank posts a
// chunk of its send buffer, waits for every rank, computes its part of the
// result from all chunks (sums in rank order with one rounding to the
// element type per hop, as a ring does), waits until everyone has read,
// next round. Reduce-scatter posts block t of its send buffer in round t;
// the others post their (only) send block. The result lands in `recv` only
// at the end, after a rank-dependent delay (below).
void run_collective(Comm* comm, int kind, size_t count, int dtype, int op, int root,
                    const void* send, void* recv) {
  if (comm->aborted.load()) {
    // [NCCL, ncclCommAbort] the abort kills the communicator's kernels: a
    // queued collective no longer runs (it must not pair with a stale peer).
    --comm->pending;
    return;
  }
  auto stalled = [comm] {
    std::lock_guard<std::mutex> g(g_nccl_mu);
    return g_stalled.count(comm->device) > 0;
  };
  if (stalled()) {
    // Fault injection: this rank does not arrive while its device is stalled
    // (simgpu_nccl_stall); an abort frees it, and so does the end of the stall.
    while (!comm->aborted.load() && stalled()) std::this_thread::sleep_for(std::chrono::microseconds(200));
    if (comm->aborted.load()) {
      --comm->pending;
      return;
    }
  }
  Shm* shm = comm->shm;
  ShmSlot& mine = shm->slot[comm->rank];
  const int nranks = comm->nranks;
  const size_t es = nccl_size(dtype), per_step = kChunk / es;
  // Ranks finish a collective at different times on real hardware (a ring's
  // last hop reaches each rank at its own moment, and each GPU runs its own
  // kernel schedule): the result is written here and lands in `recv` only
  // after a rank-dependent delay (SIMGPU_SKEW_US per rank, default 1000), so a
  // stream that waits on another rank's completion, or on none, reads values
  // not yet written.
  const size_t received = recv_elems(kind, count, nranks);
  std::vector<char> result(received * es);
  // A non-root rank's send buffer is not read by a broadcast [NCCL].
  const bool sends = kind != kBroadcast || comm->rank == root;
  if (count) {
    if (sends) note_use(send);
    note_use(recv);
  }
  const int blocks = kind == kReduceScatter ? nranks : 1;
  bool mismatch = false, complete = false;
  for (int t = 0; t < blocks && !mismatch; ++t) {
    size_t off = 0;
    bool first = true;
    complete = false;
    while (!mismatch && (first || off < count)) {
      const size_t n = std::min(per_step, count - off);
      const uint64_t step = ++comm->step;
      if (sends) {
        std::memcpy(shm->data[comm->rank], static_cast<const char*>(send) + (t * count + off) * es, n * es);
      }
      mine.count = count;
      mine.dtype = dtype;
      mine.op = op;
      mine.kind = kind;
      mine.root = root;
      mine.arrived.store(step);
      if (!wait_all(comm, &ShmSlot::arrived, step)) break;
      for (int r = 0; r < nranks; ++r) {
        const ShmSlot& s = shm->slot[r];
        // [NCCL] every rank must call the same collective with the same
        // count, datatype, op and root; the real library hangs or
        // corrupts, we flag it.
        if (s.count != count || s.dtype != dtype || s.op != op || s.kind != kind || s.root != root) {
          mismatch = true;
        }
      }
      if (mismatch) {
        if (comm->rank == 0) {
          violation(0, "collective called with different kind/count/datatype/op/root across ranks");
        }
        comm->state = ncclInvalidUsage;
      } else if (kind == kAllGather) {
        for (int r = 0; r < nranks; ++r) {
          std::memcpy(result.data() + (r * count + off) * es, shm->data[r], n * es);
        }
      } else if (kind == kBroadcast) {
        std::memcpy(result.data() + off * es, shm->data[root], n * es);
      } else if (kind == kAllReduce || t == comm->rank) {
        char* out = result.data() + off * es;
        for (size_t i = 0; i < n; ++i) {
          double acc = load_elem(shm->data[0], dtype, i);
          for (int r = 1; r < nranks; ++r) {
            acc = round_to(acc + load_elem(shm->data[r], dtype, i), dtype);
          }
          if (op == 4) acc /= nranks;  // ncclAvg
          store_elem(out, dtype, i, acc);
        }
      }
      mine.departed.store(step);
      if (!wait_all(comm, &ShmSlot::departed, step)) break;
      off += n;
      first = false;
      complete = off >= count;
    }
    if (!complete) break;
  }
  if (complete && !mismatch && count) {
    const long skew = env_int("SIMGPU_SKEW_US", 1000) * static_cast<long>(comm->rank);
    if (skew > 0) std::this_thread::sleep_for(std::chrono::microseconds(skew));
    std::memcpy(recv, result.data(), received * es);
  }
  check_guards(comm->device, (std::string("an NCCL ") + kKindNames[kind]).c_str());
  {
    std::lock_guard<std::mutex> g(g_nccl_mu);
    auto it = g_fail_next.find(comm->device);
    if (it != g_fail_next.end()) {
      comm->state = it->second;
      g_fail_next.erase(it);
    }
  }
  --comm->pending;
}

int check_comm(Comm* comm, const char* call) {
  if (comm == nullptr) return violation(ncclInvalidArgument, std::string(call) + ": null communicator");
  if (comm->destroyed.load()) return violation(ncclInvalidUsage, std::string(call) + " on a destroyed communicator");
  if (comm->aborted.load()) return violation(ncclInvalidUsage, std::string(call) + " on an aborted communicator");
  // [NCCL, "Non-blocking communicators"]: after ncclInProgress the caller
  // must poll ncclCommGetAsyncError until ncclSuccess before the next call.
  if (comm->state.load() == ncclInProgress) {
    return violation(ncclInvalidUsage, std::string(call) +
                                           " while the communicator is still in progress "
                                           "(poll ncclCommGetAsyncError until ncclSuccess)");
  }
  if (comm->state.load() != ncclSuccess) return comm->state.load();
  return ncclSuccess;
}

// A non-blocking call puts a healthy communicator in progress. An error that
// one of its collectives raised asynchronously stays: NCCL's async errors are
// sticky until the communicator is aborted (ncclCommGetAsyncError reports it,
// later calls return it). Overwriting it here, as this simulator once did when
// a collective failed between a launch's check and its ncclGroupEnd, lost the
// error: a step ran on after it (tests/test_simgpu_failures.py, async_nccl_error).
void begin_in_progress(Comm* comm) {
  int expected = ncclSuccess;
  comm->state.compare_exchange_strong(expected, ncclInProgress);
}

void finish_nonblocking(std::vector<Pending> work, std::vector<Comm*> comms) {
  // Non-blocking communicators return ncclInProgress and finish the launch in
  // the background; the kernels reach the streams only then.
  std::thread([work = std::move(work), comms = std::move(comms)] {
    std::this_thread::sleep_for(std::chrono::microseconds(env_int("SIMGPU_NCCL_ASYNC_US", 300)));
    for (const Pending& p : work) p.launch();
    for (Comm* c : comms) {
      int expected = ncclInProgress;
      c->state.compare_exchange_strong(expected, ncclSuccess);
    }
  }).detach();
}

// ---------------------------------------------------------------- NVRTC
struct Program {
  std::string src;
  std::string log;
  std::string cubin, ptx;
};
int nvrtc_major() { return env_int("SIMGPU_NVRTC_VERSION", 124) / 10; }
int nvrtc_minor() { return env_int("SIMGPU_NVRTC_VERSION", 124) % 10; }
std::vector<int> nvrtc_archs() {
  std::vector<int> a = {50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90};
  if (nvrtc_major() >= 13) a = {75, 80, 86, 87, 89, 90, 100, 103, 120};
  return a;
}

}  // namespace

__attribute__((destructor)) static void simgpu_unload() { g_unloaded = true; }

// ================================================================ driver API

API int simgpu_version() { return 1; }

API int cuInit(unsigned flags) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;  // [CUDA] cuInit: "Flags must be 0"
  g_initialized = true;
  return CUDA_SUCCESS;
}
API int cuDriverGetVersion(int* v) {
  if (!v) return CUDA_ERROR_INVALID_VALUE;
  *v = driver_version();
  return CUDA_SUCCESS;
}
API int cuDeviceGetCount(int* n) {
  LIVE();
  *n = num_devices();
  return CUDA_SUCCESS;
}
API int cuDeviceGet(int* dev, int ordinal) {
  LIVE();
  if (ordinal < 0 || ordinal >= num_devices()) return CUDA_ERROR_INVALID_DEVICE;
  *dev = ordinal;
  return CUDA_SUCCESS;
}
API int cuDeviceGetName(char* name, int len, int dev) {
  LIVE();
  if (dev < 0 || dev >= num_devices()) return CUDA_ERROR_INVALID_DEVICE;
  std::snprintf(name, len, "pyddp simulated GPU");
  return CUDA_SUCCESS;
}
API int cuDeviceGetAttribute(int* v, int attr, int dev) {
  LIVE();
  if (dev < 0 || dev >= num_devices()) return CUDA_ERROR_INVALID_DEVICE;
  if (attr == 75) *v = compute_capability() / 10;       // COMPUTE_CAPABILITY_MAJOR
  else if (attr == 76) *v = compute_capability() % 10;  // COMPUTE_CAPABILITY_MINOR
  else return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}
API int cuDevicePrimaryCtxRetain(void** ctx, int dev) {
  LIVE();
  if (dev < 0 || dev >= num_devices()) return CUDA_ERROR_INVALID_DEVICE;
  *ctx = &g_ctx[dev];
  return CUDA_SUCCESS;
}
API int cuCtxSetCurrent(void* ctx) {
  LIVE();
  if (ctx != nullptr && (ctx < static_cast<void*>(&g_ctx[0]) || ctx >= static_cast<void*>(&g_ctx[kMaxDevices]))) {
    return violation(CUDA_ERROR_INVALID_CONTEXT, "cuCtxSetCurrent with an invalid context");
  }
  t_current = static_cast<Ctx*>(ctx);  // NULL unbinds [CUDA cuCtxSetCurrent]
  return CUDA_SUCCESS;
}
API int cuCtxGetCurrent(void** ctx) {
  LIVE();
  *ctx = t_current;
  return CUDA_SUCCESS;
}
API int cuStreamCreate(void** out, unsigned flags) {
  LIVE();
  STICKY(t_current ? t_current->device : -1);
  // [CUDA] cuStreamCreate creates the stream "in the current context".
  if (t_current == nullptr) return violation(CUDA_ERROR_INVALID_CONTEXT, "cuStreamCreate without a current context");
  if (flags > 1) return CUDA_ERROR_INVALID_VALUE;
  *out = new_stream(t_current);
  bump("stream_create");
  return CUDA_SUCCESS;
}
API int cuStreamDestroy_v2(void* handle) {
  LIVE();
  Stream* s = nullptr;
  if (reinterpret_cast<uintptr_t>(handle) <= 2) return CUDA_ERROR_INVALID_HANDLE;
  if (int rc = resolve(handle, &s)) return rc;
  {
    std::lock_guard<std::mutex> lk(g_handles_mu);
    g_streams.erase(handle);
  }
  // [CUDA] cuStreamDestroy: with work still queued it "returns immediately"
  // and the resources are released once the work completes.
  std::lock_guard<std::mutex> lk(s->mu);
  s->destroyed = true;
  s->cv.notify_all();
  return CUDA_SUCCESS;
}
API int cuStreamQuery(void* handle) {
  LIVE();
  Stream* s = nullptr;
  if (int rc = resolve(handle, &s)) return rc;
  STICKY(s->ctx->device);
  if (int rc = capture_forbids(s, 900, "cuStreamQuery on a capturing stream")) return rc;
  if (int rc = unsafe_during_capture("cuStreamQuery")) return rc;
  std::lock_guard<std::mutex> lk(s->mu);
  return s->done == s->enqueued ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
API int cuStreamSynchronize(void* handle) {
  LIVE();
  Stream* s = nullptr;
  if (int rc = resolve(handle, &s)) return rc;
  STICKY(s->ctx->device);
  if (int rc = capture_forbids(s, 900, "cuStreamSynchronize on a capturing stream")) return rc;
  if (int rc = unsafe_during_capture("cuStreamSynchronize")) return rc;
  if (!t_harness) bump("host_sync");  // a host-blocking call (docs/gpus.md)
  {
    std::unique_lock<std::mutex> lk(s->mu);
    const uint64_t target = s->enqueued;
    s->cv.wait(lk, [&] { return s->done >= target; });
  }
  if (!t_harness) host_saw_stream(s);
  return CUDA_SUCCESS;
}
API int cuEventCreate(void** out, unsigned flags) {
  LIVE();
  // [CUDA] cuEventCreate: "Creates an event ... for the current context".
  if (t_current == nullptr) return violation(CUDA_ERROR_INVALID_CONTEXT, "cuEventCreate without a current context");
  if (flags > 0xf) return CUDA_ERROR_INVALID_VALUE;
  auto* e = new Event;
  e->ctx = t_current;
  e->flags = flags;
  std::lock_guard<std::mutex> lk(g_handles_mu);
  g_events.insert(e);
  *out = e;
  return CUDA_SUCCESS;
}
API int cuEventDestroy_v2(void* handle) {
  LIVE();
  if (int rc = check_event(handle)) return rc;
  std::lock_guard<std::mutex> lk(g_handles_mu);
  g_events.erase(handle);  // memory kept: a queued record may still complete it
  return CUDA_SUCCESS;
}
API int cuEventRecord(void* ev, void* stream) {
  LIVE();
  if (int rc = check_event(ev)) return rc;
  Stream* s = nullptr;
  if (int rc = resolve(stream, &s)) return rc;
  STICKY(s->ctx->device);
  auto* e = static_cast<Event*>(ev);
  // [CUDA] cuEventRecord / cudaEventRecord: "hStream and hEvent must be on the
  // same context" (CUDA_ERROR_INVALID_HANDLE otherwise).
  if (e->ctx != s->ctx) {
    return violation(CUDA_ERROR_INVALID_HANDLE,
                     "cuEventRecord: event of cuda:" + std::to_string(e->ctx->device) +
                         " recorded on a stream of cuda:" + std::to_string(s->ctx->device));
  }
  {
    std::lock_guard<std::mutex> lc(g_capture_mu);
    if (Capture* c = s->capture) {  // a node of the capture, not a record now
      e->captured_in = c;
      c->events.insert(e);
      c->last[s] = c->ops.size();
      c->ops.push_back(CapOp{s, kCapRecord, nullptr, e});
      return CUDA_SUCCESS;
    }
    e->captured_in = nullptr;  // last recorded outside any capture
  }
  Op op;
  {
    std::lock_guard<std::mutex> lk(e->mu);
    op.gen = ++e->recorded;
  }
  op.record = e;
  enqueue(s, std::move(op));
  bump("event_record");
  return CUDA_SUCCESS;
}
API int cuStreamWaitEvent(void* stream, void* ev, unsigned flags) {
  LIVE();
  if (int rc = check_event(ev)) return rc;
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  Stream* s = nullptr;
  if (int rc = resolve(stream, &s)) return rc;
  STICKY(s->ctx->device);
  auto* e = static_cast<Event*>(ev);
  {
    std::lock_guard<std::mutex> lc(g_capture_mu);
    Capture* ce = e->captured_in;
    Capture* cs = s->capture;
    if (ce != nullptr) {
      if (cs != nullptr && cs != ce) {
        if (cs->error == 0) cs->error = 902;
        return violation(902, "cuStreamWaitEvent merges two captures");
      }
      if (cs == nullptr) {  // the stream joins the capture
        s->capture = ce;
        ce->members.insert(s);
      }
      ce->last[s] = ce->ops.size();
      ce->ops.push_back(CapOp{s, kCapWait, nullptr, e});
      return CUDA_SUCCESS;
    }
    if (cs != nullptr) {
      std::lock_guard<std::mutex> le(e->mu);
      if (e->recorded != 0) {
        if (cs->error == 0) cs->error = 905;
        return violation(905, "cuStreamWaitEvent from a capturing stream on an event recorded "
                              "outside the capture");
      }
      return CUDA_SUCCESS;  // never recorded: an empty wait
    }
  }
  // [CUDA] cuStreamWaitEvent: waits on "the most recent call to cuEventRecord"
  // at the time of this call; the event may be from another context. An event
  // never recorded is complete, so the wait is empty.
  uint64_t gen;
  {
    std::lock_guard<std::mutex> lk(e->mu);
    gen = e->recorded;
  }
  if (gen == 0) return CUDA_SUCCESS;
  Op op;
  op.wait = e;
  op.gen = gen;
  enqueue(s, std::move(op));
  bump("stream_wait");
  return CUDA_SUCCESS;
}
// [CUDA] cuEventElapsedTime: milliseconds between two completed events;
// CUDA_ERROR_NOT_READY while either has not completed, INVALID_HANDLE for one
// never recorded or created with CU_EVENT_DISABLE_TIMING (0x2). Here: host
// time between the moments the stream threads completed them.
API int cuEventElapsedTime(float* ms, void* start, void* end) {
  LIVE();
  if (int rc = check_event(start)) return rc;
  if (int rc = check_event(end)) return rc;
  std::chrono::steady_clock::time_point at[2];
  Event* events[2] = {static_cast<Event*>(start), static_cast<Event*>(end)};
  for (int i = 0; i < 2; ++i) {
    std::lock_guard<std::mutex> lk(events[i]->mu);
    if (events[i]->recorded == 0 || (events[i]->flags & 0x2)) return CUDA_ERROR_INVALID_HANDLE;
    if (events[i]->completed < events[i]->recorded) return CUDA_ERROR_NOT_READY;
    at[i] = events[i]->at;
  }
  *ms = std::chrono::duration<float, std::milli>(at[1] - at[0]).count();
  return CUDA_SUCCESS;
}
API int cuEventQuery(void* ev) {
  LIVE();
  if (int rc = check_event(ev)) return rc;
  auto* e = static_cast<Event*>(ev);
  STICKY(e->ctx->device);
  {
    std::lock_guard<std::mutex> lc(g_capture_mu);
    if (e->captured_in != nullptr) {
      return violation(907, "cuEventQuery on an event last recorded in a capturing stream");
    }
  }
  if (int rc = unsafe_during_capture("cuEventQuery")) return rc;
  uint64_t gen;
  {
    std::lock_guard<std::mutex> lk(e->mu);
    // [CUDA] cuEventQuery: CUDA_SUCCESS if the captured work completed or the
    // event was never recorded, CUDA_ERROR_NOT_READY otherwise.
    if (e->completed < e->recorded) return CUDA_ERROR_NOT_READY;
    gen = e->recorded;
  }
  if (!t_harness) host_saw_event(e, gen);
  return CUDA_SUCCESS;
}
API int cuEventSynchronize(void* ev) {
  LIVE();
  if (int rc = check_event(ev)) return rc;
  auto* e = static_cast<Event*>(ev);
  STICKY(e->ctx->device);
  {
    std::lock_guard<std::mutex> lc(g_capture_mu);
    if (e->captured_in != nullptr) {
      return violation(907, "cuEventSynchronize on an event last recorded in a capturing stream");
    }
  }
  if (int rc = unsafe_during_capture("cuEventSynchronize")) return rc;
  if (!t_harness) bump("host_sync");
  uint64_t target;
  {
    std::unique_lock<std::mutex> lk(e->mu);
    target = e->recorded;
    e->cv.wait(lk, [&] { return e->completed >= target; });
  }
  if (!t_harness) host_saw_event(e, target);
  return CUDA_SUCCESS;
}
API int cuGetErrorString(int code, const char** out) {
  switch (code) {
    case 0: *out = "no error"; break;
    case 1: *out = "invalid argument"; break;
    case 700: *out = "an illegal memory access was encountered"; break;
    case 702: *out = "the launch timed out and was terminated"; break;
    case 214: *out = "uncorrectable ECC error encountered"; break;
    case 220: *out = "uncorrectable NVLink error detected during the execution"; break;
    case 999: *out = "unknown error"; break;
    case 3: *out = "initialization error"; break;
    case 4: *out = "driver shutting down"; break;
    case 101: *out = "invalid device ordinal"; break;
    case 200: *out = "device kernel image is invalid"; break;
    case 201: *out = "invalid device context"; break;
    case 209: *out = "no kernel image is available for execution on the device"; break;
    case 222: *out = "the provided PTX was compiled with an unsupported toolchain."; break;
    case 400: *out = "invalid resource handle"; break;
    case 500: *out = "named symbol not found"; break;
    case 600: *out = "device not ready"; break;
    default: *out = nullptr; return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}
API int cuModuleLoadData(void** module, const void* image) {
  LIVE();
  STICKY(t_current ? t_current->device : -1);
  // [CUDA] cuModuleLoadData "loads ... into the current context".
  if (t_current == nullptr) return violation(CUDA_ERROR_INVALID_CONTEXT, "cuModuleLoadData without a current context");
  const std::string text(static_cast<const char*>(image));
  const std::string hash = std::to_string(SIMGPU_KERNEL_HASH);
  if (text.rfind("SIMGPU-CUBIN ", 0) == 0) {
    int arch = 0;
    char src[64] = {0};
    std::sscanf(text.c_str(), "SIMGPU-CUBIN sm_%d src=%63s", &arch, src);
    if (hash != src) return violation(CUDA_ERROR_INVALID_IMAGE, "cubin not built from reduce_kernels.cu");
    // [CUDA] a cubin runs only on its SM major (and minor >= it): else
    // CUDA_ERROR_NO_BINARY_FOR_GPU.
    if (arch / 10 != compute_capability() / 10 || arch > compute_capability()) {
      return CUDA_ERROR_NO_BINARY_FOR_GPU;
    }
  } else if (text.find(".version") != std::string::npos) {
    int major = 0, minor = 0, target = 0;
    std::sscanf(text.c_str() + text.find(".version"), ".version %d.%d", &major, &minor);
    if (text.find(".target sm_") != std::string::npos) {
      std::sscanf(text.c_str() + text.find(".target sm_"), ".target sm_%d", &target);
    }
    // [PTX ISA] a driver JIT-compiles PTX up to the ISA of its CUDA version:
    // newer PTX fails with CUDA_ERROR_UNSUPPORTED_PTX_VERSION.
    if (major * 10 + minor > max_ptx_isa(driver_version())) return CUDA_ERROR_UNSUPPORTED_PTX_VERSION;
    if (target > compute_capability()) return CUDA_ERROR_NO_BINARY_FOR_GPU;
    for (const auto& k : kKernels) {
      if (text.find(".entry " + k.first) == std::string::npos) {
        return violation(CUDA_ERROR_INVALID_IMAGE, "PTX lacks pyddp's entry " + k.first);
      }
    }
  } else {
    return violation(CUDA_ERROR_INVALID_IMAGE, "cuModuleLoadData: not a cubin or PTX image");
  }
  *module = new Module{t_current};
  bump("module_load");
  return CUDA_SUCCESS;
}
API int cuModuleGetFunction(void** fn, void* module, const char* name) {
  LIVE();
  auto it = kKernels.find(name);
  if (it == kKernels.end()) return CUDA_ERROR_NOT_FOUND;
  *fn = new Function{static_cast<Module*>(module)->ctx, it->second, name};
  return CUDA_SUCCESS;
}
API int cuLaunchKernel(void* fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                       unsigned bz, unsigned shmem, void* stream, void** params, void** extra) {
  LIVE();
  STICKY(t_current ? t_current->device : -1);
  auto* f = static_cast<Function*>(fn);
  Stream* s = nullptr;
  if (int rc = resolve(stream, &s)) return rc;
  // [PG, "Stream and Event Behavior"]: "A kernel launch will fail if it is
  // issued to a stream that is not associated to the current device"; a
  // function belongs to the context its module was loaded in.
  if (t_current == nullptr) return violation(CUDA_ERROR_INVALID_CONTEXT, "cuLaunchKernel without a current context");
  if (s->ctx != t_current || f->ctx != t_current) {
    return violation(CUDA_ERROR_INVALID_HANDLE,
                     "cuLaunchKernel: kernel of cuda:" + std::to_string(f->ctx->device) +
                         " on a stream of cuda:" + std::to_string(s->ctx->device) +
                         " with cuda:" + std::to_string(t_current->device) + " current");
  }
  // [CUDA] cuLaunchKernel: at most 1024 threads per block; params or extra.
  if (gx == 0 || gy == 0 || gz == 0 || bx * by * bz == 0 || bx * by * bz > 1024 || shmem > 49152 ||
      (params == nullptr && extra == nullptr)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  // The kernel parameters are copied at launch [CUDA]: keep the bytes now.
  // Our kernels all take (Ptrs by value, int, long long, int).
  struct Args {
    simk::Ptrs ptrs;
    int n;
    long long count;
    int avg;
  } a;
  std::memcpy(&a.ptrs, params[0], sizeof a.ptrs);
  std::memcpy(&a.n, params[1], sizeof a.n);
  std::memcpy(&a.count, params[2], sizeof a.count);
  std::memcpy(&a.avg, params[3], sizeof a.avg);
  Invoke invoke = f->invoke;
  const int device = t_current->device;
  // Our kernels' pointers: the replicas' buffers (n of them; sends then
  // receives for all-gather and reduce-scatter), or for the wire's
  // (de)compression the bucket and its 16-bit copy (n is then the number of
  // ranks). Each must hold what the kernel reads or writes through it.
  const bool wire = f->name.find("compress") != std::string::npos;
  if (!wire && (a.n < 1 || a.n > PYDDP_MAX_REPLICAS)) return CUDA_ERROR_INVALID_VALUE;
  if (f->name.find("broadcast") != std::string::npos && (a.avg < 0 || a.avg >= a.n)) {
    return violation(CUDA_ERROR_INVALID_VALUE, "pyddp broadcast kernel: root is not a replica");
  }
  const auto extents = kernel_extents(f->name, a.n, a.count);
  if (a.count > 0) {
    for (const auto& [i, bytes] : extents) {
      if (!device_memory(device, a.ptrs.p[i], bytes, ("pointer " + std::to_string(i) + " of " + f->name).c_str())) {
        return CUDA_ERROR_ILLEGAL_ADDRESS;
      }
    }
  }
  std::vector<int> used;
  for (const auto& e : extents) used.push_back(e.first);
  Op op;
  op.run = [invoke, a, gx, bx, device, used] {
    for (size_t k = 0; k < used.size() && a.count > 0; ++k) note_use(a.ptrs.p[used[k]]);
    Args copy = a;
    void* p[] = {&copy.ptrs, &copy.n, &copy.count, &copy.avg};
    gridDim.x = gx;
    blockDim.x = bx;
    for (unsigned b = 0; b < gx; ++b) {
      blockIdx.x = b;
      for (unsigned t = 0; t < bx; ++t) {
        threadIdx.x = t;
        invoke(p);
      }
    }
    check_guards(device, "a pyddp kernel");
  };
  const uint64_t pos = enqueue(s, std::move(op));
  for (size_t k = 0; k < used.size() && a.count > 0; ++k) note_use_at(s, a.ptrs.p[used[k]], pos);
  bump("kernel_launch");
  return CUDA_SUCCESS;
}
namespace {
// Queues host work on a stream: it runs in stream order, like a kernel.
int enqueue_run(void* stream, std::function<void()> run) {
  Stream* s = nullptr;
  if (int rc = resolve(stream, &s)) return rc;
  Op op;
  op.run = std::move(run);
  enqueue(s, std::move(op));
  return CUDA_SUCCESS;
}
}  // namespace

API int cuLaunchHostFunc(void* stream, void (*fn)(void*), void* data) {
  LIVE();
  return enqueue_run(stream, [fn, data] { fn(data); });
}

// ================================================================ NCCL

API int ncclGetVersion(int* v) {
  *v = 21903;  // reports 2.19.3
  return ncclSuccess;
}
API const char* ncclGetErrorString(int r) {
  static const char* names[] = {"no error", "unhandled cuda error", "unhandled system error",
                                "internal error", "invalid argument", "invalid usage",
                                "remote process exited or there was a network error",
                                "NCCL operation in progress", "timeout"};
  return r >= 0 && r <= 8 ? names[r] : "unknown result code";
}
API int ncclGetUniqueId(char* id) {
  static std::atomic<uint64_t> next{1};
  std::memset(id, 0, 128);
  std::snprintf(id, 128, "simgpu:%d:%llu", static_cast<int>(getpid()),
                static_cast<unsigned long long>(next++));
  return ncclSuccess;
}

namespace {
struct ConfigV {  // NCCL 2.14 ncclConfig_t prefix
  size_t size;
  unsigned magic, version;
  int blocking;
};

int init_rank(Comm** out, int nranks, const char* id, int rank, const ConfigV* config) {
  if (nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  bool blocking = true;
  if (config != nullptr) {
    // [NCCL] ncclConfig_t must come from NCCL_CONFIG_INITIALIZER.
    if (config->magic != 0xcafebeef || config->version < 21400 || config->size < sizeof(ConfigV)) {
      return violation(ncclInvalidArgument, "ncclConfig_t not from NCCL_CONFIG_INITIALIZER");
    }
    blocking = config->blocking != 0;
  }
  if (nranks > kMaxRanks) return violation(ncclInvalidArgument, "simgpu supports up to 8 ranks");
  // [NCCL] ncclCommInitRank: the communicator uses "the current CUDA device".
  const int device = t_current ? t_current->device : 0;
  if (sticky(device)) return ncclUnhandledCudaError;  // [NCCL] a CUDA call failed
  std::string name = "/simgpu-";
  for (const char* c = id; *c && c < id + 100; ++c) name += std::isalnum(*c) ? *c : '-';
  int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  const bool creator = fd >= 0;
  if (!creator) fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) return violation(ncclSystemError, "shm_open " + name + " failed (id already used up?)");
  if (creator && ftruncate(fd, sizeof(Shm)) != 0) return ncclSystemError;
  struct stat st {};
  for (int i = 0; i < 10000 && (fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(sizeof(Shm))); ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  void* mem = mmap(nullptr, sizeof(Shm), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (mem == MAP_FAILED) return ncclSystemError;
  auto* shm = static_cast<Shm*>(mem);
  if (creator) {
    shm->nranks = nranks;
    shm->ready = 1;
  }
  while (shm->ready.load() == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
  if (shm->nranks.load() != nranks) {
    return violation(ncclInvalidArgument, "ncclCommInitRank: nranks differs across ranks");
  }
  for (int r = 0; r < nranks; ++r) {
    if (r != rank && shm->slot[r].device.load() == device + 1) {
      // [NCCL] "Duplicate GPU detected": two ranks of one clique on one GPU.
      return violation(ncclInvalidUsage, "two ranks of one communicator on cuda:" + std::to_string(device) +
                                              " (is the current device set before each init?)");
    }
  }
  if (shm->slot[rank].device.exchange(device + 1) != 0) {
    return violation(ncclInvalidArgument, "ncclCommInitRank: rank " + std::to_string(rank) + " joined twice");
  }
  auto* comm = new Comm;
  comm->shm = shm;
  comm->name = name;
  comm->rank = rank;
  comm->nranks = nranks;
  comm->device = device;
  comm->blocking = blocking;
  if (shm->joined.fetch_add(1) + 1 == nranks) shm_unlink(name.c_str());  // mappings stay valid
  *out = comm;
  auto complete = [comm] {
    // Initialisation completes once every rank has joined.
    return comm->shm->joined.load() >= comm->nranks;
  };
  if (t_group_depth > 0) {
    t_group_inits.push_back(comm);
    if (blocking) return ncclSuccess;
  }
  if (!blocking) {
    std::thread([comm, complete] {
      while (!complete() && !comm->aborted.load()) std::this_thread::sleep_for(std::chrono::microseconds(50));
      int expected = ncclInProgress;
      comm->state.compare_exchange_strong(expected, ncclSuccess);
    }).detach();
    return ncclInProgress;
  }
  if (t_group_depth > 0) return ncclSuccess;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(hang_s());
  while (!complete()) {
    if (std::chrono::steady_clock::now() > deadline) {
      return violation(ncclInternalError,
                       "blocking ncclCommInitRank never completed: peers initialised from this "
                       "thread must be inside ncclGroupStart/End");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  comm->state = ncclSuccess;
  return ncclSuccess;
}
}  // namespace

struct UniqueId {  // ncclUniqueId is passed by value (128 bytes)
  char internal[128];
};
API int ncclCommInitRankConfig(Comm** out, int nranks, UniqueId id, int rank, ConfigV* config) {
  if (live() == CUDA_ERROR_DEINITIALIZED) return ncclUnhandledCudaError;
  return init_rank(out, nranks, id.internal, rank, config);
}
API int ncclCommInitRank(Comm** out, int nranks, UniqueId id, int rank) {
  return init_rank(out, nranks, id.internal, rank, nullptr);
}
API int ncclCommGetAsyncError(Comm* comm, int* err) {
  if (comm != nullptr && err != nullptr && sticky(comm->device)) {
    *err = ncclUnhandledCudaError;  // its kernels died with the context
    return ncclSuccess;
  }
  // Documented as callable while another thread waits on the communicator.
  if (comm == nullptr) return ncclInvalidArgument;
  if (comm->destroyed.load()) return violation(ncclInvalidUsage, "ncclCommGetAsyncError on a destroyed communicator");
  *err = comm->aborted.load() ? ncclSystemError : comm->state.load();
  return ncclSuccess;
}
API int ncclGroupStart() {
  ++t_group_depth;
  return ncclSuccess;
}
namespace {
// One collective call: checks what the real library checks or leaves
// undefined, then queues the collective on `stream` (or holds it until
// ncclGroupEnd inside a group).
int collective(int kind, const void* send, void* recv, size_t count, int dtype, int op, int root,
               Comm* comm, void* stream) {
  const char* call = kKindNames[kind];
  if (int rc = check_comm(comm, call)) return rc;
  Enter enter(comm);
  if (!enter.ok) return ncclInvalidUsage;
  // [NCCL] ncclDataType_t / ncclRedOp_t: built-in values only here.
  if (nccl_size(dtype) == 0 || op < 0 || op > 4) {
    return violation(ncclInvalidArgument, std::string(call) + ": invalid datatype or op enum");
  }
  if (kind == kBroadcast && (root < 0 || root >= comm->nranks)) {
    return violation(ncclInvalidArgument, "ncclBroadcast: root " + std::to_string(root) +
                                              " is not a rank of the communicator");
  }
  const bool reads = kind != kBroadcast || comm->rank == root;
  if (count > 0 && ((reads && send == nullptr) || recv == nullptr)) return ncclInvalidArgument;
  if (sticky(comm->device)) return ncclUnhandledCudaError;
  const size_t es = nccl_size(dtype);
  const size_t sent = send_elems(kind, count, comm->nranks) * es;
  const size_t got = recv_elems(kind, count, comm->nranks) * es;
  if (count > 0 && ((reads && !device_memory(comm->device, send, sent, (std::string(call) + "'s sendbuff").c_str())) ||
                    !device_memory(comm->device, recv, got, (std::string(call) + "'s recvbuff").c_str()))) {
    return ncclUnhandledCudaError;
  }
  if (count > 0 && reads && (kind == kAllGather || kind == kReduceScatter)) {
    // [NCCL, "In-place Operations"]: in place only when the smaller buffer
    // is the rank's own block of the larger one; any other overlap is
    // undefined (the ring overwrites data not yet sent).
    const char* big = static_cast<const char*>(kind == kAllGather ? recv : send);
    const char* small = static_cast<const char*>(kind == kAllGather ? send : recv);
    const size_t block = count * es;
    const bool own = small == big + comm->rank * block;
    const bool apart = small + block <= big || big + block * comm->nranks <= small;
    if (!own && !apart) {
      return violation(ncclInvalidArgument, std::string(call) +
                                                ": send and receive buffers overlap other than "
                                                "at this rank's own block");
    }
  }
  Stream* s = nullptr;
  {
    Ctx* saved = t_current;
    t_current = &g_ctx[comm->device];  // NCCL launches on the communicator's device
    const int rc = resolve(stream, &s);
    t_current = saved;
    if (rc) return ncclInvalidArgument;
  }
  if (s->ctx->device != comm->device) {
    return violation(ncclInvalidArgument, std::string(call) + ": stream of cuda:" + std::to_string(s->ctx->device) +
                                              " for a communicator of cuda:" + std::to_string(comm->device));
  }
  // [NCCL, "CUDA Graph support"]: a collective queued on a capturing
  // stream is captured and runs at each graph launch, where the ranks meet
  // as eagerly (every rank's graph, or one graph holding them all, must be
  // launched).
  // Its buffers are in use from the call on: queued now, or (in a group of a
  // non-blocking communicator) once the group finishes its launch.
  const void* used[2] = {count > 0 && reads ? send : nullptr, count > 0 ? recv : nullptr};
  auto launch = [comm, kind, send, recv, count, dtype, op, root, s, used] {
    ++comm->pending;
    Op o;
    o.run = [comm, kind, count, dtype, op, root, send, recv] {
      run_collective(comm, kind, count, dtype, op, root, send, recv);
    };
    o.replayed = [comm] { ++comm->pending; };
    const uint64_t pos = enqueue(s, std::move(o));
    for (const void* p : used) {
      note_use_at(s, p, pos);
      note_pending(s, p, -1);
    }
    if (pos == 0) --comm->pending;  // captured: pending at each launch
  };
  if (t_group_depth == 0) {
    // [NCCL, "Group calls", management of multiple GPUs from one thread]:
    // "group semantics must be used" there, because a call outside a group
    // may block until every rank arrives. One thread driving two ranks of a
    // communicator that way deadlocks on real NCCL (its first call waits for
    // a rank the thread never reaches): refused here, by name, at once.
    thread_local std::map<std::string, int> t_ungrouped;  // communicator id -> rank
    auto it = t_ungrouped.find(comm->name);
    if (it != t_ungrouped.end() && it->second != comm->rank) {
      return violation(ncclInvalidUsage,
                       std::string(call) + " outside ncclGroupStart/End on rank " +
                           std::to_string(comm->rank) + " from the thread that launched rank " +
                           std::to_string(it->second) + " of the same communicator so: on real "
                           "NCCL the first call waits for the other ranks (deadlock)");
    }
    t_ungrouped[comm->name] = comm->rank;
  }
  static const char* counters[] = {"nccl_allreduce", "nccl_broadcast", "nccl_allgather",
                                   "nccl_reducescatter"};
  bump(counters[kind]);
  for (const void* p : used) note_pending(s, p, +1);
  if (t_group_depth > 0) {
    // Held until ncclGroupEnd: no other thread may use it in between.
    t_group.push_back(Pending{comm, launch});
    comm->user.store(0);
    enter.comm = nullptr;
    return ncclSuccess;
  }
  launch();
  return ncclSuccess;
}
}  // namespace

API int ncclAllReduce(const void* send, void* recv, size_t count, int dtype, int op, Comm* comm,
                      void* stream) {
  return collective(kAllReduce, send, recv, count, dtype, op, 0, comm, stream);
}
API int ncclBroadcast(const void* send, void* recv, size_t count, int dtype, int root, Comm* comm,
                      void* stream) {
  return collective(kBroadcast, send, recv, count, dtype, 0, root, comm, stream);
}
API int ncclAllGather(const void* send, void* recv, size_t sendcount, int dtype, Comm* comm,
                      void* stream) {
  return collective(kAllGather, send, recv, sendcount, dtype, 0, 0, comm, stream);
}
API int ncclReduceScatter(const void* send, void* recv, size_t recvcount, int dtype, int op,
                          Comm* comm, void* stream) {
  return collective(kReduceScatter, send, recv, recvcount, dtype, op, 0, comm, stream);
}
API int ncclGroupEnd() {
  if (t_group_depth == 0) return violation(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--t_group_depth > 0) return ncclSuccess;
  std::vector<Pending> work;
  work.swap(t_group);
  std::vector<Comm*> inits;
  inits.swap(t_group_inits);
  // Blocking inits in a group complete at ncclGroupEnd [NCCL, "Group calls"].
  for (Comm* c : inits) {
    if (!c->blocking) continue;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(hang_s());
    while (c->shm->joined.load() < c->nranks) {
      if (std::chrono::steady_clock::now() > deadline) {
        return violation(ncclInternalError, "ncclGroupEnd: communicator init never completed");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    c->state = ncclSuccess;
  }
  bool nonblocking = false;
  std::vector<Comm*> comms;
  for (const Pending& p : work) {
    if (!p.comm->blocking) nonblocking = true;
    if (std::find(comms.begin(), comms.end(), p.comm) == comms.end()) comms.push_back(p.comm);
  }
  for (Comm* c : inits) nonblocking = nonblocking || !c->blocking;
  if (!nonblocking) {
    for (const Pending& p : work) p.launch();
    return ncclSuccess;
  }
  for (Comm* c : comms) begin_in_progress(c);
  finish_nonblocking(std::move(work), comms);
  return ncclInProgress;
}
API int ncclCommFinalize(Comm* comm) {
  if (int rc = check_comm(comm, "ncclCommFinalize")) return rc;
  Enter enter(comm);
  if (!enter.ok) return ncclInvalidUsage;
  if (comm->blocking) {
    while (comm->pending.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
    return ncclSuccess;
  }
  begin_in_progress(comm);
  std::thread([comm] {
    while (comm->pending.load() > 0 && !comm->aborted.load()) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    int expected = ncclInProgress;
    comm->state.compare_exchange_strong(expected, ncclSuccess);
  }).detach();
  return ncclInProgress;
}
API int ncclCommDestroy(Comm* comm) {
  if (comm == nullptr) return ncclInvalidArgument;
  if (comm->destroyed.load()) return violation(ncclInvalidUsage, "ncclCommDestroy twice");
  Enter enter(comm);
  if (!enter.ok) return ncclInvalidUsage;
  // [NCCL] ncclCommDestroy waits for the communicator's outstanding
  // operations: with one stuck it never returns. Flag it instead of hanging.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(hang_s());
  while (comm->pending.load() > 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      return violation(ncclInternalError, "ncclCommDestroy with a collective in flight (would hang)");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  comm->destroyed = true;
  munmap(comm->shm, sizeof(Shm));
  bump("nccl_destroy");
  return ncclSuccess;
}
API int ncclCommAbort(Comm* comm) {
  if (comm == nullptr) return ncclInvalidArgument;
  // [NCCL] freeing a communicator another thread is inside is unsafe.
  const uint64_t inside = comm->user.load();
  if (inside != 0 && inside != self_id()) {
    violation(0, "ncclCommAbort while another thread is inside a call on the communicator");
  }
  comm->aborted = true;  // its kernels (pollers) exit
  bump("nccl_abort");
  return ncclSuccess;
}

// ================================================================ NVRTC

API int nvrtcVersion(int* major, int* minor) {
  *major = nvrtc_major();
  *minor = nvrtc_minor();
  return 0;
}
API int nvrtcGetNumSupportedArchs(int* n) {
  *n = static_cast<int>(nvrtc_archs().size());
  return 0;
}
API int nvrtcGetSupportedArchs(int* out) {
  const auto a = nvrtc_archs();
  std::copy(a.begin(), a.end(), out);
  return 0;
}
API int nvrtcCreateProgram(Program** prog, const char* src, const char*, int n, const char* const*,
                           const char* const*) {
  if (prog == nullptr || src == nullptr || n < 0) return 4;  // NVRTC_ERROR_INVALID_INPUT
  *prog = new Program{src, "", "", ""};
  return 0;
}
API int nvrtcCompileProgram(Program* p, int n, const char* const* options) {
  std::string arch;
  for (int i = 0; i < n; ++i) {
    const std::string o = options[i];
    for (const char* prefix : {"--gpu-architecture=", "-arch="}) {
      if (o.rfind(prefix, 0) == 0) arch = o.substr(std::strlen(prefix));
    }
  }
  int number = 0;
  const bool cubin = arch.rfind("sm_", 0) == 0;
  if (!(cubin || arch.rfind("compute_", 0) == 0) ||
      std::sscanf(arch.c_str() + arch.find('_') + 1, "%d", &number) != 1) {
    p->log = "nvrtc: error: no or invalid --gpu-architecture";
    return 5;  // NVRTC_ERROR_INVALID_OPTION
  }
  const auto archs = nvrtc_archs();
  if (std::find(archs.begin(), archs.end(), number) == archs.end()) {
    p->log = "nvrtc: error: invalid value for --gpu-architecture (-arch)";
    return 5;
  }
  const uint64_t h = fnv1a(p->src.data(), p->src.size());
  if (h != SIMGPU_KERNEL_HASH) {
    // Only the kernel this simulation compiled on the host can "run".
    p->log = "simgpu: the source differs from the reduce_kernels.cu this simulation was built from";
    return 6;  // NVRTC_ERROR_COMPILATION
  }
  const std::string hs = std::to_string(h);
  // [NVRTC] sm_XX gives a cubin (and PTX); compute_XX gives PTX only.
  if (cubin) p->cubin = "SIMGPU-CUBIN sm_" + std::to_string(number) + " src=" + hs;
  p->ptx = "// simulated NVRTC output\n.version " + std::to_string(nvrtc_major() == 13 ? 9 : 8) +
           "." + std::to_string(nvrtc_major() == 13 ? 0 : nvrtc_minor()) + "\n.target sm_" +
           std::to_string(number) + "\n";
  for (const auto& k : kKernels) p->ptx += ".visible .entry " + k.first + "()\n";
  return 0;
}
API int nvrtcGetProgramLogSize(Program* p, size_t* n) {
  *n = p->log.size() + 1;
  return 0;
}
API int nvrtcGetProgramLog(Program* p, char* out) {
  std::memcpy(out, p->log.c_str(), p->log.size() + 1);
  return 0;
}
API int nvrtcGetCUBINSize(Program* p, size_t* n) {
  *n = p->cubin.empty() ? 0 : p->cubin.size() + 1;
  return 0;
}
API int nvrtcGetCUBIN(Program* p, char* out) {
  std::memcpy(out, p->cubin.c_str(), p->cubin.size() + 1);
  return 0;
}
API int nvrtcGetPTXSize(Program* p, size_t* n) {
  *n = p->ptx.size() + 1;
  return 0;
}
API int nvrtcGetPTX(Program* p, char* out) {
  std::memcpy(out, p->ptx.c_str(), p->ptx.size() + 1);
  return 0;
}
API int nvrtcDestroyProgram(Program** p) {
  delete *p;
  *p = nullptr;
  return 0;
}
API const char* nvrtcGetErrorString(int r) {
  switch (r) {
    case 0: return "NVRTC_SUCCESS";
    case 4: return "NVRTC_ERROR_INVALID_INPUT";
    case 5: return "NVRTC_ERROR_INVALID_OPTION";
    case 6: return "NVRTC_ERROR_COMPILATION";
    default: return "NVRTC_ERROR";
  }
}

// ================================================================ test controls

// Every operation on `stream` (0: every stream created from now on) first
// sleeps `us`: the GPU is slow there, so a missing wait reads stale data.
// Device memory (see "memory" above): [base, base + lead + body + tail),
// allocated on `stream` of `device` (0: its default stream) by the test
// stream provider; lead and tail are guard zones.
API int simgpu_alloc(void* base, size_t lead, size_t body, size_t tail, int device, void* stream) {
  if (device < 0 || device >= num_devices()) return CUDA_ERROR_INVALID_DEVICE;
  Stream* s = nullptr;
  if (int rc = resolve_on(device, stream, &s)) return rc;
  if (int rc = capture_forbids(s, 900, "an allocation on a capturing stream (allocate before capture)")) return rc;
  auto* b = static_cast<char*>(base);
  std::memset(b, kCanary, lead);
  std::memset(b + lead + body, kCanary, tail);
  std::lock_guard<std::mutex> lk(g_mem_mu);
  g_stream_device[s->id] = device;
  Guarded g{b, lead, body, tail, device};
  g.alloc = s;
  g_guarded[reinterpret_cast<uintptr_t>(b + lead)] = std::move(g);
  return 0;
}
// The host wrote device memory on `stream` of `device` (a torch op standing
// in for a kernel queued there, after the test provider drained the stream):
// it counts as a use of every allocation of that device by the stream.
API int simgpu_host_use(int device, void* stream) {
  Stream* s = nullptr;
  if (int rc = resolve_on(device, stream, &s)) return rc;
  if (int rc = capture_forbids(s, 900, "a host write to device memory on a capturing stream")) return rc;
  // An op in its place, so that what orders after the stream's later ops
  // (a wait, a synchronize) orders after the write too.
  const uint64_t pos = enqueue(s, Op{});
  std::lock_guard<std::mutex> lk(g_mem_mu);
  g_stream_device[s->id] = device;
  for (auto& [addr, g] : g_guarded) {
    if (g.device != device || g.state != kLive) continue;
    uint64_t& last = g.uses[s->id];
    last = std::max(last, pos);
  }
  return 0;
}
// The last tensor on the allocation whose body starts at `body` is gone
// (torch's caching allocator frees the block); `recorded` are the streams
// Tensor.record_stream named for it. The check runs once a marker has run on
// the allocation stream and on every recorded stream.
API int simgpu_free(void* body, void** recorded, int n) {
  auto* chk = new FreeCheck;
  chk->body = reinterpret_cast<uintptr_t>(body);
  std::vector<Stream*> streams;
  {
    std::lock_guard<std::mutex> lk(g_mem_mu);
    auto it = g_guarded.find(chk->body);
    if (it == g_guarded.end() || it->second.state != kLive) {
      delete chk;
      return violation(CUDA_ERROR_INVALID_VALUE, "simgpu_free: not a live allocation");
    }
    it->second.state = kFreeing;
    chk->reached = g_host_clock;
    streams.push_back(it->second.alloc);
    for (int i = 0; i < n; ++i) {
      Stream* s = nullptr;
      if (resolve_on(it->second.device, recorded[i], &s) == 0 &&
          std::find(streams.begin(), streams.end(), s) == streams.end()) {
        streams.push_back(s);
        g_stream_device[s->id] = it->second.device;
      }
    }
  }
  chk->remaining = static_cast<int>(streams.size());
  ++g_free_checks;
  for (Stream* s : streams) {
    Op marker;
    marker.run = [chk, s] {
      Clock now;
      {
        std::lock_guard<std::mutex> lk(s->mu);
        now = s->clock;
      }
      bool last;
      {
        std::lock_guard<std::mutex> lk(chk->mu);
        merge(chk->reached, now);
        last = --chk->remaining == 0;
      }
      if (last) finish_free(chk);
    };
    enqueue(s, std::move(marker));
  }
  return 0;
}
// The test synchronised `stream` of `device` as torch.cuda.synchronize would
// (after draining it): what ran there is complete as far as the host knows.
API int simgpu_host_synchronized(int device, void* stream) {
  Stream* s = nullptr;
  if (int rc = resolve_on(device, stream, &s)) return rc;
  host_saw_stream(s);
  return 0;
}
// Whether `p` lies in a live allocation of a simulated GPU (device memory).
API int simgpu_is_device(void* p) {
  std::lock_guard<std::mutex> lk(g_mem_mu);
  const Guarded* g = block_of(p);
  return g != nullptr && g->state == kLive;
}
// Allocations whose free was checked and found safe: their memory may go.
// Writes up to `cap` body addresses to `out`, forgets them, returns how many.
API int simgpu_releasable(uintptr_t* out, int cap) {
  std::lock_guard<std::mutex> lk(g_mem_mu);
  int n = 0;
  for (auto it = g_guarded.begin(); it != g_guarded.end() && n < cap;) {
    if (it->second.state == kReleasable) {
      out[n++] = it->first;
      it = g_guarded.erase(it);
    } else {
      ++it;
    }
  }
  return n;
}
API int simgpu_sticky(int device) { return sticky(device); }
// Fault injection: a kernel of the user's touched memory it does not own on
// `device` (the context dies, as for pyddp's own).
API void simgpu_kill_context(int device) {
  kill_context(device, "illegal address: a user kernel (fault injection)");
}
// Fault injection: the next `call` ("cuStreamWaitEvent", "cuEventRecord", any
// driver call that checks for a dead context) on `device`, outside the test
// harness's own calls, returns `code` and leaves the context dead with it
// (700, 702, 214, 220, 999: [CUDA, "Error handling"]).
API void simgpu_fail_next_driver_call(const char* call, int device, int code) {
  std::lock_guard<std::mutex> lk(g_fail_call_mu);
  g_fail_call[{call, device}] = code;
}
API void simgpu_harness(int on) { t_harness = on != 0; }
API int simgpu_set_delay_us(void* stream, long us) {
  if (stream == nullptr) {
    g_default_delay_us = us;
    return 0;
  }
  Stream* s = nullptr;
  if (int rc = resolve(stream, &s)) return rc;
  s->delay_us = us;
  return 0;
}
// Like torch.cuda._sleep: occupies the stream for `us`.
API int simgpu_sleep(void* stream, long us) {
  return enqueue_run(stream, [us] { std::this_thread::sleep_for(std::chrono::microseconds(us)); });
}
// A stream-ordered copy (a "kernel" writing dst).
API int simgpu_copy(void* stream, void* dst, const void* src, size_t bytes) {
  Stream* s = nullptr;
  if (int rc = resolve(stream, &s)) return rc;
  Op op;
  op.run = [dst, src, bytes] {
    note_use(dst);
    std::memcpy(dst, src, bytes);
  };
  note_use_at(s, dst, enqueue(s, std::move(op)));
  return CUDA_SUCCESS;
}
// ---------------------------------------------------------------- graphs
API int cuStreamBeginCapture_v2(void* stream, int mode) {
  LIVE();
  // [CUDA] cuStreamBeginCapture: "Capture may not be initiated if stream is
  // CU_STREAM_LEGACY"; only on a stream not capturing already.
  if (reinterpret_cast<uintptr_t>(stream) <= 2) {
    return violation(900, "cuStreamBeginCapture on the default stream");
  }
  if (mode < 0 || mode > CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
  Stream* s = nullptr;
  if (int rc = resolve(stream, &s)) return rc;
  STICKY(s->ctx->device);
  std::lock_guard<std::mutex> lc(g_capture_mu);
  if (s->capture != nullptr) return violation(CUDA_ERROR_INVALID_VALUE, "cuStreamBeginCapture on a capturing stream");
  auto* c = new Capture;
  c->origin = s;
  c->mode = mode;
  c->thread = std::this_thread::get_id();
  c->id = g_next_capture_id++;
  c->members.insert(s);
  s->capture = c;
  g_active.insert(c);
  bump("capture_begin");
  return CUDA_SUCCESS;
}
// status: 0 none, 1 active, 2 invalidated (CUstreamCaptureStatus).
// [CUDA] cuStreamGetCaptureInfo_v2: status (0 none, 1 active, 2
// invalidated) and, while active, the capture's id (unique in the process);
// the graph and dependency outputs are not modelled (must be null).
API int cuStreamGetCaptureInfo_v2(void* stream, int* status, unsigned long long* id, void** graph,
                                  const void** deps, size_t* count) {
  LIVE();
  if (status == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (graph != nullptr || deps != nullptr || count != nullptr) {
    return violation(CUDA_ERROR_INVALID_VALUE, "cuStreamGetCaptureInfo_v2: graph and dependency outputs are not modelled");
  }
  Stream* s = nullptr;
  if (int rc = resolve(stream, &s)) return rc;
  std::lock_guard<std::mutex> lc(g_capture_mu);
  *status = s->capture == nullptr ? 0 : s->capture->error ? 2 : 1;
  if (id != nullptr && *status == 1) *id = s->capture->id;
  return CUDA_SUCCESS;
}
API int cuStreamIsCapturing(void* stream, int* status) {
  return cuStreamGetCaptureInfo_v2(stream, status, nullptr, nullptr, nullptr, nullptr);
}
API int cuThreadExchangeStreamCaptureMode(int* mode) {
  if (mode == nullptr || *mode < CU_STREAM_CAPTURE_MODE_GLOBAL || *mode > CU_STREAM_CAPTURE_MODE_RELAXED) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  std::swap(*mode, t_capture_mode);
  return CUDA_SUCCESS;
}
API int cuStreamEndCapture(void* stream, void** graph) {
  LIVE();
  *graph = nullptr;
  Stream* s = nullptr;
  if (int rc = resolve(stream, &s)) return rc;
  std::unique_ptr<Capture> c;
  {
    std::lock_guard<std::mutex> lc(g_capture_mu);
    if (s->capture == nullptr || s->capture->origin != s) {
      return violation(903, "cuStreamEndCapture on a stream that did not begin the capture");
    }
    if (s->capture->mode != CU_STREAM_CAPTURE_MODE_RELAXED && s->capture->thread != std::this_thread::get_id()) {
      return violation(908, "cuStreamEndCapture from another thread than its cuStreamBeginCapture");
    }
    c.reset(s->capture);
    g_active.erase(c.get());
    end_capture_locked(c.get());
  }
  if (c->error != 0) return 901;  // invalidated: no graph (the violation was logged then)
  // Every joined stream's last captured op must precede some op of the
  // origin, following stream order and each wait back to the record it
  // picked (the event's latest record before it in capture order), through
  // any number of streams, as CUDA's graph dependencies do.
  const std::vector<CapOp>& ops = c->ops;
  std::vector<std::vector<size_t>> next(ops.size());
  {
    std::map<Stream*, size_t> prev;     // stream -> its latest op so far
    std::map<Event*, size_t> recorded;  // event -> its latest record so far
    for (size_t i = 0; i < ops.size(); ++i) {
      auto p = prev.find(ops[i].stream);
      if (p != prev.end()) next[p->second].push_back(i);
      prev[ops[i].stream] = i;
      if (ops[i].kind == kCapRecord) recorded[ops[i].event] = i;
      if (ops[i].kind == kCapWait) {
        auto r = recorded.find(ops[i].event);
        if (r != recorded.end()) next[r->second].push_back(i);
      }
    }
  }
  for (Stream* m : c->members) {
    if (m == s || !c->last.count(m)) continue;
    std::vector<char> seen(ops.size(), 0);
    std::vector<size_t> todo{c->last[m]};
    bool joined = false;
    while (!todo.empty() && !joined) {
      const size_t i = todo.back();
      todo.pop_back();
      if (seen[i]) continue;
      seen[i] = 1;
      joined = ops[i].stream == s;
      for (size_t j : next[i]) todo.push_back(j);
    }
    if (!joined) {
      return violation(904, "cuStreamEndCapture: a stream that joined the capture was not joined back "
                            "into the origin stream");
    }
  }
  auto* g = new Graph{s, std::move(c->ops)};
  std::lock_guard<std::mutex> lc(g_capture_mu);
  g_graphs.insert(g);
  *graph = g;
  bump("capture_end");
  return CUDA_SUCCESS;
}
API int cuGraphDestroy(void* graph) {
  std::lock_guard<std::mutex> lc(g_capture_mu);
  if (!g_graphs.erase(graph)) return CUDA_ERROR_INVALID_HANDLE;
  delete static_cast<Graph*>(graph);
  return CUDA_SUCCESS;
}
API int cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long flags) {
  LIVE();
  (void)flags;
  Graph* g = nullptr;
  {
    std::lock_guard<std::mutex> lc(g_capture_mu);
    if (!g_graphs.count(graph)) return CUDA_ERROR_INVALID_HANDLE;
    g = static_cast<Graph*>(graph);
  }
  auto* x = new GraphExec;
  x->origin = g->origin;
  x->ops = g->ops;  // the graph may be destroyed; its exec stays valid
  for (const CapOp& op : x->ops) {
    if (op.stream != g->origin && !x->streams.count(op.stream)) {
      Stream* own = new_stream(op.stream->ctx);
      own->delay_us = op.stream->delay_us.load();
      x->streams[op.stream] = own;
    }
    if (op.event != nullptr && !x->events.count(op.event)) {
      auto* e = new Event;
      e->ctx = op.event->ctx;
      x->events[op.event] = e;
    }
  }
  std::lock_guard<std::mutex> lc(g_capture_mu);
  g_execs.insert(x);
  *exec = x;
  return CUDA_SUCCESS;
}
API int cuGraphLaunch(void* exec, void* stream) {
  LIVE();
  GraphExec* x = nullptr;
  {
    std::lock_guard<std::mutex> lc(g_capture_mu);
    if (!g_execs.count(exec)) return CUDA_ERROR_INVALID_HANDLE;
    x = static_cast<GraphExec*>(exec);
  }
  Stream* l = nullptr;
  if (int rc = resolve(stream, &l)) return rc;
  STICKY(l->ctx->device);
  {
    std::lock_guard<std::mutex> lc(g_capture_mu);
    if (l->capture != nullptr) return violation(900, "cuGraphLaunch into a capturing stream (not modelled)");
  }
  auto record = [](Stream* on, Event* e) {
    Op op;
    {
      std::lock_guard<std::mutex> le(e->mu);
      op.gen = ++e->recorded;
    }
    op.record = e;
    enqueue(on, std::move(op));
  };
  auto wait = [](Stream* on, Event* e) {
    Op op;
    {
      std::lock_guard<std::mutex> le(e->mu);
      op.gen = e->recorded;
    }
    if (op.gen == 0) return;
    op.wait = e;
    enqueue(on, std::move(op));
  };
  // The graph's own streams need no start of their own: each joined the
  // capture through a wait on an event recorded in it, so its replay waits
  // on one recorded after the launch stream's earlier work.
  for (const CapOp& op : x->ops) {
    Stream* on = op.stream == x->origin ? l : x->streams.at(op.stream);
    if (op.kind == kCapRun) {
      if (op.replayed) op.replayed();
      Op o;
      o.run = op.run;
      enqueue(on, std::move(o));
    } else if (op.kind == kCapRecord) {
      record(on, x->events.at(op.event));
    } else {
      wait(on, x->events.at(op.event));
    }
  }
  bump("graph_launch");
  return CUDA_SUCCESS;
}
API int cuGraphExecDestroy(void* exec) {
  std::lock_guard<std::mutex> lc(g_capture_mu);
  if (!g_execs.erase(exec)) return CUDA_ERROR_INVALID_HANDLE;
  auto* x = static_cast<GraphExec*>(exec);
  for (auto& [captured, own] : x->streams) {  // released once drained (cuStreamDestroy's rule)
    std::lock_guard<std::mutex> lk(own->mu);
    own->destroyed = true;
    own->cv.notify_all();
  }
  delete x;  // its events are kept: queued records may still complete them
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------- the test stream provider
// The test stream provider's state (tests/simgpu/simgpu.py, SimStreams) lives
// here, not in Python, so that pyddp._hot's C++ gradient hooks can ask it
// what torch's stream state answers on a GPU, with no Python call: the
// calling thread's current stream per device, the drain before a host write,
// and the late write of a gradient (SimStreams.produced).
namespace {
thread_local void* t_provider_stream[kMaxDevices] = {};
std::atomic<long> g_late_us{0};
}  // namespace
API void* simgpu_current_stream(int device) {
  return device >= 0 && device < kMaxDevices ? t_provider_stream[device] : nullptr;
}
API int simgpu_set_current_stream(int device, void* stream) {
  if (device < 0 || device >= kMaxDevices) return CUDA_ERROR_INVALID_DEVICE;
  t_provider_stream[device] = stream;
  return 0;
}
// Before a host write standing in for a kernel on the current stream of
// `device`: that stream drained (the test harness's wait, not pyddp's), then
// the write counted as its use of the device's memory. 700 where the
// device's context died (torch reports an illegal memory access).
API int simgpu_before_host_write(int device) {
  if (device < 0 || device >= num_devices()) return CUDA_ERROR_INVALID_DEVICE;
  void* stream = t_provider_stream[device];
  Ctx* saved = t_current;
  const bool harness = t_harness;
  t_current = &g_ctx[device];
  t_harness = true;
  const int rc = cuStreamSynchronize(stream);
  t_harness = harness;
  t_current = saved;
  if (rc != 0) return rc;
  return simgpu_host_use(device, stream);
}
API void simgpu_set_late_us(long us) { g_late_us.store(us); }
API long simgpu_late_us() { return g_late_us.load(); }
// A gradient torch wrote on the host stands for a kernel on `stream` of
// `device` still running: its bytes are taken out (all-ones bytes: NaN in
// every floating type) and written back `late_us` later in that stream's
// order, from a copy the queued write owns.
API int simgpu_produced(int device, void* stream, void* dst, size_t bytes) {
  const long us = g_late_us.load();
  if (us <= 0 || bytes == 0) return 0;
  if (device < 0 || device >= num_devices()) return CUDA_ERROR_INVALID_DEVICE;
  Stream* s = nullptr;
  if (int rc = resolve_on(device, stream, &s)) return rc;
  auto value = std::make_shared<std::vector<char>>(static_cast<char*>(dst),
                                                   static_cast<char*>(dst) + bytes);
  std::memset(dst, 0xFF, bytes);
  Op sleep;
  sleep.run = [us] { std::this_thread::sleep_for(std::chrono::microseconds(us)); };
  enqueue(s, std::move(sleep));
  Op write;
  write.run = [dst, value, bytes] {
    note_use(dst);
    std::memcpy(dst, value->data(), bytes);
  };
  note_use_at(s, dst, enqueue(s, std::move(write)));
  return 0;
}
API void simgpu_nccl_stall(int device, int on) {
  std::lock_guard<std::mutex> lk(g_nccl_mu);
  if (on) g_stalled.insert(device);
  else g_stalled.erase(device);
}
API void simgpu_nccl_fail_next(int device, int code) {
  std::lock_guard<std::mutex> lk(g_nccl_mu);
  g_fail_next[device] = code;
}
API int simgpu_violations(char* buf, size_t size) {
  // The checks of frees already made first (their markers may still be queued).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(hang_s());
  while (g_free_checks.load() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  std::lock_guard<std::mutex> lk(g_log_mu);
  std::string all;
  for (const auto& v : g_violations) all += v + "\n";
  if (buf && size) {
    std::strncpy(buf, all.c_str(), size - 1);
    buf[size - 1] = 0;
  }
  return static_cast<int>(g_violations.size());
}
API long simgpu_counter(const char* name) {
  std::lock_guard<std::mutex> lk(g_log_mu);
  auto it = g_counters.find(name);
  return it == g_counters.end() ? 0 : it->second;
}
API void simgpu_reset() {
  {
    std::lock_guard<std::mutex> lk(g_log_mu);
    g_violations.clear();
    g_counters.clear();
  }
  std::lock_guard<std::mutex> lk(g_nccl_mu);
  g_stalled.clear();
  g_fail_next.clear();
  {
    std::lock_guard<std::mutex> fail_lk(g_fail_call_mu);
    g_fail_call.clear();
  }
  g_default_delay_us = 0;
}
// Runs one of pyddp's kernels (the host compilation of reduce_kernels.cu) at
// once on the calling thread, as one thread of one block (the grid-stride
// loop covers `count`): its arithmetic alone, for closed-form sweeps wider
// than a launch through NCCL allows (the wire scaling for 1..64 ranks).
// p0, p1: the first two pointers; n, count, arg: the other arguments.
API int simgpu_run_kernel(const char* name, void* p0, void* p1, int n, long long count, int arg) {
  auto it = kKernels.find(name);
  if (it == kKernels.end()) return CUDA_ERROR_NOT_FOUND;
  simk::Ptrs ptrs{};
  ptrs.p[0] = p0;
  ptrs.p[1] = p1;
  void* params[] = {&ptrs, &n, &count, &arg};
  gridDim.x = blockDim.x = 1;
  blockIdx.x = threadIdx.x = 0;
  it->second(params);
  return CUDA_SUCCESS;
}
