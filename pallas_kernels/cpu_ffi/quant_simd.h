// Used by the CPU quantized matmul kernel (stacked_qgemm.cc): int8 and FP8 E4M3 codes and
// float16/float32 scales converted to float vectors (`vec`, simd.h) in registers.
//
// FP8 E4M3 (bias 7) becomes float16 (bias 15) exactly by moving its 7 exponent and mantissa
// bits up by 7 and its sign to bit 15: that float16 is the value times 2^-8 (subnormals
// included: E4M3's smallest, 2^-9, lands on 2^-17, inside float16's range), so a caller
// multiplies its scales by 2^8 (`kFp8Unit`). E4M3FN's NaN code reads as 1.875 (checkpoints
// hold none).
//
// With intrinsics: GCC 12 turns `__builtin_convertvector` of byte and half vectors into
// one scalar conversion per lane. x86-64 with AVX2 and F16C only; elsewhere the build
// fails and the engine keeps XLA's quantized matmuls.

#ifndef JAXSERVE_CPU_QUANT_SIMD_H_
#define JAXSERVE_CPU_QUANT_SIMD_H_

#if !defined(__AVX2__) || !defined(__F16C__)
#error "stacked_qgemm.cc needs x86-64 with AVX2 and F16C (elsewhere: XLA's quantized matmul)"
#endif
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "simd.h"

namespace jaxserve_cpu {

constexpr float kFp8Unit = 256.0f;  // what `Fp8s` leaves out of each value

#if defined(__AVX512F__)
// kLanes int8 codes -> floats.
inline vec Int8s(const uint8_t* p) {
  return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
// kLanes halfs -> floats.
inline vec Halfs(const uint16_t* p) {
  return (vec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
// kLanes FP8 E4M3 codes -> floats times 2^-8. Sign-extended to 16 bits, shifted left by 7:
// the low 7 bits land on 13..7 and the sign on 15 (and on 14, cleared by the mask).
inline vec Fp8s(const uint8_t* p) {
  const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(-16512));
  return (vec)_mm512_cvtph_ps(h);  // -16512: 0xBF80
}
// Two rows of a panel's FP8 codes (32 bytes: row k, then row k + 1) -> floats times 2^-8:
// one widening, shift and mask for both (the conversion, not the memory, bounds decode).
inline void Fp8Pair(const uint8_t* p, vec* first, vec* second) {
  const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p));
  const __m512i h = _mm512_and_si512(_mm512_slli_epi16(w, 7), _mm512_set1_epi16(-16512));
  *first = (vec)_mm512_cvtph_ps(_mm512_castsi512_si256(h));
  *second = (vec)_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}
#else
inline vec Int8s(const uint8_t* p) {
  return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline vec Halfs(const uint16_t* p) {
  return (vec)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}
inline vec Fp8s(const uint8_t* p) {
  const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)p));
  return (vec)_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(-16512)));
}
#endif
// kLanes floats.
inline vec Floats(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(vec));
  return v;
}

}  // namespace jaxserve_cpu

#endif  // JAXSERVE_CPU_QUANT_SIMD_H_
