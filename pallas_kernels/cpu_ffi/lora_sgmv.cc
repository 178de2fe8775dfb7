// Per-token LoRA updates on the CPU (an XLA FFI custom call): y[t] += (x[t] @ A[l, :, s_t, :])
// @ B[l, s_t] for every row t whose slot s_t is not -1, reading layer `l` of the slot stacks
// A f32[L, K, S, R] and B f32[L, S, R, N] in place (`models.lora`'s layout; `l` traced
// inside the layer loop, so the loop makes no per-layer copy of the stacks).
//
// Each row is multiplied by its own slot's R columns only: the rows are grouped by slot
// (a counting sort) and cut into units of up to kRows rows of one slot, which the caller
// and XLA's intra-op pool claim from a shared counter. A unit's shrink keeps kRows sums
// per vector of rank columns in registers (A's row k of a slot is R contiguous floats, its
// rows S * R apart), then its expand walks B's rows (N contiguous floats each) in column
// tiles of kRows x kCols sums and adds them to y in place. A unit with fewer rows reads a
// row of zeros for the rest, so every tile has the same shape.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "pool.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve_cpu::kLanes;
using jaxserve_cpu::vec;
typedef float vec8 __attribute__((vector_size(32)));  // 8 floats: ranks that are not kLanes'

constexpr int kRows = 8;  // rows per unit (one slot's)
constexpr int64_t kMaxRank = 512;  // the h buffer on the stack: kRows x kMaxRank floats
#if defined(__AVX512F__)
constexpr int kColVecs = 3;  // the expand's tile: kRows x 3 vectors = 24 of 32 registers
#else
constexpr int kColVecs = 1;  // kRows x 1 vector = 8 of 16 registers
#endif

template <typename V>
inline V Load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename V>
inline void Store(float* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}

struct Job {
  const float* x;  // f32[M, K]
  const float* a;  // f32[K, S, R]: layer l's A stacks
  const float* b;  // f32[S, R, N]: layer l's B stacks
  float* y;        // f32[M, N], updated in place
  int64_t K, N, S, R;
  std::vector<int32_t> order;        // the rows with a slot, grouped by slot
  std::vector<int64_t> unit_first;   // each unit's first index into `order`
  std::vector<int32_t> unit_rows;    // and its number of rows (1..kRows)
  std::vector<int32_t> unit_slot;    // and its slot
  std::vector<float> zeros;          // f32[K]: the row a short unit reads for the rest
  int64_t units = 0;
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable cv;
};

// h[i, :R] = xr[i] @ A[:, s, :] for the unit's kRows rows, V-wide vectors of rank columns.
template <typename V>
void Shrink(const Job& j, const float* const* xr, int64_t s, float* h) {
  constexpr int64_t w = sizeof(V) / sizeof(float);
  const int64_t stride = j.S * j.R;
  for (int64_t r0 = 0; r0 < j.R; r0 += w) {
    V acc[kRows];
    for (int i = 0; i < kRows; ++i) acc[i] = V{};
    const float* a = j.a + s * j.R + r0;
    for (int64_t k = 0; k < j.K; ++k, a += stride) {
      const V av = Load<V>(a);
      for (int i = 0; i < kRows; ++i) acc[i] += xr[i][k] * av;
    }
    for (int i = 0; i < kRows; ++i) Store<V>(h + i * j.R + r0, acc[i]);
  }
}

// The same for a rank no vector width divides.
void ShrinkScalar(const Job& j, const float* const* xr, int64_t s, float* h) {
  const int64_t stride = j.S * j.R;
  std::fill(h, h + kRows * j.R, 0.0f);
  const float* a = j.a + s * j.R;
  for (int64_t k = 0; k < j.K; ++k, a += stride) {
    for (int i = 0; i < kRows; ++i) {
      const float xv = xr[i][k];
      for (int64_t r = 0; r < j.R; ++r) h[i * j.R + r] += xv * a[r];
    }
  }
}

// y rows yr[:rows] += h @ B[s][:, c0 : c0 + NV vectors].
template <int NV>
void ExpandTile(const Job& j, const float* h, const float* bs, float* const* yr, int rows,
                int64_t c0) {
  vec acc[kRows][NV];
  for (int i = 0; i < kRows; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vec{};
  for (int64_t r = 0; r < j.R; ++r) {
    vec bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = Load<vec>(bs + r * j.N + c0 + v * kLanes);
    for (int i = 0; i < kRows; ++i) {
      const float hv = h[i * j.R + r];
      for (int v = 0; v < NV; ++v) acc[i][v] += hv * bv[v];
    }
  }
  for (int i = 0; i < rows; ++i) {
    for (int v = 0; v < NV; ++v) {
      float* p = yr[i] + c0 + v * kLanes;
      Store<vec>(p, Load<vec>(p) + acc[i][v]);
    }
  }
}

void RunUnit(const Job& j, int64_t u) {
  const int rows = j.unit_rows[u];
  const int64_t s = j.unit_slot[u];
  const float* xr[kRows];
  float* yr[kRows];
  for (int i = 0; i < kRows; ++i) {
    const int32_t row = i < rows ? j.order[j.unit_first[u] + i] : -1;
    xr[i] = row >= 0 ? j.x + row * j.K : j.zeros.data();
    yr[i] = row >= 0 ? j.y + row * j.N : nullptr;
  }
  alignas(64) float h[kRows * kMaxRank];
  if (j.R % kLanes == 0) {
    Shrink<vec>(j, xr, s, h);
  } else if (j.R % 8 == 0) {
    Shrink<vec8>(j, xr, s, h);
  } else {
    ShrinkScalar(j, xr, s, h);
  }
  const float* bs = j.b + s * j.R * j.N;
  constexpr int64_t wide = kColVecs * kLanes;
  int64_t c = 0;
  for (; c + wide <= j.N; c += wide) ExpandTile<kColVecs>(j, h, bs, yr, rows, c);
  for (; c + kLanes <= j.N; c += kLanes) ExpandTile<1>(j, h, bs, yr, rows, c);
  for (; c < j.N; ++c) {  // columns past the last whole vector
    for (int i = 0; i < rows; ++i) {
      float sum = 0.0f;
      for (int64_t r = 0; r < j.R; ++r) sum += h[i * j.R + r] * bs[r * j.N + c];
      yr[i][c] += sum;
    }
  }
}

void Drain(Job& j) {
  int64_t finished = 0;
  for (int64_t u = j.next.fetch_add(1); u < j.units; u = j.next.fetch_add(1), ++finished) {
    RunUnit(j, u);
  }
  jaxserve_cpu::MarkDone(j.done, finished, j.units, j.mu, j.cv);
}

ffi::Error LoraSgmvImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> y_in,
                        ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> slots,
                        ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                        ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  auto yd = y_in.dimensions(), xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions();
  if (yd.size() != 2 || xd.size() != 2 || ad.size() != 4 || bd.size() != 4 ||
      xd[0] != yd[0] || slots.element_count() != xd[0] || ad[1] != xd[1] ||
      bd[0] != ad[0] || bd[1] != ad[2] || bd[2] != ad[3] || bd[3] != yd[1] || ad[0] < 1 ||
      ad[3] > kMaxRank || layer.element_count() < 1 ||
      y->element_count() != y_in.element_count()) {
    return ffi::Error::InvalidArgument("lora_sgmv: inconsistent shapes");
  }
  float* out = y->typed_data();
  if (out != y_in.typed_data()) {  // not aliased: start from y
    std::memcpy(out, y_in.typed_data(), sizeof(float) * y_in.element_count());
  }
  auto job = std::make_shared<Job>();
  Job& j = *job;
  const int64_t m = xd[0], l = std::clamp<int64_t>(layer.typed_data()[0], 0, ad[0] - 1);
  j.K = xd[1], j.S = ad[2], j.R = ad[3], j.N = yd[1];
  j.x = x.typed_data();
  j.a = a.typed_data() + l * j.K * j.S * j.R;
  j.b = b.typed_data() + l * j.S * j.R * j.N;
  j.y = out;
  // Group the rows by slot (a counting sort); rows of slot -1 (or out of range) keep y.
  const int32_t* sl = slots.typed_data();
  std::vector<int64_t> count(j.S + 1, 0);
  for (int64_t t = 0; t < m; ++t) {
    if (sl[t] >= 0 && sl[t] < j.S) ++count[sl[t] + 1];
  }
  for (int64_t s = 0; s < j.S; ++s) count[s + 1] += count[s];
  j.order.resize(count[j.S]);
  std::vector<int64_t> fill(count.begin(), count.end() - 1);
  for (int64_t t = 0; t < m; ++t) {
    if (sl[t] >= 0 && sl[t] < j.S) j.order[fill[sl[t]]++] = static_cast<int32_t>(t);
  }
  for (int64_t s = 0; s < j.S; ++s) {
    for (int64_t i = count[s]; i < count[s + 1]; i += kRows) {
      j.unit_first.push_back(i);
      j.unit_rows.push_back(static_cast<int32_t>(std::min<int64_t>(kRows, count[s + 1] - i)));
      j.unit_slot.push_back(static_cast<int32_t>(s));
    }
  }
  j.units = static_cast<int64_t>(j.unit_first.size());
  if (j.units == 0) return ffi::Error::Success();
  j.zeros.assign(j.K, 0.0f);
  const int64_t helpers = jaxserve_cpu::Helpers(pool.num_threads(), j.units);
  jaxserve_cpu::RunParallel(helpers, [job] { Drain(*job); },
                            [&pool](auto task) { pool.Schedule(std::move(task)); }, j.done, j.units, j.mu,
                            j.cv);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LoraSgmv, LoraSgmvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // y (the base output)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Arg<ffi::Buffer<ffi::F32>>()  // A stacks
                                  .Arg<ffi::Buffer<ffi::F32>>()  // B stacks
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y + updates
