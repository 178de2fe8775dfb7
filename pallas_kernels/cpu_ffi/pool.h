// Shared by the CPU kernels (paged_decode.cc, stacked_gemm.cc): how many threads a custom
// call runs on, and how its caller and helpers hand finished work back.
//
// A call's caller works too and claims items from an atomic counter like its helpers
// (tasks on XLA's intra-op pool); it then waits only for items another thread claimed,
// so a pool that never starts a helper cannot deadlock the call.

#ifndef JAXSERVE_CPU_DECODE_POOL_H_
#define JAXSERVE_CPU_DECODE_POOL_H_

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>

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

}  // namespace jaxserve_cpu

#endif  // JAXSERVE_CPU_DECODE_POOL_H_
