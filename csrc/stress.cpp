// Engine stress run and mark_ready cost: see stress.h.
#include "stress.h"

#include <algorithm>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "bucket_plan.h"
#include "cpu_backend.h"
#include "engine.h"

namespace pyddp {

namespace {

class NullBackend : public Backend {
 public:
  std::string name() const override { return "null"; }
  void all_reduce(const std::vector<BufferRef>&, ReduceOp, int) override {}
};

struct Layout {
  std::vector<ParamInfo> params;
  std::vector<std::vector<int>> buckets;
};

Layout make_layout(int params, int64_t cap_bytes, std::mt19937_64& rng) {
  Layout l;
  std::vector<int64_t> numels;
  std::vector<DType> dtypes;
  std::vector<int> order;
  std::uniform_int_distribution<int64_t> size(1, 3000);
  for (int p = 0; p < params; ++p) {
    l.params.push_back(ParamInfo{"p" + std::to_string(p), size(rng), DType::kFloat32});
    numels.push_back(l.params.back().numel);
    dtypes.push_back(DType::kFloat32);
    order.push_back(params - 1 - p);
  }
  l.buckets = plan_buckets(numels, dtypes, order, cap_bytes, cap_bytes);
  return l;
}

}  // namespace

StressResult stress_engine(int replicas, int params, int64_t cap_bytes, bool index_order,
                           int iterations, int threads, uint64_t seed, double skip_fraction) {
  PYDDP_ENFORCE(replicas >= 1 && params >= 1 && threads >= 1 && iterations >= 0,
                "bad stress arguments: replicas ", replicas, ", params ", params, ", threads ",
                threads, ", iterations ", iterations);
  std::mt19937_64 rng(seed);
  Layout layout = make_layout(params, cap_bytes, rng);
  const auto nb = layout.buckets.size();
  Engine engine(replicas, layout.params, layout.buckets,
                index_order ? LaunchOrder::kIndex : LaunchOrder::kReady, ReduceOp::kSum,
                std::make_shared<CpuBackend>(2));
  std::vector<std::vector<std::vector<float>>> storage(replicas, std::vector<std::vector<float>>(nb));
  for (int r = 0; r < replicas; ++r) {
    for (size_t b = 0; b < nb; ++b) {
      int64_t count = 0;
      for (int p : layout.buckets[b]) count += layout.params[p].numel;
      storage[r][b].resize(count);
      BufferRef ref;
      ref.data = storage[r][b].data();
      ref.count = count;
      engine.set_buffer(r, static_cast<int>(b), ref);
    }
  }
  // Every parameter holds a gradient from the start, so each bucket must be
  // reduced every iteration, marked or not (None-gradient handling is tested
  // separately).
  for (int p = 0; p < params; ++p) engine.note_grad(p, true);
  const float expected = replicas * (replicas + 1) / 2.0f;
  StressResult result;
  std::vector<std::pair<int, int>> marks;
  std::bernoulli_distribution skip(skip_fraction);
  for (int it = 0; it < iterations; ++it) {
    for (int r = 0; r < replicas; ++r) {
      for (auto& buf : storage[r]) std::fill(buf.begin(), buf.end(), static_cast<float>(r + 1));
      engine.take_reduced_copy(r);
    }
    marks.clear();
    for (int r = 0; r < replicas; ++r) {
      for (int p = 0; p < params; ++p) {
        if (!skip(rng)) marks.emplace_back(r, p);
      }
    }
    std::shuffle(marks.begin(), marks.end(), rng);
    std::vector<std::thread> pool;
    std::vector<std::string> errors(threads);
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        try {
          for (size_t i = t; i < marks.size(); i += threads) {
            engine.mark_ready(marks[i].first, marks[i].second);
          }
        } catch (const std::exception& e) {
          errors[t] = e.what();
        }
      });
    }
    for (auto& th : pool) th.join();
    for (auto& e : errors) {
      if (!e.empty() && result.first_error.empty()) result.first_error = e;
    }
    try {
      engine.finish();
    } catch (const std::exception& e) {
      if (result.first_error.empty()) result.first_error = e.what();
    }
    result.reductions += engine.last_stats().launches;
    for (int r = 0; r < replicas; ++r) {
      for (auto& buf : storage[r]) {
        for (float v : buf) result.wrong_values += (v != expected);
      }
    }
    ++result.iterations;
  }
  return result;
}

double bench_mark_ready(int replicas, int params, int iterations) {
  std::vector<ParamInfo> infos;
  std::vector<std::vector<int>> buckets;
  for (int p = 0; p < params; ++p) {
    infos.push_back(ParamInfo{"p", 1, DType::kFloat32});
    buckets.push_back({p});
  }
  Engine engine(replicas, infos, buckets, LaunchOrder::kReady, ReduceOp::kSum,
                std::make_shared<NullBackend>());
  std::vector<float> dummy(static_cast<size_t>(replicas) * params);
  for (int r = 0; r < replicas; ++r) {
    for (int p = 0; p < params; ++p) {
      BufferRef ref;
      ref.data = &dummy[static_cast<size_t>(r) * params + p];
      ref.count = 1;
      engine.set_buffer(r, p, ref);
    }
  }
  int64_t marking = 0;
  for (int it = 0; it < iterations; ++it) {
    for (int r = 0; r < replicas; ++r) engine.take_reduced_copy(r);
    const int64_t t0 = now_ns();
    for (int p = 0; p < params; ++p) {
      for (int r = 0; r < replicas; ++r) engine.mark_ready(r, p);
    }
    marking += now_ns() - t0;
    engine.finish();
  }
  return static_cast<double>(marking) / (static_cast<double>(iterations) * params * replicas);
}

}  // namespace pyddp
