// The FP4 E2M1 tiles of the CPU quantized matmul kernel (stacked_qgemm.cc): MXFP4 (E8M0
// exponents u8 per 32 values) and NVFP4 (E4M3 scales per 16 values, one f32 global scale a
// layer), codes u8[P, K / 2, 16] laid out as q4's (`qgemm.pack`: packed row 16 b + j holds
// value 32 b + j in its low nibble and 32 b + 16 + j in its high one, in `DotTile`'s order),
// so a 32-value block's low nibbles are its first 16 values (NVFP4's first scale) and its
// high nibbles the other 16 (its second).
//
// E2M1 values times 2 are the integers 0, 1, 2, 3, 4, 6, 8, 12 and their negatives: a
// 16-entry byte table (`pshufb`) turns each nibble into an int8 and the q4 path's integer
// dot products with x split into two int8 parts per block of 32 (`QuantizeRows`) apply.
// `maddubs` takes its first operand unsigned, so the table holds 2 v + 12 (0..24) and the
// offset is taken back exactly in int32 from each half-block's sums of the activation
// codes (`Fp4Offsets`): sum(2 v xq) = sum((2 v + 12) xq) - 12 sum(xq). The low and high
// nibbles keep their own 16-bit sums (8 products of at most 24 x 127 each: < 2^15).

#ifndef JAXSERVE_CPU_QGEMM_FP4_H_
#define JAXSERVE_CPU_QGEMM_FP4_H_

#include <cstdint>

#include "qgemm_q4.h"
#include "quant_simd.h"

namespace jaxserve_cpu::qgemm {

constexpr int32_t kFp4Offset = 12;  // added to 2 v by the dot path's table (unsigned codes)

// 8 scales (one per column) as floats: E8M0 bytes 2^(e - 127) (e = 0 the subnormal 2^-127;
// 0xFF, NaN in E8M0, reads as infinity: checkpoints hold none), or E4M3 bytes times 2^-8
// (`Fp8s`' bit move; the caller's unit undoes the 2^-8).
template <bool NV>
inline __m256 Fp4Scales8(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64((const __m128i*)p);
  if constexpr (NV) {
    return _mm256_cvtph_ps(
        _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16(-16512)));
  } else {
    const __m256i e = _mm256_cvtepu8_epi32(b);
    const __m256i bits = _mm256_blendv_epi8(_mm256_slli_epi32(e, 23),
                                            _mm256_set1_epi32(0x00400000),
                                            _mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
    return _mm256_castsi256_ps(bits);
  }
}

// x's split parts (`QuantizeRows`) -> off i32[M, K / 16, 2]: 12 times each half-block's sum
// of xq and of xr (what the table's offset adds to the dots).
inline void Fp4Offsets(const int8_t* xq, const int8_t* xr, int64_t M, int64_t K,
                       int32_t* off) {
  for (int64_t h = 0; h < M * K / 16; ++h) {
    int32_t sq = 0, sr = 0;
    for (int64_t k = 0; k < 16; ++k) sq += xq[h * 16 + k], sr += xr[h * 16 + k];
    off[2 * h] = kFp4Offset * sq, off[2 * h + 1] = kFp4Offset * sr;
  }
}

// Rows [r0, r0 + RM) x panel `panel` of y over an FP4 weight (`DotTile`'s loop, the table
// in place of the nibble mask): per block and per 8 columns, y += d (f_lo s_lo + f_hi s_hi),
// f the half's integer dots (xq, plus xr over 254) less their offsets, s its scale (MXFP4's
// both the block's), d the block's max |x| / 127 times the unit (`Job::xd`: 1/2 for the
// table's 2 v, NVFP4's 2^8 and global scale).
template <int RM, bool NV>
void Fp4DotTile(const Job& j, int64_t panel, int64_t r0) {
  const int64_t K = j.K, nb = K / kQ4Block, ns = NV ? 2 * nb : nb;  // scales per column
  const __m256i table = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6,
                                         4, 0, 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9,
                                         8, 6, 4, 0);
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 fine = _mm256_set1_ps(1.0f / 254.0f);
  const uint8_t* qp = j.q + panel * (K / 2) * kPanel;
  const uint8_t* sp = static_cast<const uint8_t*>(j.s) + panel * ns * kPanel;
  __m256 acc[RM][2];
  for (int i = 0; i < RM; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* qb = qp + b * kQ4Block * kPanel / 2;
    // [row][column group]: low nibbles x xq, high x xq, low x xr, high x xr.
    __m256i ql[RM][2], qh[RM][2], rl[RM][2], rh[RM][2];
    for (int i = 0; i < RM; ++i)
      for (int c = 0; c < 2; ++c) ql[i][c] = qh[i][c] = rl[i][c] = rh[i][c] = _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      __m256i lo[2], hi[2];
      for (int c = 0; c < 2; ++c) {
        const __m256i w = _mm256_loadu_si256((const __m256i*)(qb + c * 128 + g * 32));
        lo[c] = _mm256_shuffle_epi8(table, _mm256_and_si256(w, low));
        hi[c] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(w, 4), low));
      }
      for (int i = 0; i < RM; ++i) {
        const auto [xl, xh, el, eh] =
            BroadcastActivations(j, (r0 + i) * K + b * kQ4Block + 4 * g);
        for (int c = 0; c < 2; ++c) {
          ql[i][c] = _mm256_add_epi16(ql[i][c], _mm256_maddubs_epi16(lo[c], xl));
          qh[i][c] = _mm256_add_epi16(qh[i][c], _mm256_maddubs_epi16(hi[c], xh));
          rl[i][c] = _mm256_add_epi16(rl[i][c], _mm256_maddubs_epi16(lo[c], el));
          rh[i][c] = _mm256_add_epi16(rh[i][c], _mm256_maddubs_epi16(hi[c], eh));
        }
      }
    }
    for (int c = 0; c < 2; ++c) {
      const __m256 s_lo = Fp4Scales8<NV>(sp + (NV ? 2 * b : b) * kPanel + c * 8);
      const __m256 s_hi = NV ? Fp4Scales8<NV>(sp + (2 * b + 1) * kPanel + c * 8) : s_lo;
      for (int i = 0; i < RM; ++i) {
        const int32_t* off = j.xoff + ((r0 + i) * nb + b) * 4;  // lo (q, r), hi (q, r)
        auto half = [&](__m256i q, __m256i r, const int32_t* o) {
          const __m256i iq = _mm256_sub_epi32(_mm256_madd_epi16(q, ones), _mm256_set1_epi32(o[0]));
          const __m256i ir = _mm256_sub_epi32(_mm256_madd_epi16(r, ones), _mm256_set1_epi32(o[1]));
          return _mm256_fmadd_ps(_mm256_cvtepi32_ps(ir), fine, _mm256_cvtepi32_ps(iq));
        };
        const __m256 f_lo = half(ql[i][c], rl[i][c], off), f_hi = half(qh[i][c], rh[i][c], off + 2);
        const __m256 d = _mm256_set1_ps(j.xd[(r0 + i) * nb + b]);
        if constexpr (NV) {
          acc[i][c] = _mm256_fmadd_ps(_mm256_fmadd_ps(f_lo, s_lo, _mm256_mul_ps(f_hi, s_hi)), d,
                                      acc[i][c]);
        } else {
          acc[i][c] = _mm256_fmadd_ps(_mm256_add_ps(f_lo, f_hi), _mm256_mul_ps(s_lo, d), acc[i][c]);
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

// Unit u of an FP4 weight into its columns of y: two rows at a time with AVX-512's 32
// registers (16 int16 sums a tile), one with AVX2's 16.
template <bool NV>
void RunUnitFp4Dot(const Job& j, int64_t u) {
#if defined(__AVX512F__)
  constexpr int kRows = 2;
#else
  constexpr int kRows = 1;
#endif
  for (int64_t panel = u * kUnit; panel < (u + 1) * kUnit; ++panel) {
    int64_t r = 0;
    for (; r + kRows <= j.M; r += kRows) Fp4DotTile<kRows, NV>(j, panel, r);
    if (r < j.M) Fp4DotTile<1, NV>(j, panel, r);
  }
}

// Block b of panel `panel` into `w` f32[K, 16] (the staged scratch): each code's 2 v from
// the table (signed, no offset) times its scale and `Job::unit` (1/2, NVFP4's 2^8 and
// global scale).
template <bool NV>
void DequantizeFp4Block(const Job& j, int64_t panel, int64_t b, float* w) {
  const int64_t nb = j.K / kQ4Block, ns = NV ? 2 * nb : nb;
  const uint8_t* qb = j.q + panel * (j.K / 2) * kPanel + b * kQ4Block * kPanel / 2;
  const uint8_t* sp = static_cast<const uint8_t*>(j.s) + panel * ns * kPanel;
  const __m256i table = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8,
                                         -12, 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6,
                                         -8, -12);
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256 unit = _mm256_set1_ps(j.unit);
  for (int c = 0; c < 2; ++c) {
    const __m256 s_lo =
        _mm256_mul_ps(Fp4Scales8<NV>(sp + (NV ? 2 * b : b) * kPanel + c * 8), unit);
    const __m256 s_hi =
        NV ? _mm256_mul_ps(Fp4Scales8<NV>(sp + (2 * b + 1) * kPanel + c * 8), unit) : s_lo;
    for (int g = 0; g < 4; ++g) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(qb + c * 128 + g * 32));
      const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low));
      const __m256i hi =
          _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
      float* wl = w + (b * kQ4Block + 4 * g) * kPanel + c * 8;  // value 4 g of the block
      float* wh = wl + kQ4Block / 2 * kPanel;                   // value 16 + 4 g
      // Byte t of each 32-bit lane (value 4 g + t of that column), sign-extended.
#define JAXSERVE_VALUE(t)                                                                    \
  _mm256_storeu_ps(wl + t * kPanel, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(       \
                                        _mm256_slli_epi32(lo, 24 - 8 * t), 24)), s_lo));      \
  _mm256_storeu_ps(wh + t * kPanel, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(       \
                                        _mm256_slli_epi32(hi, 24 - 8 * t), 24)), s_hi));
      JAXSERVE_VALUE(0) JAXSERVE_VALUE(1) JAXSERVE_VALUE(2) JAXSERVE_VALUE(3)
#undef JAXSERVE_VALUE
    }
  }
}

}  // namespace jaxserve_cpu::qgemm

#endif  // JAXSERVE_CPU_QGEMM_FP4_H_
