// The layer matmuls of the `cpu` backend (an XLA FFI custom call): y[M, 16 P] = x[M, K] @
// W[layer], reading one layer's weights in place from the stacked, panel-packed weights
// f32[L, P, K, 16] (`gemm.pack`), so the layer loop makes no copy of the layer's weights,
// spread over XLA's intra-op thread pool one unit of three panels (48 columns) at a time.
//
// Each panel is K x 16 contiguous floats, a unit three consecutive panels. A tile of rows x
// columns keeps its sums in vector registers (GCC vector extensions, as wide as the CPU's:
// AVX-512 or AVX/AVX2): with AVX-512, 8 rows x the whole unit (8 x 3 registers of 16
// floats); with AVX2's 16 registers, 6 rows x one panel (6 x 2 of 8 floats; three passes
// over the unit), or 2 rows x the whole unit when a call has fewer than 6 rows (simd.h: why
// the width follows the CPU). A tile's weights are then one contiguous stream per panel:
// with 48-column rows (the layout before), AVX2's 16-column passes read every third line
// and ran 1.1-1.15x slower. A thread claims its next unit before it starts the current one
// and prefetches it into L2 while it computes, spread over the current unit's tiles: the
// weights then stream from memory under the arithmetic instead of stalling the first tile
// of every unit (on AVX2 from 6 rows on; below, the hardware prefetchers do better alone).

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>

#include "pool.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 16;  // columns per panel (one 64-byte line per k)
constexpr int64_t kUnit = 3;    // panels per unit of work (48 columns)

using jaxserve_cpu::kLanes;  // floats per vector register (simd.h)
using jaxserve_cpu::vec;

inline vec Load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void Store(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }

constexpr int64_t kLine = 16;  // floats per 64-byte cache line

// Rows [r0, r0 + RM) of x times columns [c0, c0 + NV vectors) of one unit (`unit` points at
// its first panel, `col` is the tile's first column in it) into y; prefetches `lines` cache
// lines per k step into L2 from float `pf` of the next unit `pf_unit` on (this tile's share
// of it), up to float `pf_size` (an offset, so that no pointer runs past the buffer). The
// k steps that prefetch run as a loop of their own: with many rows most tiles have none,
// and their loop is the multiply-adds alone.
template <int RM, int NV>
void Tile(const float* x, const float* unit, int64_t col, float* y, int64_t K, int64_t N,
          int64_t r0, int64_t c0, const float* pf_unit, int64_t pf, int64_t lines,
          int64_t pf_size) {
  static_assert(kPanel % kLanes == 0 || kLanes % kPanel == 0, "vectors tile the panels");
  vec acc[RM][NV];
  for (int i = 0; i < RM; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vec{};
  const float* w[NV];  // vector v's column block at k = 0: its panel, its offset in it
  for (int v = 0; v < NV; ++v) {
    const int64_t c = col + kLanes * v;
    w[v] = unit + c / kPanel * K * kPanel + c % kPanel;
  }
  const float* xr = x + r0 * K;
  auto step = [&](int64_t k) {
    vec wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = Load(w[v] + k * kPanel);
    for (int i = 0; i < RM; ++i) {
      const float xv = xr[i * K + k];
      for (int v = 0; v < NV; ++v) acc[i][v] += xv * wv[v];
    }
  };
  // k steps whose `lines` prefetches all lie inside the next unit (whole steps).
  const int64_t per_step = lines * kLine;
  const int64_t kp = per_step > 0 && pf < pf_size
                         ? std::min(K, (pf_size - pf) / per_step) : 0;
  int64_t k = 0;
  for (const float* q = kp > 0 ? pf_unit + pf : nullptr; k < kp; ++k) {  // no pointer past it
    for (int64_t l = 0; l < lines; ++l, q += kLine) __builtin_prefetch(q, 0, 2);
    step(k);
  }
  for (; k < K; ++k) step(k);
  for (int i = 0; i < RM; ++i) {
    for (int v = 0; v < NV; ++v) Store(y + (r0 + i) * N + c0 + kLanes * v, acc[i][v]);
  }
}

struct Job {
  const float* x;  // f32[M, K]
  const float* w;  // f32[U * 3, K, 16]: this layer's panels, U units of three
  float* y;        // f32[M, U * 48]
  int64_t M, K, N, U;
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable cv;
};

// Unit u into its columns of y, in tiles of RM rows x NV vectors (the remainder rows
// through smaller tiles), prefetching unit `next` (j.U: none) meanwhile.
template <int RM, int NV>
void RunUnitTiled(const Job& j, int64_t u, int64_t next) {
  constexpr int64_t kCols = kUnit * kPanel;  // columns per unit
  static_assert(kCols % (NV * kLanes) == 0, "a tile's columns divide the unit");
  static_assert(RM <= 8, "remainder tiles go up to 7 rows");
  constexpr int64_t kPasses = kCols / (NV * kLanes);  // column passes over the unit
  const int64_t size = j.K * kCols;  // floats per unit
  const float* unit = j.w + u * size;
  const int64_t tiles = (j.M + RM - 1) / RM * kPasses;
  // Each tile prefetches `lines` lines per k step: all tiles together cover the unit.
  const int64_t lines = next < j.U ? (size / kLine + tiles * j.K - 1) / (tiles * j.K) : 0;
  const float* pf_unit = j.w + next * size;  // (one past the layer's units: lines is 0)
  int64_t pf = 0;
  for (int64_t pass = 0; pass < kPasses; ++pass) {
    const int64_t col = pass * NV * kLanes;
    const int64_t c0 = u * kCols + col;
    int64_t r = 0;
    for (; r + RM <= j.M; r += RM, pf += lines * j.K * kLine) {
      Tile<RM, NV>(j.x, unit, col, j.y, j.K, j.N, r, c0, pf_unit, pf, lines, size);
    }
    switch (j.M - r) {
#define JAXSERVE_TILE(n)                                                              \
      case n:                                                                         \
        if constexpr (n < RM) {                                                       \
          Tile<n, NV>(j.x, unit, col, j.y, j.K, j.N, r, c0, pf_unit, pf, lines, size);  \
          pf += lines * j.K * kLine;                                                  \
        }                                                                             \
        break;
      JAXSERVE_TILE(7) JAXSERVE_TILE(6) JAXSERVE_TILE(5) JAXSERVE_TILE(4)
      JAXSERVE_TILE(3) JAXSERVE_TILE(2) JAXSERVE_TILE(1)
#undef JAXSERVE_TILE
      default: break;
    }
  }
}

void RunUnit(const Job& j, int64_t u, int64_t next) {
#if defined(__AVX512F__)
  RunUnitTiled<8, 3>(j, u, next);  // 24 of the 32 registers hold sums
#else
  // 12 of the 16 registers hold sums; few rows: one pass, the weights read once, and no
  // prefetch of the next unit: the hardware's own prefetchers stream three contiguous
  // panels faster alone (1.3-1.4x at 1-2 rows; from 8 rows on the prefetch pays a little).
  if (j.M >= 6) {
    RunUnitTiled<6, 2>(j, u, next);
  } else {
    RunUnitTiled<2, 6>(j, u, j.U);
  }
#endif
}

// Claims units until none are left (the calling thread and the pool's helpers alike),
// each one unit ahead of the one it computes, so that it can prefetch it.
void Drain(Job& j) {
  int64_t finished = 0;
  for (int64_t u = j.next.fetch_add(1), q; u < j.U; u = q, ++finished) {
    q = j.next.fetch_add(1);
    RunUnit(j, u, std::min(q, j.U));
  }
  jaxserve_cpu::MarkDone(j.done, finished, j.U, j.mu, j.cv);
}

ffi::Error StackedGemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> layer,
                           ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[3] != kPanel || wd[1] % kUnit != 0 ||
      wd[2] != xd[1] || wd[0] < 1 || layer.element_count() < 1 ||
      y->element_count() != xd[0] * wd[1] * kPanel) {
    return ffi::Error::InvalidArgument("stacked_gemm: inconsistent shapes");
  }
  auto job = std::make_shared<Job>();
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, wd[0] - 1);
  job->M = jaxserve_cpu::RowsToCompute(layer.typed_data(), layer.element_count(), xd[0]);
  job->K = xd[1], job->U = wd[1] / kUnit, job->N = wd[1] * kPanel;
  job->x = x.typed_data();
  job->w = w.typed_data() + l * wd[1] * wd[2] * kPanel;
  job->y = y->typed_data();
  std::fill(job->y + job->M * job->N, job->y + xd[0] * job->N, 0.0f);  // padding rows
  if (job->U == 0 || job->M == 0) return ffi::Error::Success();
  const int64_t helpers = jaxserve_cpu::Helpers(pool.num_threads(), job->U);
  jaxserve_cpu::RunParallel(helpers, [job] { Drain(*job); },
                            [&pool](auto task) { pool.Schedule(std::move(task)); }, job->done, job->U,
                            job->mu, job->cv);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StackedGemm, StackedGemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // stacked packed weights
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
