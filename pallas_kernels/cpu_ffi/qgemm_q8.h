// The q8 and FP8 tiles of the CPU quantized matmul kernel (stacked_qgemm.cc): codes [P, K, 16]
// (int8, or FP8 E4M3 widened in registers: `Fp8s`, quant_simd.h) with one scale per B values
// along K of each column (f16, FP8's f32), summed per block in registers then scaled.

#ifndef JAXSERVE_CPU_QGEMM_Q8_H_
#define JAXSERVE_CPU_QGEMM_Q8_H_

#include <cstdint>
#include <cstring>

#include "qgemm_q4.h"
#include "quant_simd.h"
#include "simd.h"

namespace jaxserve_cpu::qgemm {

// kLanes codes as floats: int8, or FP8 E4M3 times 2^-8 (`Fp8s`, undone by `Scales`).
template <bool FP8>
inline vec Codes8(const uint8_t* p) {
  if constexpr (FP8) {
    return jaxserve_cpu::Fp8s(p);
  } else {
    return jaxserve_cpu::Int8s(p);
  }
}

// kLanes scales at element `at` of a job's scales: f16, or FP8's f32 times 2^8.
template <bool FP8>
inline vec Scales(const Job& j, int64_t at) {
  if constexpr (FP8) {
    return jaxserve_cpu::Floats(static_cast<const float*>(j.s) + at) * jaxserve_cpu::kFp8Unit;
  } else {
    return jaxserve_cpu::Halfs(static_cast<const uint16_t*>(j.s) + at);
  }
}

// q8/FP8: rows [r0, r0 + RM) of x times NV vectors of columns of unit u from column `col`.
template <int RM, int NV, bool FP8>
void Tile(const Job& j, int64_t u, int64_t col, int64_t r0) {
  const int64_t K = j.K, nb = K / j.B;
  const uint8_t* qp[NV];
  int64_t sp[NV];  // where vector v's scales start
  for (int v = 0; v < NV; ++v) {
    const int64_t c = col + kLanes * v;
    const int64_t panel = u * kUnit + c / kPanel;
    qp[v] = j.q + panel * K * kPanel + c % kPanel;
    sp[v] = panel * nb * kPanel + c % kPanel;
  }
  const float* xr = j.x + r0 * K;
  vec acc[RM][NV];
  for (int i = 0; i < RM; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vec{};
  for (int64_t b = 0; b < nb; ++b) {
    vec part[RM][NV];  // this block's sums of x * q
    for (int i = 0; i < RM; ++i)
      for (int v = 0; v < NV; ++v) part[i][v] = vec{};
    int64_t k = b * j.B;
#if defined(__AVX512F__)
    if constexpr (FP8) {  // a vector is a whole panel: rows k and k + 1 lie side by side
      for (; k + 2 <= (b + 1) * j.B; k += 2) {
        vec w[NV], w1[NV];
        for (int v = 0; v < NV; ++v) jaxserve_cpu::Fp8Pair(qp[v] + k * kPanel, &w[v], &w1[v]);
        for (int i = 0; i < RM; ++i) {
          const float x0 = xr[i * K + k], x1 = xr[i * K + k + 1];
          for (int v = 0; v < NV; ++v) part[i][v] += x0 * w[v] + x1 * w1[v];
        }
      }
    }
#endif
    for (; k < (b + 1) * j.B; ++k) {
      vec w[NV];
      for (int v = 0; v < NV; ++v) {
        w[v] = Codes8<FP8>(qp[v] + k * kPanel);
      }
      for (int i = 0; i < RM; ++i) {
        const float xv = xr[i * K + k];
        for (int v = 0; v < NV; ++v) part[i][v] += xv * w[v];
      }
    }
    for (int v = 0; v < NV; ++v) {
      const vec sv = Scales<FP8>(j, sp[v] + b * kPanel);
      for (int i = 0; i < RM; ++i) acc[i][v] += part[i][v] * sv;
    }
  }
  const int64_t c0 = u * kUnit * kPanel + col;
  for (int i = 0; i < RM; ++i) {
    for (int v = 0; v < NV; ++v) {
      std::memcpy(j.y + (r0 + i) * j.N + c0 + kLanes * v, &acc[i][v], sizeof(vec));
    }
  }
}

// Unit u into its columns of y, in tiles of RM rows x NV vectors (remainder rows through
// smaller tiles).
template <int RM, int NV, bool FP8>
void RunUnitTiled(const Job& j, int64_t u) {
  constexpr int64_t kCols = kUnit * kPanel;
  static_assert(kCols % (NV * kLanes) == 0, "a tile's columns divide the unit");
  static_assert(RM <= 8, "remainder tiles go up to 7 rows");
  for (int64_t col = 0; col < kCols; col += NV * kLanes) {
    int64_t r = 0;
    for (; r + RM <= j.M; r += RM) Tile<RM, NV, FP8>(j, u, col, r);
    switch (j.M - r) {
#define JAXSERVE_TILE(n)                                    \
      case n:                                               \
        if constexpr (n < RM) Tile<n, NV, FP8>(j, u, col, r);  \
        break;
      JAXSERVE_TILE(7) JAXSERVE_TILE(6) JAXSERVE_TILE(5) JAXSERVE_TILE(4)
      JAXSERVE_TILE(3) JAXSERVE_TILE(2) JAXSERVE_TILE(1)
#undef JAXSERVE_TILE
      default: break;
    }
  }
}

}  // namespace jaxserve_cpu::qgemm

#endif  // JAXSERVE_CPU_QGEMM_Q8_H_
