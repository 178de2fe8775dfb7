// The `cpu` backend's layer matmuls over quantized weights (XLA FFI custom calls):
// y[M, 16 P] = x[M, K] @ dequantize(W[layer]), reading one layer's codes in place from the
// stacked, panel-packed quantized weights (`qgemm.pack`) and dequantizing them in registers:
// no float copy of the weight is ever written.
//
// Two formats (`models/quant.py`): q8, codes i8[L, P, K, 16] with scales f16[L, P, K / B, 16]
// (B = 32 for Q8_0, B = K for int8 per channel), w = q * s; q4, codes u8[L, P, K / 2, 16]
// (packed row 16 b + j holds value 32 b + j in its low nibble and 32 b + 16 + j in its high
// one) with scales and zeros f16[L, P, K / 32, 16], w = q * s + z. Each leaf keeps the
// 16-column panels of `stacked_gemm.cc`, so a tile's codes, scales and zeros are three
// contiguous streams.
//
// A tile of rows x columns sums x * q (codes converted to float) over one block in
// registers, then adds block_sum * s (+ z * the block's sum of x, precomputed once per call)
// to its totals; the caller and the pool's helpers claim units of three panels (48 columns)
// from an atomic counter, as in `stacked_gemm.cc`. Decode (a few rows) is bound by reading
// the codes: the tile shapes keep enough independent sums to hide the FMA latency. From
// `kStageRows` rows on (prefill, large batches) converting the codes once per row tile
// would dominate: a unit (48 columns) is dequantized once into a per-thread scratch that
// stays in cache (never a copy of the whole weight in memory) and all row tiles read it.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "pool.h"
#include "quant_simd.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 16;   // columns per panel
constexpr int64_t kUnit = 3;     // panels per unit of work (48 columns)
constexpr int64_t kQ4Block = 32;  // values per q4 block (16 packed rows)
constexpr int64_t kStageCols = kUnit * kPanel;  // columns of a unit
constexpr int64_t kStageRows = 12;  // rows from which a unit is dequantized once (staged)

using jaxserve_cpu::Halfs;  // conversions in registers (quant_simd.h)
using jaxserve_cpu::Int8s;
using jaxserve_cpu::kLanes;  // floats per vector register (simd.h)
using jaxserve_cpu::vec;
struct Job {
  bool q4;
  const float* x;        // f32[M, K]
  const float* xsum;     // f32[M, K / 32]: each q4 block's sum of x (q8: unused)
  const int8_t* xq;      // i8[M, K]: q4, x quantized per block of 32 (`QuantizeRows`)
  const int8_t* xr;      // i8[M, K]: q4, what that rounding left, quantized again
  const float* xd;       // f32[M, K / 32]: q4, each block's scale (max |x| / 127)
  const uint8_t* q;      // this layer's codes: q8 i8[P, K, 16], q4 u8[P, K / 2, 16]
  const uint16_t* s;     // f16[P, K / B, 16]
  const uint16_t* z;     // f16[P, K / 32, 16] (q4)
  float* y;              // f32[M, P * 16]
  int64_t M, K, N, U, B;  // rows, contraction, columns, units, block
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable cv;
};

// q8: rows [r0, r0 + RM) of x times NV vectors of columns of unit u from column `col` of it.
template <int RM, int NV>
void Tile(const Job& j, int64_t u, int64_t col, int64_t r0) {
  const int64_t K = j.K, nb = K / j.B;
  const uint8_t* qp[NV];
  const uint16_t* sp[NV];
  for (int v = 0; v < NV; ++v) {
    const int64_t c = col + kLanes * v;
    const int64_t panel = u * kUnit + c / kPanel;
    qp[v] = j.q + panel * K * kPanel + c % kPanel;
    sp[v] = j.s + panel * nb * kPanel + c % kPanel;
  }
  const float* xr = j.x + r0 * K;
  vec acc[RM][NV];
  for (int i = 0; i < RM; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vec{};
  for (int64_t b = 0; b < nb; ++b) {
    vec part[RM][NV];  // this block's sums of x * q
    for (int i = 0; i < RM; ++i)
      for (int v = 0; v < NV; ++v) part[i][v] = vec{};
    for (int64_t k = b * j.B; k < (b + 1) * j.B; ++k) {
      vec w[NV];
      for (int v = 0; v < NV; ++v) {
        w[v] = Int8s(qp[v] + k * kPanel);
      }
      for (int i = 0; i < RM; ++i) {
        const float xv = xr[i * K + k];
        for (int v = 0; v < NV; ++v) part[i][v] += xv * w[v];
      }
    }
    for (int v = 0; v < NV; ++v) {
      const vec sv = Halfs(sp[v] + b * kPanel);
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

// q4 times activations split into two int8 parts, x = d (xq + xr / 254) + O(d / 508), d =
// max |x| / 127 over a block of 32 (`QuantizeRows`): rows [r0, r0 + RM) x panel `panel` of
// y. The codes of a panel's block (32 values x 16 columns, 256 bytes, `qgemm.pack`) lie as
// [2 column groups][4 groups of 4 values][8 columns][4 values], so one 32-byte load gives
// 8 columns x 4 consecutive values (low nibbles) and the 4 values 16 further on (high
// nibbles); `maddubs` multiplies them with 4 broadcast int8 activations and adds pairs, 32
// products an instruction. The block's 16-bit sums (at most 8 x 2 x 15 x 127 < 2^15) become
// int32 and float once per block: y += s d (sum(q xq) + sum(q xr) / 254) + z sum(x). The
// second part keeps x to ~15 bits (one part alone, as llama.cpp's Q8 activations, moved
// greedy choices of the default model against its float32 weights).
template <int RM>
void DotTile(const Job& j, int64_t panel, int64_t r0) {
  const int64_t K = j.K, nb = K / kQ4Block;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 fine = _mm256_set1_ps(1.0f / 254.0f);
  const uint8_t* qp = j.q + panel * (K / 2) * kPanel;
  const uint16_t* sp = j.s + panel * nb * kPanel;
  const uint16_t* zp = j.z + panel * nb * kPanel;
  __m256 acc[RM][2];
  for (int i = 0; i < RM; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* qb = qp + b * kQ4Block * kPanel / 2;
    __m256i coarse[RM][2], rest[RM][2];
    for (int i = 0; i < RM; ++i) {
      coarse[i][0] = coarse[i][1] = rest[i][0] = rest[i][1] = _mm256_setzero_si256();
    }
    for (int g = 0; g < 4; ++g) {
      __m256i lo[2], hi[2];
      for (int c = 0; c < 2; ++c) {
        const __m256i w = _mm256_loadu_si256((const __m256i*)(qb + c * 128 + g * 32));
        lo[c] = _mm256_and_si256(w, low);
        hi[c] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
      }
      for (int i = 0; i < RM; ++i) {
        const int64_t off = (r0 + i) * K + b * kQ4Block + 4 * g;
        int32_t v[4];
        std::memcpy(&v[0], j.xq + off, 4);
        std::memcpy(&v[1], j.xq + off + kQ4Block / 2, 4);
        std::memcpy(&v[2], j.xr + off, 4);
        std::memcpy(&v[3], j.xr + off + kQ4Block / 2, 4);
        const __m256i xl = _mm256_set1_epi32(v[0]), xh = _mm256_set1_epi32(v[1]);
        const __m256i rl = _mm256_set1_epi32(v[2]), rh = _mm256_set1_epi32(v[3]);
        for (int c = 0; c < 2; ++c) {
          coarse[i][c] = _mm256_add_epi16(
              coarse[i][c], _mm256_add_epi16(_mm256_maddubs_epi16(lo[c], xl),
                                             _mm256_maddubs_epi16(hi[c], xh)));
          rest[i][c] = _mm256_add_epi16(
              rest[i][c], _mm256_add_epi16(_mm256_maddubs_epi16(lo[c], rl),
                                           _mm256_maddubs_epi16(hi[c], rh)));
        }
      }
    }
    for (int c = 0; c < 2; ++c) {
      const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sp + b * kPanel + c * 8)));
      const __m256 zv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(zp + b * kPanel + c * 8)));
      for (int i = 0; i < RM; ++i) {
        const __m256 f = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(_mm256_madd_epi16(rest[i][c], ones)), fine,
            _mm256_cvtepi32_ps(_mm256_madd_epi16(coarse[i][c], ones)));
        const __m256 sd = _mm256_mul_ps(sv, _mm256_set1_ps(j.xd[(r0 + i) * nb + b]));
        acc[i][c] = _mm256_fmadd_ps(f, sd, acc[i][c]);
        acc[i][c] = _mm256_fmadd_ps(zv, _mm256_set1_ps(j.xsum[(r0 + i) * nb + b]), acc[i][c]);
      }
    }
  }
  for (int i = 0; i < RM; ++i) {
    for (int c = 0; c < 2; ++c) {
      _mm256_storeu_ps(j.y + (r0 + i) * j.N + panel * kPanel + c * 8, acc[i][c]);
    }
  }
}

// Unit u of a q4 weight into its columns of y, two rows at a time.
void RunUnitDot(const Job& j, int64_t u) {
  for (int64_t panel = u * kUnit; panel < (u + 1) * kUnit; ++panel) {
    int64_t r = 0;
    for (; r + 2 <= j.M; r += 2) DotTile<2>(j, panel, r);
    if (r < j.M) DotTile<1>(j, panel, r);
  }
}

// x f32[M, K] -> xq, xr i8[M, K], xd and xsum f32[M, K / 32]: each block of 32 values
// scaled to [-127, 127] by 127 / max |x| and rounded to nearest (even), xq; what rounding
// left, scaled by 254 more and rounded, xr; the block's scale max |x| / 127 and its sum.
void QuantizeRows(const float* x, int64_t M, int64_t K, int8_t* xq, int8_t* xr, float* xd,
                  float* xsum) {
  const int64_t nb = K / kQ4Block;
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * kQ4Block;
    float amax = 0.0f, sum = 0.0f;
    for (int64_t k = 0; k < kQ4Block; ++k) {
      amax = std::max(amax, std::fabs(xb[k]));
      sum += xb[k];
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int64_t k = 0; k < kQ4Block; ++k) {
      const float scaled = xb[k] * inv, whole = std::nearbyint(scaled);
      xq[i * kQ4Block + k] = static_cast<int8_t>(whole);
      xr[i * kQ4Block + k] = static_cast<int8_t>(std::nearbyint((scaled - whole) * 254.0f));
    }
    xd[i] = amax / 127.0f;
    xsum[i] = sum;
  }
}

// Unit u into its columns of y, in tiles of RM rows x NV vectors (remainder rows through
// smaller tiles).
template <int RM, int NV>
void RunUnitTiled(const Job& j, int64_t u) {
  constexpr int64_t kCols = kUnit * kPanel;
  static_assert(kCols % (NV * kLanes) == 0, "a tile's columns divide the unit");
  static_assert(RM <= 8, "remainder tiles go up to 7 rows");
  for (int64_t col = 0; col < kCols; col += NV * kLanes) {
    int64_t r = 0;
    for (; r + RM <= j.M; r += RM) Tile<RM, NV>(j, u, col, r);
    switch (j.M - r) {
#define JAXSERVE_TILE(n)                                    \
      case n:                                               \
        if constexpr (n < RM) Tile<n, NV>(j, u, col, r);       \
        break;
      JAXSERVE_TILE(7) JAXSERVE_TILE(6) JAXSERVE_TILE(5) JAXSERVE_TILE(4)
      JAXSERVE_TILE(3) JAXSERVE_TILE(2) JAXSERVE_TILE(1)
#undef JAXSERVE_TILE
      default: break;
    }
  }
}

// Many rows: unit u is dequantized once into `w` (its three panels of K x 16 floats, as the
// float32 kernel's panels: a tile's 16 columns are one contiguous stream; a per-thread
// scratch that stays in L2, a few hundred KB, never a copy of the whole weight) and multiplied into every
// row from there in tiles of RM rows x NV vectors, each summed over all of K in registers
// and stored once (no partial sums go back to y: the rows of y lie N floats apart, which
// aliases in L1 when N is a multiple of 1024, as the LM head's vocabulary is).
template <int RM, int NV>
void StagedTile(const Job& j, const float* w, int64_t col, int64_t c0, int64_t r0) {
  vec acc[RM][NV];
  for (int i = 0; i < RM; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vec{};
  const float* xr = j.x + r0 * j.K;
  const float* wp[NV];  // vector v's column block at k = 0: its panel, its offset in it
  for (int v = 0; v < NV; ++v) {
    const int64_t c = col + kLanes * v;
    wp[v] = w + c / kPanel * j.K * kPanel + c % kPanel;
  }
  for (int64_t k = 0; k < j.K; ++k) {
    vec wv[NV];
    for (int v = 0; v < NV; ++v) std::memcpy(&wv[v], wp[v] + k * kPanel, sizeof(vec));
    for (int i = 0; i < RM; ++i) {
      const float xv = xr[i * j.K + k];
      for (int v = 0; v < NV; ++v) acc[i][v] += xv * wv[v];
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int v = 0; v < NV; ++v) {
      std::memcpy(j.y + (r0 + i) * j.N + c0 + kLanes * v, &acc[i][v], sizeof(vec));
    }
}

// q4: block b of panel `panel` (its codes in `DotTile`'s order) into `w` f32[K, 16] (the
// panel's part of the scratch): codes converted, times the scales, plus the zeros.
inline void DequantizeDotBlock(const Job& j, int64_t panel, int64_t b, float* w) {
  const int64_t nb = j.K / kQ4Block;
  const uint8_t* qb = j.q + panel * (j.K / 2) * kPanel + b * kQ4Block * kPanel / 2;
  const __m256i low = _mm256_set1_epi32(0x0F);
  for (int c = 0; c < 2; ++c) {
    const int64_t at = (panel * nb + b) * kPanel + c * 8;
    const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(j.s + at)));
    const __m256 zv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(j.z + at)));
    for (int g = 0; g < 4; ++g) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(qb + c * 128 + g * 32));
      float* wl = w + (b * kQ4Block + 4 * g) * kPanel + c * 8;  // value 4 g of the block
      float* wh = wl + kQ4Block / 2 * kPanel;                   // value 16 + 4 g
#define JAXSERVE_VALUE(t)                                                                 \
  _mm256_storeu_ps(wl + t * kPanel, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(     \
                                        _mm256_srli_epi32(v, 8 * t), low)), sv, zv));       \
  _mm256_storeu_ps(wh + t * kPanel, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(     \
                                        _mm256_srli_epi32(v, 8 * t + 4), low)), sv, zv));
      JAXSERVE_VALUE(0) JAXSERVE_VALUE(1) JAXSERVE_VALUE(2) JAXSERVE_VALUE(3)
#undef JAXSERVE_VALUE
    }
  }
}

// Unit u's weights f32[3, K, 16] into `w`: codes converted, times the scales (+ zeros).
template <bool Q4>
void Dequantize(const Job& j, int64_t u, float* w) {
  const int64_t K = j.K;
  if constexpr (Q4) {
    for (int64_t p = 0; p < kUnit; ++p) {
      for (int64_t b = 0; b < K / kQ4Block; ++b) {
        DequantizeDotBlock(j, u * kUnit + p, b, w + p * K * kPanel);
      }
    }
  } else {
    const int64_t nb = K / j.B;
    for (int64_t c = 0; c < kStageCols; c += kLanes) {
      const int64_t panel = u * kUnit + c / kPanel, off = c % kPanel;
      const uint8_t* q = j.q + panel * K * kPanel + off;
      const uint16_t* s = j.s + panel * nb * kPanel + off;
      for (int64_t b = 0; b < nb; ++b) {
        const vec sv = Halfs(s + b * kPanel);
        for (int64_t k = b * j.B; k < (b + 1) * j.B; ++k) {
          const vec wv = Int8s(q + k * kPanel) * sv;
          std::memcpy(w + c / kPanel * K * kPanel + k * kPanel + off, &wv, sizeof(vec));
        }
      }
    }
  }
}

template <int RM, int NV, bool Q4>
void RunUnitStaged(const Job& j, int64_t u) {
  static_assert(kStageCols % (NV * kLanes) == 0, "a tile's columns divide the unit");
  thread_local std::vector<float> scratch;  // f32[3, K, 16]
  if (scratch.size() < static_cast<size_t>(j.K * kStageCols)) scratch.resize(j.K * kStageCols);
  float* w = scratch.data();
  Dequantize<Q4>(j, u, w);
  const int64_t u0 = u * kStageCols;  // the unit's first column
  for (int64_t col = 0; col < kStageCols; col += NV * kLanes) {
    int64_t r = 0;
    for (; r + RM <= j.M; r += RM) StagedTile<RM, NV>(j, w, col, u0 + col, r);
    switch (j.M - r) {
#define JAXSERVE_TILE(n)                                                  \
      case n:                                                             \
        if constexpr (n < RM) StagedTile<n, NV>(j, w, col, u0 + col, r);  \
        break;
      JAXSERVE_TILE(7) JAXSERVE_TILE(6) JAXSERVE_TILE(5) JAXSERVE_TILE(4)
      JAXSERVE_TILE(3) JAXSERVE_TILE(2) JAXSERVE_TILE(1)
#undef JAXSERVE_TILE
      default: break;
    }
  }
}

template <bool Q4>
void RunUnit(const Job& j, int64_t u) {
#if defined(__AVX512F__)
  if (j.M >= kStageRows) {
    RunUnitStaged<8, 3, Q4>(j, u);
  } else if (Q4) {
    RunUnitDot(j, u);
  } else if (j.M >= 2) {
    RunUnitTiled<4, 3>(j, u);  // 12 block sums + 12 totals of the 32 registers
  } else {
    RunUnitTiled<1, 3>(j, u);
  }
#else
  // 16 registers. One row: 6 block sums over the whole unit (6 independent chains of FMAs),
  // their totals and the converted codes. Two to 11 rows: 6 x 2 block sums and the codes,
  // each conversion shared by up to 6 rows, the totals spilled (touched once a block).
  if (j.M >= kStageRows) {
    RunUnitStaged<6, 2, Q4>(j, u);
  } else if (Q4) {
    RunUnitDot(j, u);
  } else if (j.M >= 2) {
    RunUnitTiled<6, 2>(j, u);
  } else {
    RunUnitTiled<1, 6>(j, u);
  }
#endif
}

void Drain(Job& j) {
  int64_t finished = 0;
  for (int64_t u = j.next.fetch_add(1); u < j.U; u = j.next.fetch_add(1), ++finished) {
    if (j.q4) {
      RunUnit<true>(j, u);
    } else {
      RunUnit<false>(j, u);
    }
  }
  jaxserve_cpu::MarkDone(j.done, finished, j.U, j.mu, j.cv);
}

void Run(ffi::ThreadPool& pool, std::shared_ptr<Job> job) {
  const int64_t helpers = jaxserve_cpu::Helpers(pool.num_threads(), job->U);
  jaxserve_cpu::RunParallel(helpers, [job] { Drain(*job); },
                            [&pool](auto task) { pool.Schedule(std::move(task)); }, job->done, job->U,
                            job->mu, job->cv);
}

// The layer index clamped into [0, layers).
int64_t Layer(const ffi::Buffer<ffi::S32>& layer, int64_t layers) {
  return std::clamp<int64_t>(layer.typed_data()[0], 0, layers - 1);
}

ffi::Error StackedQ8GemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F16> s,
                             ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = s.dimensions();
  if (xd.size() != 2 || qd.size() != 4 || sd.size() != 4 || qd[3] != kPanel ||
      sd[3] != kPanel || qd[1] % kUnit != 0 || qd[2] != xd[1] || qd[0] < 1 ||
      sd[0] != qd[0] || sd[1] != qd[1] || sd[2] < 1 || qd[2] % sd[2] != 0 ||
      layer.element_count() < 1 || y->element_count() != xd[0] * qd[1] * kPanel) {
    return ffi::Error::InvalidArgument("stacked_qgemm q8: inconsistent shapes");
  }
  auto job = std::make_shared<Job>();
  const int64_t l = Layer(layer, qd[0]);
  job->q4 = false;
  job->M = jaxserve_cpu::RowsToCompute(layer.typed_data(), layer.element_count(), xd[0]);
  job->K = xd[1], job->U = qd[1] / kUnit, job->N = qd[1] * kPanel;
  job->B = qd[2] / sd[2];
  job->x = x.typed_data();
  job->xsum = nullptr;
  job->q = static_cast<const uint8_t*>(q.untyped_data()) + l * qd[1] * qd[2] * kPanel;
  job->s = static_cast<const uint16_t*>(s.untyped_data()) + l * sd[1] * sd[2] * kPanel;
  job->z = nullptr;
  job->y = y->typed_data();
  std::fill(job->y + job->M * job->N, job->y + xd[0] * job->N, 0.0f);  // padding rows
  if (job->U == 0 || job->M == 0) return ffi::Error::Success();
  Run(pool, job);
  return ffi::Error::Success();
}

ffi::Error StackedQ4GemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::U8> q, ffi::Buffer<ffi::F16> s,
                             ffi::Buffer<ffi::F16> z, ffi::Buffer<ffi::S32> layer,
                             ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = s.dimensions(), zd = z.dimensions();
  if (xd.size() != 2 || qd.size() != 4 || sd.size() != 4 || zd.size() != 4 ||
      qd[3] != kPanel || qd[1] % kUnit != 0 || xd[1] % kQ4Block != 0 ||
      qd[2] * 2 != xd[1] || qd[0] < 1 || sd[0] != qd[0] || sd[1] != qd[1] ||
      sd[2] * kQ4Block != xd[1] || sd[3] != kPanel ||
      zd[0] != sd[0] || zd[1] != sd[1] || zd[2] != sd[2] || zd[3] != sd[3] ||
      layer.element_count() < 1 || y->element_count() != xd[0] * qd[1] * kPanel) {
    return ffi::Error::InvalidArgument("stacked_qgemm q4: inconsistent shapes");
  }
  auto job = std::make_shared<Job>();
  const int64_t l = Layer(layer, qd[0]);
  const int64_t M = jaxserve_cpu::RowsToCompute(layer.typed_data(), layer.element_count(),
                                                xd[0]);
  const int64_t K = xd[1], nb = K / kQ4Block;
  job->q4 = true;
  job->M = M, job->K = K, job->U = qd[1] / kUnit, job->N = qd[1] * kPanel;
  job->B = kQ4Block;
  job->x = x.typed_data();
  // The activations, quantized once per call for the dot path (the job ends before this
  // returns); from kStageRows rows the dequantized weights take x as it is.
  thread_local std::vector<int8_t> codes, rests;  // i8[M, K]
  thread_local std::vector<float> scales, sums;  // f32[M, K / 32]
  if (M < kStageRows) {
    codes.resize(M * K), rests.resize(M * K), scales.resize(M * nb), sums.resize(M * nb);
    QuantizeRows(job->x, M, K, codes.data(), rests.data(), scales.data(), sums.data());
    job->xq = codes.data(), job->xr = rests.data(), job->xd = scales.data();
    job->xsum = sums.data();
  }
  const int64_t per_layer = qd[1] * sd[2] * kPanel;  // scales (or zeros) per layer
  job->q = static_cast<const uint8_t*>(q.untyped_data()) + l * qd[1] * qd[2] * kPanel;
  job->s = static_cast<const uint16_t*>(s.untyped_data()) + l * per_layer;
  job->z = static_cast<const uint16_t*>(z.untyped_data()) + l * per_layer;
  job->y = y->typed_data();
  std::fill(job->y + job->M * job->N, job->y + xd[0] * job->N, 0.0f);  // padding rows
  if (job->U == 0 || job->M == 0) return ffi::Error::Success();
  Run(pool, job);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StackedQ8Gemm, StackedQ8GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S8>>()   // codes
                                  .Arg<ffi::Buffer<ffi::F16>>()  // scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(StackedQ4Gemm, StackedQ4GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::U8>>()   // codes, two per byte
                                  .Arg<ffi::Buffer<ffi::F16>>()  // scales
                                  .Arg<ffi::Buffer<ffi::F16>>()  // zeros
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
