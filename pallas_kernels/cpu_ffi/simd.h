// Shared by the CPU kernels (paged_decode.cc, stacked_gemm.cc): the width of one vector
// register, for GCC's vector extensions.
//
// The kernels are built with -march=native on the machine that runs them. Vectors wider
// than the registers would be split by the compiler and spilled on every step (16-float
// vectors on an AVX2 CPU ran the matmuls at 3 GFLOP/s on a core instead of ~75).

#ifndef JAXSERVE_CPU_DECODE_SIMD_H_
#define JAXSERVE_CPU_DECODE_SIMD_H_

namespace jaxserve_cpu {

#if defined(__AVX512F__)
constexpr int kLanes = 16;  // floats per vector register: AVX-512 (32 registers)
#else
constexpr int kLanes = 8;  // AVX / AVX2 (16 registers)
#endif
typedef float vec __attribute__((vector_size(kLanes * 4)));

}  // namespace jaxserve_cpu

#endif  // JAXSERVE_CPU_DECODE_SIMD_H_
