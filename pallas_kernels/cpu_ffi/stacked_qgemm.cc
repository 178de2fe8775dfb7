// The `cpu` backend's layer matmuls over quantized weights (XLA FFI custom calls):
// y[M, 16 P] = x[M, K] @ dequantize(W[layer]), reading one layer's codes in place from the
// stacked, panel-packed quantized weights (`qgemm.pack`) and dequantizing them in registers:
// no float copy of the weight is ever written.
//
// Four kinds of codes (`models/quant.py`), one scale per B values along K of each column:
// q8, codes i8[L, P, K, 16] with scales f16[L, P, K / B, 16] (B = 32 for Q8_0, B = K for int8
// per channel, a checkpoint's group otherwise), w = q * s; FP8 E4M3 codes [L, P, K, 16] with
// scales f32[L, P, K / B, 16] (a checkpoint's block scales, one per column), w = q * s; q4,
// codes u8[L, P, K / 2, 16] (packed row 16 b + j holds value 32 b + j in its low nibble and
// 32 b + 16 + j in its high one) with scales f16 and zeros f16 or f32 [L, P, K / B, 16]
// (B a multiple of 32: `qgemm_q4.h`), w = q * s + z (q8 and FP8 tiles: `qgemm_q8.h`); FP4
// E2M1, codes as q4's with scales u8 E8M0 per 32 (MXFP4) or E4M3 per 16 times a global f32
// (NVFP4), w = e2m1(q) * s (`qgemm_fp4.h`). Each leaf keeps the 16-column panels of
// `stacked_gemm.cc`, so a tile's codes, scales and zeros are contiguous streams.
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
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "pool.h"
#include "qgemm_fp4.h"
#include "qgemm_q4.h"
#include "qgemm_q8.h"
#include "quant_simd.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve_cpu::kLanes;  // floats per vector register (simd.h)
using jaxserve_cpu::vec;
using namespace jaxserve_cpu::qgemm;  // NOLINT: the job and the tiles (qgemm_q4.h, qgemm_q8.h)

constexpr int64_t kStageCols = kUnit * kPanel;  // columns of a unit
constexpr int64_t kStageRows = 12;  // rows from which a unit is dequantized once (staged)

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

// Unit u's weights f32[3, K, 16] into `w`: codes converted, times the scales (+ zeros).
template <Codes C>
void Dequantize(const Job& j, int64_t u, float* w) {
  const int64_t K = j.K;
  if constexpr (C == Codes::kMxfp4 || C == Codes::kNvfp4) {
    for (int64_t p = 0; p < kUnit; ++p) {
      for (int64_t b = 0; b < K / kQ4Block; ++b) {
        DequantizeFp4Block<C == Codes::kNvfp4>(j, u * kUnit + p, b, w + p * K * kPanel);
      }
    }
  } else if constexpr (C == Codes::kQ4 || C == Codes::kQ4Z32) {
    using ZT = std::conditional_t<C == Codes::kQ4Z32, float, uint16_t>;
    for (int64_t p = 0; p < kUnit; ++p) {
      for (int64_t b = 0; b < K / kQ4Block; ++b) {
        DequantizeDotBlock<ZT>(j, u * kUnit + p, b, w + p * K * kPanel);
      }
    }
  } else {
    constexpr bool kFp8 = C == Codes::kFp8;
    const int64_t nb = K / j.B;
    for (int64_t c = 0; c < kStageCols; c += kLanes) {
      const int64_t panel = u * kUnit + c / kPanel, off = c % kPanel;
      const uint8_t* q = j.q + panel * K * kPanel + off;
      for (int64_t b = 0; b < nb; ++b) {
        const vec sv = Scales<kFp8>(j, (panel * nb + b) * kPanel + off);
        for (int64_t k = b * j.B; k < (b + 1) * j.B; ++k) {
          const vec wv = Codes8<kFp8>(q + k * kPanel) * sv;
          std::memcpy(w + c / kPanel * K * kPanel + k * kPanel + off, &wv, sizeof(vec));
        }
      }
    }
  }
}

template <int RM, int NV, Codes C>
void RunUnitStaged(const Job& j, int64_t u) {
  static_assert(kStageCols % (NV * kLanes) == 0, "a tile's columns divide the unit");
  thread_local std::vector<float> scratch;  // f32[3, K, 16]
  if (scratch.size() < static_cast<size_t>(j.K * kStageCols)) scratch.resize(j.K * kStageCols);
  float* w = scratch.data();
  Dequantize<C>(j, u, w);
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

template <Codes C>
void RunUnit(const Job& j, int64_t u) {
  constexpr bool kFp8 = C == Codes::kFp8;
  constexpr bool kQ4 = C == Codes::kQ4 || C == Codes::kQ4Z32;
  constexpr bool kFp4 = C == Codes::kMxfp4 || C == Codes::kNvfp4;
  using ZT = std::conditional_t<C == Codes::kQ4Z32, float, uint16_t>;
#if defined(__AVX512F__)
  if (j.M >= kStageRows) {
    RunUnitStaged<8, 3, C>(j, u);
  } else if constexpr (kFp4) {
    RunUnitFp4Dot<C == Codes::kNvfp4>(j, u);
  } else if constexpr (kQ4) {
    RunUnitDot<ZT>(j, u);
  } else if (j.M >= 2) {
    RunUnitTiled<4, 3, kFp8>(j, u);  // 12 block sums + 12 totals of the 32 registers
  } else {
    RunUnitTiled<1, 3, kFp8>(j, u);
  }
#else
  // 16 registers. One row: 6 block sums over the whole unit (6 independent chains of FMAs),
  // their totals and the converted codes. Two to 11 rows: 6 x 2 block sums and the codes,
  // each conversion shared by up to 6 rows, the totals spilled (touched once a block).
  if (j.M >= kStageRows) {
    RunUnitStaged<6, 2, C>(j, u);
  } else if constexpr (kFp4) {
    RunUnitFp4Dot<C == Codes::kNvfp4>(j, u);
  } else if constexpr (kQ4) {
    RunUnitDot<ZT>(j, u);
  } else if (j.M >= 2) {
    RunUnitTiled<6, 2, kFp8>(j, u);
  } else {
    RunUnitTiled<1, 6, kFp8>(j, u);
  }
#endif
}

void Drain(Job& j) {
  int64_t finished = 0;
  for (int64_t u = j.next.fetch_add(1); u < j.U; u = j.next.fetch_add(1), ++finished) {
    switch (j.codes) {
      case Codes::kQ8: RunUnit<Codes::kQ8>(j, u); break;
      case Codes::kFp8: RunUnit<Codes::kFp8>(j, u); break;
      case Codes::kQ4: RunUnit<Codes::kQ4>(j, u); break;
      case Codes::kQ4Z32: RunUnit<Codes::kQ4Z32>(j, u); break;
      case Codes::kMxfp4: RunUnit<Codes::kMxfp4>(j, u); break;
      case Codes::kNvfp4: RunUnit<Codes::kNvfp4>(j, u); break;
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

// Codes i8 with scales f16 (q8), or FP8 E4M3 codes with scales f32.
ffi::Error StackedQ8GemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                             ffi::AnyBuffer s, ffi::Buffer<ffi::S32> layer,
                             ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = s.dimensions();
  const bool fp8 = q.element_type() == ffi::DataType::F8E4M3FN;
  const bool typed = fp8 ? s.element_type() == ffi::DataType::F32
                         : q.element_type() == ffi::DataType::S8 &&
                               s.element_type() == ffi::DataType::F16;
  if (!typed || xd.size() != 2 || qd.size() != 4 || sd.size() != 4 || qd[3] != kPanel ||
      sd[3] != kPanel || qd[1] % kUnit != 0 || qd[2] != xd[1] || qd[0] < 1 ||
      sd[0] != qd[0] || sd[1] != qd[1] || sd[2] < 1 || qd[2] % sd[2] != 0 ||
      layer.element_count() < 1 || y->element_count() != xd[0] * qd[1] * kPanel) {
    return ffi::Error::InvalidArgument("stacked_qgemm q8: inconsistent shapes or dtypes");
  }
  auto job = std::make_shared<Job>();
  const int64_t l = Layer(layer, qd[0]);
  job->codes = fp8 ? Codes::kFp8 : Codes::kQ8;
  job->M = jaxserve_cpu::RowsToCompute(layer.typed_data(), layer.element_count(), xd[0]);
  job->K = xd[1], job->U = qd[1] / kUnit, job->N = qd[1] * kPanel;
  job->B = qd[2] / sd[2];
  job->x = x.typed_data();
  job->xsum = nullptr;
  job->q = static_cast<const uint8_t*>(q.untyped_data()) + l * qd[1] * qd[2] * kPanel;
  const int64_t scale_bytes = fp8 ? 4 : 2;
  job->s = static_cast<const char*>(s.untyped_data()) + l * sd[1] * sd[2] * kPanel * scale_bytes;
  job->z = nullptr;
  job->y = y->typed_data();
  std::fill(job->y + job->M * job->N, job->y + xd[0] * job->N, 0.0f);  // padding rows
  if (job->U == 0 || job->M == 0) return ffi::Error::Success();
  Run(pool, job);
  return ffi::Error::Success();
}

// Codes u8 (two per byte), scales f16, zeros f16 or f32, one per group of a multiple of 32.
ffi::Error StackedQ4GemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::U8> q, ffi::Buffer<ffi::F16> s,
                             ffi::AnyBuffer z, ffi::Buffer<ffi::S32> layer,
                             ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = s.dimensions(), zd = z.dimensions();
  const bool z32 = z.element_type() == ffi::DataType::F32;
  if ((!z32 && z.element_type() != ffi::DataType::F16) || xd.size() != 2 || qd.size() != 4 ||
      sd.size() != 4 || zd.size() != 4 || qd[3] != kPanel || qd[1] % kUnit != 0 ||
      xd[1] % kQ4Block != 0 || qd[2] * 2 != xd[1] || qd[0] < 1 || sd[0] != qd[0] ||
      sd[1] != qd[1] || sd[2] < 1 || xd[1] % sd[2] != 0 || (xd[1] / sd[2]) % kQ4Block != 0 ||
      sd[3] != kPanel || zd[0] != sd[0] || zd[1] != sd[1] || zd[2] != sd[2] ||
      zd[3] != sd[3] || layer.element_count() < 1 ||
      y->element_count() != xd[0] * qd[1] * kPanel) {
    return ffi::Error::InvalidArgument("stacked_qgemm q4: inconsistent shapes or dtypes");
  }
  auto job = std::make_shared<Job>();
  const int64_t l = Layer(layer, qd[0]);
  const int64_t M = jaxserve_cpu::RowsToCompute(layer.typed_data(), layer.element_count(),
                                                xd[0]);
  const int64_t K = xd[1], nb = K / kQ4Block;
  job->codes = z32 ? Codes::kQ4Z32 : Codes::kQ4;
  job->M = M, job->K = K, job->U = qd[1] / kUnit, job->N = qd[1] * kPanel;
  job->B = K / sd[2];
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
  job->z = static_cast<const char*>(z.untyped_data()) + l * per_layer * (z32 ? 4 : 2);
  job->y = y->typed_data();
  std::fill(job->y + job->M * job->N, job->y + xd[0] * job->N, 0.0f);  // padding rows
  if (job->U == 0 || job->M == 0) return ffi::Error::Success();
  Run(pool, job);
  return ffi::Error::Success();
}

// FP4 E2M1 codes u8 (two per byte, q4's order), scales u8 E8M0 per 32 (MXFP4) or E4M3 per
// 16 (NVFP4), and a global scale f32[L, 1, 1] (MXFP4's ones).
ffi::Error StackedFp4GemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::U8> q, ffi::AnyBuffer s,
                              ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::S32> layer,
                              ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = s.dimensions();
  const bool nv = s.element_type() == ffi::DataType::F8E4M3FN;
  const int64_t per = nv ? 16 : kQ4Block;  // values per scale
  if ((!nv && s.element_type() != ffi::DataType::U8) || xd.size() != 2 || qd.size() != 4 ||
      sd.size() != 4 || qd[3] != kPanel || qd[1] % kUnit != 0 || xd[1] % kQ4Block != 0 ||
      qd[2] * 2 != xd[1] || qd[0] < 1 || sd[0] != qd[0] || sd[1] != qd[1] ||
      sd[2] * per != xd[1] || sd[3] != kPanel || g.element_count() != qd[0] ||
      layer.element_count() < 1 || y->element_count() != xd[0] * qd[1] * kPanel) {
    return ffi::Error::InvalidArgument("stacked_qgemm fp4: inconsistent shapes or dtypes");
  }
  auto job = std::make_shared<Job>();
  const int64_t l = Layer(layer, qd[0]);
  const int64_t M = jaxserve_cpu::RowsToCompute(layer.typed_data(), layer.element_count(),
                                                xd[0]);
  const int64_t K = xd[1], nb = K / kQ4Block;
  job->codes = nv ? Codes::kNvfp4 : Codes::kMxfp4;
  job->M = M, job->K = K, job->U = qd[1] / kUnit, job->N = qd[1] * kPanel, job->B = per;
  job->x = x.typed_data();
  // 1/2 for the table's 2 v; NVFP4's scales read as E4M3 x 2^-8 (`Fp4Scales8`).
  job->unit = 0.5f * (nv ? jaxserve_cpu::kFp8Unit * g.typed_data()[l] : 1.0f);
  thread_local std::vector<int8_t> codes, rests;  // i8[M, K]
  thread_local std::vector<float> scales, sums;  // f32[M, K / 32]
  thread_local std::vector<int32_t> offsets;  // i32[M, K / 16, 2]
  if (M < kStageRows) {  // the activations split once per call for the dot path
    codes.resize(M * K), rests.resize(M * K), scales.resize(M * nb), sums.resize(M * nb);
    offsets.resize(M * K / 8);
    QuantizeRows(job->x, M, K, codes.data(), rests.data(), scales.data(), sums.data());
    Fp4Offsets(codes.data(), rests.data(), M, K, offsets.data());
    for (int64_t i = 0; i < M * nb; ++i) scales[i] *= job->unit;
    job->xq = codes.data(), job->xr = rests.data(), job->xd = scales.data();
    job->xoff = offsets.data();
  }
  job->xsum = nullptr;
  job->q = static_cast<const uint8_t*>(q.untyped_data()) + l * qd[1] * qd[2] * kPanel;
  job->s = static_cast<const uint8_t*>(s.untyped_data()) + l * sd[1] * sd[2] * kPanel;
  job->z = nullptr;
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
                                  .Arg<ffi::AnyBuffer>()         // codes: i8 or FP8 E4M3
                                  .Arg<ffi::AnyBuffer>()         // scales: f16 or f32 (FP8)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(StackedQ4Gemm, StackedQ4GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::U8>>()   // codes, two per byte
                                  .Arg<ffi::Buffer<ffi::F16>>()  // scales
                                  .Arg<ffi::AnyBuffer>()         // zeros: f16 or f32
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(StackedFp4Gemm, StackedFp4GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::U8>>()   // codes, two per byte
                                  .Arg<ffi::AnyBuffer>()         // scales: E8M0 u8 or E4M3
                                  .Arg<ffi::Buffer<ffi::F32>>()  // global scale per layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
