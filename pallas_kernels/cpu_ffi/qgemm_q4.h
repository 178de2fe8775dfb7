// The q4 tiles of the CPU quantized matmul kernel (stacked_qgemm.cc) and the job they share
// with its q8/FP8 tiles: codes u8[P, K / 2, 16] in 32-value blocks (`DotTile`'s order) with
// one scale and one zero per group of G values (G a multiple of 32 dividing K, G = K per
// channel): block b reads group b * 32 / G, so a checkpoint's groups of 64 or 128 are read
// as they are. Zeros are float16 or float32 (`ZT`): an asymmetric GPTQ/AWQ zero -z * scale
// needs more mantissa than float16 keeps.

#ifndef JAXSERVE_CPU_QGEMM_Q4_H_
#define JAXSERVE_CPU_QGEMM_Q4_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>

#include "quant_simd.h"

namespace jaxserve_cpu::qgemm {

constexpr int64_t kPanel = 16;    // columns per panel
constexpr int64_t kUnit = 3;      // panels per unit of work (48 columns)
constexpr int64_t kQ4Block = 32;  // values per q4 block (16 packed rows)

// What a layer's codes are: q8 (i8 codes, f16 scales), FP8 E4M3 (codes, f32 scales), q4
// with f16 or f32 zeros, FP4 E2M1 with E8M0 (MXFP4) or E4M3 (NVFP4) scales (`qgemm_fp4.h`).
enum class Codes { kQ8, kFp8, kQ4, kQ4Z32, kMxfp4, kNvfp4 };

struct Job {
  Codes codes;
  const float* x;     // f32[M, K]
  const float* xsum;  // f32[M, K / 32]: q4, each block's sum of x
  const int8_t* xq;   // i8[M, K]: q4, x quantized per block of 32 (`QuantizeRows`)
  const int8_t* xr;   // i8[M, K]: q4, what that rounding left, quantized again
  const float* xd;    // f32[M, K / 32]: q4, each block's scale (max |x| / 127); FP4's
                      // times `unit`
  const int32_t* xoff;  // i32[M, K / 16, 2]: FP4, 12 x each half-block's sum of xq and xr
  float unit;         // FP4: what the codes' 2 v and the scales leave out (1/2, NVFP4's
                      // 2^8 x its global scale)
  const uint8_t* q;   // this layer's codes: q8/FP8 [P, K, 16], q4 u8[P, K / 2, 16]
  const void* s;      // scales [P, K / B, 16]: f16, FP8 f32, FP4 u8 E8M0 or E4M3
  const void* z;      // q4 zeros [P, K / B, 16]: f16 or f32
  float* y;           // f32[M, P * 16]
  int64_t M, K, N, U, B;  // rows, contraction, columns, units, values per scale
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable cv;
};

// 8 zeros of a q4 group as floats.
inline __m256 Zeros8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}
inline __m256 Zeros8(const float* p) { return _mm256_loadu_ps(p); }

// The 4 activations of a dot step broadcast to every 32-bit lane: {xq, xq + 16, xr, xr + 16}
// at `at` (value `at` of a 32-value block and the 4 values 16 further on, of both parts).
struct Broadcast4 {
  __m256i ql, qh, rl, rh;
};
inline Broadcast4 BroadcastActivations(const Job& j, int64_t at) {
  int32_t v[4];
  std::memcpy(&v[0], j.xq + at, 4);
  std::memcpy(&v[1], j.xq + at + kQ4Block / 2, 4);
  std::memcpy(&v[2], j.xr + at, 4);
  std::memcpy(&v[3], j.xr + at + kQ4Block / 2, 4);
  return {_mm256_set1_epi32(v[0]), _mm256_set1_epi32(v[1]), _mm256_set1_epi32(v[2]),
          _mm256_set1_epi32(v[3])};
}

// q4 times activations split into two int8 parts, x = d (xq + xr / 254) + O(d / 508), d =
// max |x| / 127 over a block of 32 (`QuantizeRows`): rows [r0, r0 + RM) x panel `panel` of
// y. The codes of a panel's block (32 values x 16 columns, 256 bytes, `qgemm.pack`) lie as
// [2 column groups][4 groups of 4 values][8 columns][4 values], so one 32-byte load gives
// 8 columns x 4 consecutive values (low nibbles) and the 4 values 16 further on (high
// nibbles); `maddubs` multiplies them with 4 broadcast int8 activations and adds pairs, 32
// products an instruction. The block's 16-bit sums (at most 8 x 2 x 15 x 127 < 2^15) become
// int32 and float once per block: y += s d (sum(q xq) + sum(q xr) / 254) + z sum(x), s and
// z loaded once per group. The second part keeps x to ~15 bits (one part alone, as
// llama.cpp's Q8 activations, moved greedy choices of the default model against its float32
// weights).
template <int RM, typename ZT>
void DotTile(const Job& j, int64_t panel, int64_t r0) {
  const int64_t K = j.K, nb = K / kQ4Block, ng = K / j.B, per = j.B / kQ4Block;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 fine = _mm256_set1_ps(1.0f / 254.0f);
  const uint8_t* qp = j.q + panel * (K / 2) * kPanel;
  const uint16_t* sp = static_cast<const uint16_t*>(j.s) + panel * ng * kPanel;
  const ZT* zp = static_cast<const ZT*>(j.z) + panel * ng * kPanel;
  __m256 acc[RM][2];
  for (int i = 0; i < RM; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t gr = 0; gr < ng; ++gr) {
    __m256 sv[2], zv[2];
    for (int c = 0; c < 2; ++c) {
      sv[c] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sp + gr * kPanel + c * 8)));
      zv[c] = Zeros8(zp + gr * kPanel + c * 8);
    }
    for (int64_t b = gr * per; b < (gr + 1) * per; ++b) {
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
          const auto [xl, xh, rl, rh] =
              BroadcastActivations(j, (r0 + i) * K + b * kQ4Block + 4 * g);
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
        for (int i = 0; i < RM; ++i) {
          const __m256 f = _mm256_fmadd_ps(
              _mm256_cvtepi32_ps(_mm256_madd_epi16(rest[i][c], ones)), fine,
              _mm256_cvtepi32_ps(_mm256_madd_epi16(coarse[i][c], ones)));
          const __m256 sd = _mm256_mul_ps(sv[c], _mm256_set1_ps(j.xd[(r0 + i) * nb + b]));
          acc[i][c] = _mm256_fmadd_ps(f, sd, acc[i][c]);
          acc[i][c] = _mm256_fmadd_ps(zv[c], _mm256_set1_ps(j.xsum[(r0 + i) * nb + b]),
                                      acc[i][c]);
        }
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
template <typename ZT>
void RunUnitDot(const Job& j, int64_t u) {
  for (int64_t panel = u * kUnit; panel < (u + 1) * kUnit; ++panel) {
    int64_t r = 0;
    for (; r + 2 <= j.M; r += 2) DotTile<2, ZT>(j, panel, r);
    if (r < j.M) DotTile<1, ZT>(j, panel, r);
  }
}

// x f32[M, K] -> xq, xr i8[M, K], xd and xsum f32[M, K / 32]: each block of 32 values
// scaled to [-127, 127] by 127 / max |x| and rounded to nearest (even), xq; what rounding
// left, scaled by 254 more and rounded, xr; the block's scale max |x| / 127 and its sum.
inline void QuantizeRows(const float* x, int64_t M, int64_t K, int8_t* xq, int8_t* xr,
                         float* xd, float* xsum) {
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

// Block b of panel `panel` (its codes in `DotTile`'s order) into `w` f32[K, 16] (the
// panel's part of the staged scratch): codes converted, times the group's scales, plus
// its zeros.
template <typename ZT>
void DequantizeDotBlock(const Job& j, int64_t panel, int64_t b, float* w) {
  const int64_t ng = j.K / j.B;
  const uint8_t* qb = j.q + panel * (j.K / 2) * kPanel + b * kQ4Block * kPanel / 2;
  const __m256i low = _mm256_set1_epi32(0x0F);
  for (int c = 0; c < 2; ++c) {
    const int64_t at = (panel * ng + b * kQ4Block / j.B) * kPanel + c * 8;
    const __m256 sv = _mm256_cvtph_ps(
        _mm_loadu_si128((const __m128i*)(static_cast<const uint16_t*>(j.s) + at)));
    const __m256 zv = Zeros8(static_cast<const ZT*>(j.z) + at);
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

}  // namespace jaxserve_cpu::qgemm

#endif  // JAXSERVE_CPU_QGEMM_Q4_H_
