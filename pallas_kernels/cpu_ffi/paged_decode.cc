// Decode attention on the CPU that reads K/V pages where they lie in the pool (an XLA FFI
// custom call): no gathered copy of the context, each (row, KV head) reads its own live
// pages once for K and once for V, spread over XLA's intra-op thread pool. Pages are
// float32, float16 or bfloat16 (converted to float32 in registers; the sums are float32).
//
// Result: the online-softmax state of each query (acc = sum_j exp(s_j - m) v_j unscaled,
// m = max_j s_j, denom = sum_j exp(s_j - m)), merged with the XLA path's context part by
// the caller. A row with nothing to read (len 0) gets acc 0, m -1e30, denom 0.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "pool.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr float kNeg = -1e30f;  // running max of a row that has seen no key (as xla.py)
constexpr int64_t kMinParallelKeys = 2048;  // keys x KV heads below which one thread works

struct Job {
  const float* q;       // f32[n, H, G, D]
  const void* pool;     // T[L, 2, H, P, S, D] (T: the page element, below)
  const int32_t* tables;  // i32[n, W]
  const int32_t* lens;  // i32[n]
  float* acc;           // f32[n, H, G, D]
  float* m;             // f32[n, H, G]
  float* denom;         // f32[n, H, G]
  int64_t n, H, G, D, P, S, W, layer;
  int32_t window;
  float sm_scale, soft_cap;
  int64_t items;  // n * H
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
};

// One vector register of floats (simd.h: 16 with AVX-512, 8 otherwise).
using jaxserve_cpu::kLanes;
using jaxserve_cpu::vec;
typedef float vecu __attribute__((vector_size(kLanes * 4), aligned(4)));  // unaligned loads
typedef int ivec __attribute__((vector_size(kLanes * 4)));

inline vec Load(const float* p) { return *reinterpret_cast<const vecu*>(p); }

// The 16-bit page elements (their bits), as template tags.
struct Half {
  uint16_t bits;
};
struct Bf16 {
  uint16_t bits;
};

inline float ToFloat(float x) { return x; }
inline float ToFloat(Bf16 x) {
  const uint32_t w = uint32_t(x.bits) << 16;  // bfloat16: float32's upper half
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}
inline float ToFloat(Half x) {
#if defined(__F16C__)
  return _cvtsh_ss(x.bits);
#else
  const uint32_t h = x.bits, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float f;
  if (exp == 0) {
    f = std::ldexp(float(man), -24);  // zero and subnormals
  } else {
    const uint32_t w = exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13);
    std::memcpy(&f, &w, 4);
  }
  return (h & 0x8000) ? -f : f;
#endif
}

// kLanes page elements from p on as floats.
inline vec LoadKV(const float* p) { return Load(p); }
inline vec LoadKV(const Bf16* p) {
  typedef uint16_t hvec __attribute__((vector_size(kLanes * 2), aligned(2)));
  typedef uint32_t uvec __attribute__((vector_size(kLanes * 4)));
  const uvec w = __builtin_convertvector(*reinterpret_cast<const hvec*>(p), uvec) << 16;
  return (vec)w;  // the same bits
}
inline vec LoadKV(const Half* p) {
#if defined(__AVX512F__)
  return (vec)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__) && defined(__AVX__)
  return (vec)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vec r;
  for (int t = 0; t < kLanes; ++t) r[t] = ToFloat(p[t]);
  return r;
#endif
}

// Row `p` of d elements as floats: float32 rows as they are, others converted into `buf`.
template <typename T>
inline const float* RowAsFloat(const T* p, int64_t d, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return p;
  } else {
    int64_t i = 0;
    for (; i + kLanes <= d; i += kLanes) *reinterpret_cast<vecu*>(buf + i) = LoadKV(p + i);
    for (; i < d; ++i) buf[i] = ToFloat(p[i]);
    return buf;
  }
}

// One round of `ReduceLanes`: vectors 2i and 2i+1 of `cur` (each k keys of w lanes, keys
// in order) into vector i (2k keys of w / 2 lanes): the first halves of every key's lanes
// (`lo`) plus the second halves (`lo + half`).
inline void Round(vec* cur, int count, ivec lo, int half) {
  const ivec hi = lo + half;
  for (int i = 0; i < count / 2; ++i)
    cur[i] = __builtin_shuffle(cur[2 * i], cur[2 * i + 1], lo) +
             __builtin_shuffle(cur[2 * i], cur[2 * i + 1], hi);
}

// Lane t of the result: the sum of p[t]'s lanes (p is overwritten). Halves are added
// pairwise in log2(lanes) rounds: 45 vector ops for 16 sums (21 for 8) instead of one
// horizontal sum per key.
inline vec ReduceLanes(vec p[kLanes]) {
#if defined(__AVX512F__)
  Round(p, 16, ivec{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}, 8);
  Round(p, 8, ivec{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}, 4);
  Round(p, 4, ivec{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}, 2);
  Round(p, 2, ivec{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}, 1);
#else
  Round(p, 8, ivec{0, 1, 2, 3, 8, 9, 10, 11}, 4);
  Round(p, 4, ivec{0, 1, 4, 5, 8, 9, 12, 13}, 2);
  Round(p, 2, ivec{0, 2, 4, 6, 8, 10, 12, 14}, 1);
#endif
  return p[0];
}

// Asks for `n` elements from `p` on (the next page of a row: pages lie anywhere in the
// pool, where the hardware prefetcher does not follow).
template <typename T>
inline void Prefetch(const T* p, int64_t n) {
  const char* b = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * int64_t(sizeof(T)); i += 64) __builtin_prefetch(b + i);
}

// q . k of one query against kLanes consecutive keys (k: kLanes rows of kD elements).
template <int kD, typename T>
inline vec ScoresLanes(const vec* q, const T* k) {
  vec p[kLanes];
  for (int t = 0; t < kLanes; ++t) {
    vec s = q[0] * LoadKV(k + t * kD);
    for (int c = 1; c < kD / kLanes; ++c) s += q[c] * LoadKV(k + t * kD + c * kLanes);
    p[t] = s;
  }
  return ReduceLanes(p);
}

// One (row, KV head): logits of its G queries over the row's live keys, softmax, P.V.
// kD, kG > 0: compile-time head size and group (the loops unroll and the G x D
// accumulators stay in registers); 0: read from the job. T: the page element.
template <typename T, int kD, int kG>
void RunItem(const Job& j, int64_t item, std::vector<float>& scores) {
  const int64_t D = kD > 0 ? kD : j.D, G = kG > 0 ? kG : j.G, S = j.S;
  const int64_t row = item / j.H, h = item % j.H;
  const int64_t base = (row * j.H + h) * G;
  float* __restrict__ acc = j.acc + base * D;
  float* m = j.m + base;
  float* denom = j.denom + base;
  std::fill(acc, acc + G * D, 0.0f);
  std::fill(m, m + G, kNeg);
  std::fill(denom, denom + G, 0.0f);
  int64_t len = std::min<int64_t>(j.lens[row], j.W * S);  // keys past the table: none
  if (len <= 0) return;
  const int64_t pos = len - 1;  // the row's one query is its last token
  const int64_t lo = j.window > 0 ? std::max<int64_t>(0, pos - j.window + 1) : 0;
  const int64_t count = len - lo;
  scores.resize(G * count);
  float* __restrict__ sc = scores.data();
  const float* __restrict__ q = j.q + base * D;
  const int64_t plane = j.P * S * D;  // one (layer, K or V, head) of the pool
  const T* pool = static_cast<const T*>(j.pool);
  const T* kbase = pool + ((j.layer * 2 + 0) * j.H + h) * plane;
  const T* vbase = pool + ((j.layer * 2 + 1) * j.H + h) * plane;
  float widened[kD > 0 ? kD : 256];  // one K or V row as floats (16-bit pages; D <= 256)
  const int32_t* table = j.tables + row * j.W;
  auto slot_of = [&](int64_t key) -> int64_t {  // element offset of key `key` in a plane
    int64_t page = std::clamp<int64_t>(table[key / S], 0, j.P - 1);
    return (page * S + key % S) * D;
  };

  // Pass 1: q.k for every key (the pool read once for K), a page's run of keys at a time.
  bool scored = false;
  if constexpr (kD > 0 && kD % kLanes == 0 && kG > 0) {
    if (S % 16 == 0) {  // whole blocks of 16 keys, never across a page
      scored = true;
      vec qv[kG][kD / kLanes];
      for (int64_t g = 0; g < kG; ++g)
        for (int c = 0; c < kD / kLanes; ++c) qv[g][c] = Load(q + g * kD + c * kLanes);
      for (int64_t first = lo / 16 * 16; first < len; first += 16) {
        const T* k = kbase + slot_of(first);
        if (first + 32 < len) Prefetch(kbase + slot_of(first + 32), 16 * kD);
        const int64_t from = std::max(first, lo), to = std::min(first + 16, len);
        for (int64_t g = 0; g < kG; ++g) {
          // NOTE: a block's keys outside [lo, len) are computed and dropped; a NaN
          // there stays in its own lane (each lane sums one key's products).
          float s16[16];
          for (int part = 0; part < 16 / kLanes; ++part) {
            const vec s = ScoresLanes<kD>(qv[g], k + part * kLanes * kD);
            for (int t = 0; t < kLanes; ++t) s16[part * kLanes + t] = s[t];
          }
          for (int64_t t = from; t < to; ++t) sc[g * count + (t - lo)] = s16[t - first];
        }
      }
    }
  }
  for (int64_t key = lo; !scored && key < len;) {  // any other geometry: key by key
    const int64_t end = std::min(len, (key / S + 1) * S);
    const T* k = kbase + slot_of(key);
    for (int64_t t = key; t < end; ++t, k += D) {
      const float* __restrict__ kf = RowAsFloat(k, D, widened);
      for (int64_t g = 0; g < G; ++g) {
        float s = 0.0f;
        for (int64_t d = 0; d < D; ++d) s += q[g * D + d] * kf[d];
        sc[g * count + (t - lo)] = s;
      }
    }
    key = end;
  }
  // Softmax per query (scale, soft cap, max, exp, sum).
  const float scale = j.sm_scale, cap = j.soft_cap;
  for (int64_t g = 0; g < G; ++g) {
    float* __restrict__ s = sc + g * count;
    float mx = kNeg;
    if (cap > 0.0f) {
      for (int64_t t = 0; t < count; ++t) s[t] = cap * std::tanh(s[t] * scale / cap);
    } else {
      for (int64_t t = 0; t < count; ++t) s[t] *= scale;
    }
    for (int64_t t = 0; t < count; ++t) mx = std::max(mx, s[t]);
    float sum = 0.0f;
    for (int64_t t = 0; t < count; ++t) {
      s[t] = std::exp(s[t] - mx);
      sum += s[t];
    }
    m[g] = mx;
    denom[g] = sum;
  }
  // Pass 2: P.V (the pool read once for V) into local accumulators.
  float local[kG > 0 && kD > 0 ? kG * kD : 1];
  float* __restrict__ a = kG > 0 && kD > 0 ? local : acc;
  if (kG > 0 && kD > 0) std::fill(local, local + G * D, 0.0f);
  for (int64_t key = lo; key < len;) {
    const int64_t end = std::min(len, (key / S + 1) * S);
    const T* v = vbase + slot_of(key);
    if (end < len) Prefetch(vbase + slot_of(end), std::min(S, len - end) * D);
    for (int64_t t = key; t < end; ++t, v += D) {
      const float* __restrict__ vf = RowAsFloat(v, D, widened);
      for (int64_t g = 0; g < G; ++g) {
        const float p = sc[g * count + (t - lo)];
        for (int64_t d = 0; d < D; ++d) a[g * D + d] += p * vf[d];
      }
    }
    key = end;
  }
  if (kG > 0 && kD > 0) std::copy(local, local + G * D, acc);
}

// Claims items until none are left; returns when this thread has finished its own.
template <typename T>
void Drain(Job& j) {
  thread_local std::vector<float> scores;
  int64_t finished = 0;
  // The common geometries get unrolled code: head size 64 or 128, group 1-8.
  const int64_t shape = (j.D == 64 || j.D == 128) && j.G >= 1 && j.G <= 8 ? j.D * 16 + j.G : 0;
  for (int64_t i; (i = j.next.fetch_add(1)) < j.items; ++finished) {
    switch (shape) {
#define JAXSERVE_CASE(d, g) \
  case d * 16 + g: RunItem<T, d, g>(j, i, scores); break;
      JAXSERVE_CASE(64, 1) JAXSERVE_CASE(64, 2) JAXSERVE_CASE(64, 3) JAXSERVE_CASE(64, 4)
      JAXSERVE_CASE(64, 5) JAXSERVE_CASE(64, 6) JAXSERVE_CASE(64, 7) JAXSERVE_CASE(64, 8)
      JAXSERVE_CASE(128, 1) JAXSERVE_CASE(128, 2) JAXSERVE_CASE(128, 3) JAXSERVE_CASE(128, 4)
      JAXSERVE_CASE(128, 5) JAXSERVE_CASE(128, 6) JAXSERVE_CASE(128, 7) JAXSERVE_CASE(128, 8)
#undef JAXSERVE_CASE
      default: RunItem<T, 0, 0>(j, i, scores); break;
    }
  }
  jaxserve_cpu::MarkDone(j.done, finished, j.items, j.mu, j.cv);
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::AnyBuffer kv_pages, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lens,
                           ffi::Buffer<ffi::S32> window, float sm_scale, float soft_cap,
                           ffi::ResultBuffer<ffi::F32> acc, ffi::ResultBuffer<ffi::F32> m,
                           ffi::ResultBuffer<ffi::F32> denom) {
  auto qd = q.dimensions();
  auto pd = kv_pages.dimensions();
  auto td = tables.dimensions();
  if (qd.size() != 4 || pd.size() != 6 || td.size() != 2 || pd[1] != 2 || pd[2] != qd[1] ||
      pd[5] != qd[3] || td[0] != qd[0] || lens.element_count() != qd[0] || pd[0] < 1 ||
      pd[3] < 1 || pd[4] < 1 || layer.element_count() < 1 || window.element_count() < 1 ||
      acc->element_count() != q.element_count() ||
      m->element_count() != qd[0] * qd[1] * qd[2] || denom->element_count() != m->element_count()) {
    return ffi::Error::InvalidArgument("paged_decode: inconsistent shapes");
  }
  const ffi::DataType kind = kv_pages.element_type();
  if (kind != ffi::DataType::F32 && kind != ffi::DataType::F16 && kind != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("paged_decode: pages must be float32, float16 or bfloat16");
  }
  if (kind != ffi::DataType::F32 && qd[3] > 256) {
    return ffi::Error::InvalidArgument("paged_decode: 16-bit pages with head_dim above 256");
  }
  // Shared by every task; a task that starts after all items are claimed touches only
  // the counters, so the buffers need not outlive this call.
  auto job = std::make_shared<Job>();
  job->q = q.typed_data();
  job->pool = kv_pages.untyped_data();
  job->tables = tables.typed_data();
  job->lens = lens.typed_data();
  job->acc = acc->typed_data();
  job->m = m->typed_data();
  job->denom = denom->typed_data();
  job->n = qd[0], job->H = qd[1], job->G = qd[2], job->D = qd[3];
  job->P = pd[3], job->S = pd[4], job->W = td[1];
  job->layer = std::clamp<int64_t>(layer.typed_data()[0], 0, pd[0] - 1);
  job->window = window.typed_data()[0];
  job->sm_scale = sm_scale;
  job->soft_cap = soft_cap;
  job->items = job->n * job->H;
  if (job->items == 0) return ffi::Error::Success();
  // NOTE: a small step (a few short rows) runs on this thread alone: waking helpers
  // costs more than they save below ~2k keys x heads (~1 MB of K and V).
  int64_t keys = 0;
  for (int64_t r = 0; r < job->n; ++r) keys += std::max<int32_t>(job->lens[r], 0);
  const int64_t helpers =
      keys * job->H < kMinParallelKeys ? 0 : jaxserve_cpu::Helpers(pool.num_threads(), job->items);
  // NOTE: waits only for items another thread has claimed (and so is running): no wait
  // on a task the pool has not started, so a busy pool cannot deadlock this call.
  void (*drain)(Job&) = kind == ffi::DataType::F16    ? Drain<Half>
                        : kind == ffi::DataType::BF16 ? Drain<Bf16>
                                                      : Drain<float>;
  jaxserve_cpu::RunParallel(helpers, [job, drain] { drain(*job); },
                            [&pool](auto task) { pool.Schedule(std::move(task)); }, job->done,
                            job->items, job->mu, job->cv);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()  // kv_pages (f32, f16, bf16)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // acc
                                  .Ret<ffi::Buffer<ffi::F32>>()  // m
                                  .Ret<ffi::Buffer<ffi::F32>>());  // denom
