// Shared by the CPU kernels (paged_decode.cc, stacked_gemm.cc, stacked_qgemm.cc,
// lora_sgmv.cc): how many threads a custom call runs on, and how its caller and helpers
// hand finished work back.
//
// A call's caller works too and claims items from an atomic counter like its helpers; it
// then waits only for items another thread claimed, so a helper that never starts cannot
// deadlock the call. Helpers are this process's spinning helper threads (`SpinPool`), else
// (JAXSERVE_CPU_SPIN_US=0) tasks on XLA's intra-op pool.

#ifndef JAXSERVE_CPU_DECODE_POOL_H_
#define JAXSERVE_CPU_DECODE_POOL_H_

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace jaxserve_cpu {

// CPUs this process may run on. The caller plus cores - 1 helpers keep every core busy;
// XLA's pool has one thread per core and the caller is not one of them, so a helper more
// only waits for a core (measured: ~0.7 ms late on 2 cores, after the work was gone).
inline int64_t UsableCores() {
  static const int64_t cores = [] {
    cpu_set_t set;
    return sched_getaffinity(0, sizeof(set), &set) == 0 ? std::max(1, CPU_COUNT(&set)) : 1;
  }();
  return cores;
}

// The rows of x a layer matmul computes: its `index` operand is i32[1] (the layer: every
// row) or i32[2] (the layer and the step's real rows; the padding rows after them are
// written as zeros, not computed), clamped into [0, rows].
inline int64_t RowsToCompute(const int32_t* index, int64_t count, int64_t rows) {
  return count >= 2 ? std::clamp<int64_t>(index[1], 0, rows) : rows;
}

// Helpers worth scheduling for `items` units of work on a pool of `pool_threads`.
inline int64_t Helpers(int64_t pool_threads, int64_t items) {
  return std::max<int64_t>(0, std::min({pool_threads, items - 1, UsableCores() - 1}));
}

// Counts `finished` more items of `total` done; the thread that completes the call wakes
// its caller.
inline void MarkDone(std::atomic<int64_t>& done, int64_t finished, int64_t total,
                     std::mutex& mu, std::condition_variable& cv) {
  if (finished && done.fetch_add(finished) + finished == total) {
    std::lock_guard<std::mutex> lock(mu);
    cv.notify_all();
  }
}

// A spin-wait hint to the core (x86 `pause`, Arm `yield`); nothing elsewhere.
inline void Pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
  asm volatile("yield");
#endif
}

// Blocks until `done` reaches `total`. Spins briefly first (up to ~0.3 ms): the last
// helper usually finishes within microseconds, sooner than a sleeping thread wakes.
inline void AwaitDone(const std::atomic<int64_t>& done, int64_t total, std::mutex& mu,
                      std::condition_variable& cv) {
  constexpr int kSpins = 20000;  // pause instructions before sleeping
  for (int spin = 0; spin < kSpins && done.load(std::memory_order_acquire) != total; ++spin) {
    Pause();
  }
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done.load() == total; });
}

// Helper threads that wait for the next call by spinning for a short window after each
// one (`JAXSERVE_CPU_SPIN_US`, default 200 us), then sleep. A decode step makes ~250
// calls tens of microseconds apart: waking a sleeping thread of XLA's pool for each one
// cost more than some calls' work (BENCHMARKS.md, "spinning helpers"). One pool per
// process: `Get` is an inline function's static, which GCC makes a unique symbol, so
// every kernel library shares it and helpers never outnumber the cores.
class SpinPool {
 public:
  static SpinPool& Get() {
    // Leaked: helpers run until the process ends.
    static SpinPool* pool = new SpinPool(UsableCores() - 1, SpinMicros());
    return *pool;
  }

  // Offers `task` to up to `helpers` helpers (each runs a copy of it once) and returns at
  // once; false when the pool is off (JAXSERVE_CPU_SPIN_US=0). The task must own what it
  // touches (a shared_ptr to its job): a helper may start it after its caller returned.
  bool Offer(int64_t helpers, std::function<void()> task) {
    if (threads_.empty()) return false;
    auto shared = std::make_shared<std::function<void()>>(std::move(task));
    {
      std::lock_guard<std::mutex> lock(task_mu_);
      task_ = std::move(shared);
      open_ = std::min<int64_t>(helpers, static_cast<int64_t>(threads_.size()));
    }
    gen_.fetch_add(1);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    return true;
  }

 private:
  SpinPool(int64_t threads, int64_t spin_us) : spin_us_(spin_us) {
    if (spin_us <= 0) return;
    for (int64_t i = 0; i < threads; ++i) {
      threads_.emplace_back([this] { Loop(); });
      threads_.back().detach();
    }
  }

  static int64_t SpinMicros() {
    const char* v = std::getenv("JAXSERVE_CPU_SPIN_US");
    return v && *v ? std::atoll(v) : 200;
  }

  void Loop() {
    uint64_t seen = gen_.load();
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      for (int spin = 1; gen_.load(std::memory_order_acquire) == seen; ++spin) {
        Pause();
        if (spin % 64 != 0) continue;
        if (std::chrono::steady_clock::now() - start > std::chrono::microseconds(spin_us_)) {
          sleepers_.fetch_add(1);
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return gen_.load() != seen; });
          sleepers_.fetch_sub(1);
        } else {
          std::this_thread::yield();  // a loaded machine's other threads go first
        }
      }
      seen = gen_.load();
      std::shared_ptr<std::function<void()>> task;
      {
        std::lock_guard<std::mutex> lock(task_mu_);
        if (open_ > 0) --open_, task = task_;
      }
      if (task) (*task)();
    }
  }

  const int64_t spin_us_;
  std::vector<std::thread> threads_;
  std::mutex mu_, task_mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int64_t> sleepers_{0};
  std::shared_ptr<std::function<void()>> task_;  // guarded by task_mu_
  int64_t open_ = 0;                              // guarded by task_mu_
};

// Runs `drain()` (claims items until none are left) on this thread and `helpers` others:
// the spinning helpers, else tasks that `schedule(drain)` puts on XLA's pool; then waits
// for the items other threads claimed (`done` reaching `total`). `drain` owns its job.
template <class Drain, class Schedule>
void RunParallel(int64_t helpers, Drain drain, Schedule schedule, std::atomic<int64_t>& done,
                 int64_t total, std::mutex& mu, std::condition_variable& cv) {
  if (helpers > 0 && !SpinPool::Get().Offer(helpers, drain)) {
    for (int64_t i = 0; i < helpers; ++i) schedule(drain);
  }
  drain();
  AwaitDone(done, total, mu, cv);
}

}  // namespace jaxserve_cpu

#endif  // JAXSERVE_CPU_DECODE_POOL_H_
