// Used by the CPU quantized matmul kernel (stacked_qgemm.cc): int8 codes and float16 scales
// converted to float vectors (`vec`, simd.h) in registers.
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

#include "simd.h"

namespace jaxserve_cpu {

#if defined(__AVX512F__)
// kLanes int8 codes -> floats.
inline vec Int8s(const uint8_t* p) {
  return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
// kLanes halfs -> floats.
inline vec Halfs(const uint16_t* p) {
  return (vec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
#else
inline vec Int8s(const uint8_t* p) {
  return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline vec Halfs(const uint16_t* p) {
  return (vec)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}
#endif

}  // namespace jaxserve_cpu

#endif  // JAXSERVE_CPU_QUANT_SIMD_H_
