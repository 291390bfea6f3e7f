// Self-checks that need real concurrency (no GIL): a stress run of the engine
// with random readiness orders from several threads, and the mark_ready cost
// measurement used by bench/. Called from tests and benchmarks only.
#pragma once

#include <cstdint>
#include <string>

namespace pyddp {

struct StressResult {
  int64_t iterations = 0;
  int64_t wrong_values = 0;  // elements that did not read N(N+1)/2 after finish()
  int64_t reductions = 0;
  std::string first_error;
};

// Every iteration: replica r fills r+1, a random subset of (replica, param)
// pairs is marked from `threads` threads in random order (the rest is left to
// finish()), then every element must read N(N+1)/2: a lost reduction leaves
// r+1, a doubled one multiplies the sum.
StressResult stress_engine(int replicas, int params, int64_t cap_bytes, bool index_order,
                           int iterations, int threads, uint64_t seed, double skip_fraction);

// Nanoseconds per mark_ready on one thread (reductions done by a no-op backend).
double bench_mark_ready(int replicas, int params, int iterations);

}  // namespace pyddp
