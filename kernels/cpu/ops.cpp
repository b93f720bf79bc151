// ferry's CPU kernels: decode attention over the paged KV cache, RMSNorm with the residual
// add, SiLU-and-mul and in-place rotary. Registered as torch.ops.ferry_cpu.* and built on
// first use by kernels/cpu_ops.py (torch.utils.cpp_extension, -O3 -march=native).
//
// Numerics follow kernels/reference.py: math in fp32, one rounding to the tensor's dtype
// where the reference rounds (bf16 results match the references bit for bit except in
// RMSNorm's mean, whose fp32 summation order differs). Threads: at::parallel_for, i.e.
// torch's intra-op pool (--cpu-threads).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define FERRY_AVX2 1
#else
#define FERRY_AVX2 0
#endif
#if defined(__AVX512F__) || FERRY_AVX2
#include <immintrin.h>
#endif
#include <vector>

namespace {

// bf16 is handled as its bit pattern (uint16_t) with shift/round helpers that GCC
// auto-vectorizes (bf16's conversions do not vectorize).
using bf16 = uint16_t;

inline float to_f(float x) { return x; }
inline float to_f(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
template <typename T> inline T from_f(float x);
template <> inline float from_f<float>(float x) { return x; }
// round to nearest even, NaN kept a quiet NaN (bf16's rounding)
template <> inline bf16 from_f<bf16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<bf16>(x != x ? 0x7fc0u : r);
}

// exp(x) in fp32 without libm, so loops over it vectorize: x = n ln2 + r, |r| <= ln2/2,
// e^r by its degree-6 Taylor polynomial (error < 2e-7 relative), 2^n through the exponent
// bits. Below -87.3 it returns 0, above 88.7 +inf.
inline float exp_f(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  // round to nearest even by the 1.5 * 2^23 trick (what nearbyint gives for |n| < 2^22, but
  // plain arithmetic, so every loop over exp_f vectorizes)
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = x - n * 0.693145751953125f - n * 1.42860682030941723212e-6f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return p * scale;
}

// dot(q, k) and a += p * v over d elements (q, a fp32; k, v in T): AVX-512 when the build
// has it and d is a multiple of 16, AVX2+FMA (e.g. AMD Zen, older Intel) when d is a multiple
// of 8, else scalar loops (GCC does not vectorize the float reduction without -ffast-math).
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#elif FERRY_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

template <typename T>
inline float dot_row(const float* q, const T* k, int64_t d) {
#if defined(__AVX512F__)
  if (d % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(k + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#elif FERRY_AVX2
  if (d % 16 == 0) {  // two accumulators: FMA latency, not one chain
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load8(k + i + 8), a1);
    }
    return hsum8(_mm256_add_ps(a0, a1));
  }
  if (d % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), acc);
    return hsum8(acc);
  }
#endif
  float dot = 0.f;
  for (int64_t i = 0; i < d; ++i) dot += q[i] * to_f(k[i]);
  return dot;
}

template <typename T>
inline void axpy_row(float* a, float p, const T* v, int64_t d) {
#if defined(__AVX512F__)
  if (d % 16 == 0) {
    const __m512 pv = _mm512_set1_ps(p);
    for (int64_t i = 0; i < d; i += 16)
      _mm512_storeu_ps(a + i, _mm512_fmadd_ps(pv, load16(v + i), _mm512_loadu_ps(a + i)));
    return;
  }
#elif FERRY_AVX2
  if (d % 8 == 0) {
    const __m256 pv = _mm256_set1_ps(p);
    for (int64_t i = 0; i < d; i += 8)
      _mm256_storeu_ps(a + i, _mm256_fmadd_ps(pv, load8(v + i), _mm256_loadu_ps(a + i)));
    return;
  }
#endif
  for (int64_t i = 0; i < d; ++i) a[i] += p * to_f(v[i]);
}

// In-place softmax of nq rows of len fp32 scores (s[j * len + l]). softcap > 0: the scores
// become softcap * tanh(s / softcap) first (Gemma 2); sinks: row j's sink logit sinks[j]
// joins the denominator only (gpt-oss).
inline void softmax_rows(float* s, int64_t nq, int64_t len, float softcap = 0.f,
                         const float* sinks = nullptr) {
  for (int64_t j = 0; j < nq; ++j) {
    float* sj = s + j * len;
    if (softcap > 0.f)
      for (int64_t l = 0; l < len; ++l) sj[l] = softcap * std::tanh(sj[l] / softcap);
    float m = sinks ? sinks[j] : -INFINITY;
    for (int64_t l = 0; l < len; ++l) m = std::max(m, sj[l]);
    float sum = sinks ? exp_f(sinks[j] - m) : 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t l = 0; l < len; ++l) {
      sj[l] = exp_f(sj[l] - m);
      sum += sj[l];
    }
    const float inv = len > 0 ? 1.f / sum : 0.f;
    for (int64_t l = 0; l < len; ++l) sj[l] *= inv;
  }
}

// Software prefetch of the K/V row kPrefetch tokens ahead: the slots are an indirection the
// hardware prefetcher does not follow across pages.
constexpr int64_t kPrefetch = 8;
template <typename T>
inline void prefetch_row(const T* p, int64_t bytes) {
#if defined(__AVX512F__) || FERRY_AVX2
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
#else
  (void)p;
  (void)bytes;
#endif
}

// Row of slot tokens[l] in `base` (a K or V buffer [slots, ...]), after prefetching the row
// of tokens[l + kPrefetch] (when `prefetch`; `row_bytes` from the row's start).
template <typename T, typename I>
inline const T* slot_row(const T* base, const I* tokens, int64_t l, int64_t len,
                         int64_t slot_stride, int64_t row_bytes, bool prefetch = true) {
  if (prefetch && l + kPrefetch < len)
    prefetch_row(base + static_cast<int64_t>(tokens[l + kPrefetch]) * slot_stride, row_bytes);
  return base + static_cast<int64_t>(tokens[l]) * slot_stride;
}

// One decode task: request b's query heads of KV heads [h0, h0 + nh), nq = nh * group query
// rows (query row j attends with KV head h0 + j / group) over `len` cached tokens.
template <typename T, typename I>
void decode_task(const T* q, int64_t q_head_stride, const T* kb, const T* vb,
                 int64_t slot_stride, int64_t head_stride, const I* tokens, int64_t len,
                 int64_t nq, int64_t group, int64_t d, float scale, T* o,
                 int64_t o_head_stride, std::vector<float>& buf, float softcap,
                 const float* sinks) {
  // buf: nq*d scaled queries, nq*d accumulators, nq*len scores
  buf.resize(static_cast<size_t>(nq * (2 * d + len)));
  float* qf = buf.data();
  float* acc = qf + nq * d;
  float* s = acc + nq * d;
  for (int64_t j = 0; j < nq; ++j)
    for (int64_t i = 0; i < d; ++i) {
      qf[j * d + i] = to_f(q[j * q_head_stride + i]) * scale;
      acc[j * d + i] = 0.f;
    }
  const int64_t row_bytes = ((nq / group - 1) * head_stride + d) * static_cast<int64_t>(sizeof(T));
  for (int64_t l = 0; l < len; ++l) {
    const T* row = slot_row(kb, tokens, l, len, slot_stride, row_bytes);
    for (int64_t j = 0; j < nq; ++j) {
      s[j * len + l] = dot_row(qf + j * d, row + (j / group) * head_stride, d);
    }
  }
  softmax_rows(s, nq, len, softcap, sinks);
  for (int64_t l = 0; l < len; ++l) {
    const T* row = slot_row(vb, tokens, l, len, slot_stride, row_bytes);
    for (int64_t j = 0; j < nq; ++j) {
      axpy_row(acc + j * d, s[j * len + l], row + (j / group) * head_stride, d);
    }
  }
  for (int64_t j = 0; j < nq; ++j)
    for (int64_t i = 0; i < d; ++i) o[j * o_head_stride + i] = from_f<T>(acc[j * d + i]);
}

#if defined(__AVX512F__) || FERRY_AVX2
// The same task with the query rows of one KV head kept together (G = group rows, a
// template constant so the accumulators live in registers): QK^T reads each K row once for
// all G rows, and PV runs in passes of two vectors of the head dimension with G x 2
// accumulators in registers, the V rows re-read from L1/L2 per pass, instead of a
// load-FMA-store of every accumulator per token (which bound the generic task: ~3x slower).
#if defined(__AVX512F__)
using VecT = __m512;
constexpr int64_t kW = 16;
inline VecT vzero() { return _mm512_setzero_ps(); }
inline VecT vset1(float x) { return _mm512_set1_ps(x); }
inline VecT vload(const float* p) { return _mm512_loadu_ps(p); }
inline VecT vload(const bf16* p) { return load16(p); }
inline VecT vfma(VecT a, VecT b, VecT c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, VecT v) { _mm512_storeu_ps(p, v); }
inline float vsum(VecT v) { return _mm512_reduce_add_ps(v); }
#else
using VecT = __m256;
constexpr int64_t kW = 8;
inline VecT vzero() { return _mm256_setzero_ps(); }
inline VecT vset1(float x) { return _mm256_set1_ps(x); }
inline VecT vload(const float* p) { return _mm256_loadu_ps(p); }
inline VecT vload(const bf16* p) { return load8(p); }
inline VecT vfma(VecT a, VecT b, VecT c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, VecT v) { _mm256_storeu_ps(p, v); }
inline float vsum(VecT v) { return hsum8(v); }
#endif

template <typename T, typename I, int G>
void decode_task_grouped(const T* q, int64_t q_head_stride, const T* kb, const T* vb,
                         int64_t slot_stride, int64_t head_stride, const I* tokens, int64_t len,
                         int64_t nh, int64_t d, float scale, T* o, int64_t o_head_stride,
                         std::vector<float>& buf, float softcap, const float* sinks) {
  const int64_t nq = nh * G;
  buf.resize(static_cast<size_t>(nq * (d + len)));
  float* qf = buf.data();
  float* s = qf + nq * d;
  for (int64_t j = 0; j < nq; ++j)
    for (int64_t i = 0; i < d; ++i) qf[j * d + i] = to_f(q[j * q_head_stride + i]) * scale;
  const int64_t row_bytes = ((nh - 1) * head_stride + d) * static_cast<int64_t>(sizeof(T));
  // scores: s[j * len + l]
  for (int64_t l = 0; l < len; ++l) {
    const T* row = slot_row(kb, tokens, l, len, slot_stride, row_bytes);
    for (int64_t h = 0; h < nh; ++h) {
      const T* k = row + h * head_stride;
      const float* qh = qf + h * G * d;
      VecT a[G];
      for (int g = 0; g < G; ++g) a[g] = vzero();
      for (int64_t i = 0; i < d; i += kW) {
        const VecT kv = vload(k + i);
        for (int g = 0; g < G; ++g) a[g] = vfma(vload(qh + g * d + i), kv, a[g]);
      }
      for (int g = 0; g < G; ++g) s[(h * G + g) * len + l] = vsum(a[g]);
    }
  }
  softmax_rows(s, nq, len, softcap, sinks);
  for (int64_t h = 0; h < nh; ++h) {
    for (int64_t i = 0; i < d; i += 2 * kW) {
      VecT a0[G], a1[G];
      for (int g = 0; g < G; ++g) a0[g] = a1[g] = vzero();
      for (int64_t l = 0; l < len; ++l) {
        const T* v = slot_row(vb, tokens, l, len, slot_stride, row_bytes, h == 0 && i == 0) +
                       h * head_stride + i;
        const VecT v0 = vload(v), v1 = vload(v + kW);
        for (int g = 0; g < G; ++g) {
          const VecT p = vset1(s[(h * G + g) * len + l]);
          a0[g] = vfma(p, v0, a0[g]);
          a1[g] = vfma(p, v1, a1[g]);
        }
      }
      for (int g = 0; g < G; ++g) {
        float tmp[2 * kW];
        vstore(tmp, a0[g]);
        vstore(tmp + kW, a1[g]);
        T* orow = o + (h * G + g) * o_head_stride + i;
        for (int64_t c = 0; c < 2 * kW; ++c) orow[c] = from_f<T>(tmp[c]);
      }
    }
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512DQ__)
// bf16 decode on AVX512-BF16 CPUs (Cooper Lake, Sapphire Rapids and later, AMD Zen 4+).
// The grouped task above spends most of its instructions on converting K to fp32 and on
// one horizontal sum per (query row, token); here QK^T runs vdpbf16ps on the raw bf16 q and
// K rows (exact bf16 products, fp32 sums; the scale applied to the sum), the G <= 4 rows of
// a KV head are summed together (hsum4: four vectors to four sums in ~11 instructions), and
// the scores stay in a [token][4] layout that softmax processes 16 lanes (4 tokens x 4 rows)
// at a time. PV keeps G x 4 accumulators (64 dims) in registers per pass, fp32 as before.

// [sum(a), sum(b), sum(c), sum(d)]
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3 (and the same for c, d)
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // per 128-bit lane: the lane's partial sums of a, b, c, d
  const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
  return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}

// exp_f on 16 lanes: the same steps, with fused multiply-adds (results may differ from
// exp_f in the last bit)
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 big = _mm512_set1_ps(12582912.f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), big), big);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// lane j of the result: op over the lanes of v congruent to j mod 4 (the 4 tokens of a
// 16-lane [token][4] block folded onto each row)
inline __m512 fold_max4(__m512 v) {
  v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  return _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
}
inline __m512 fold_add4(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  return _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
}

template <typename I, int G>
void decode_task_bf16dp(const bf16* q, int64_t q_head_stride, const bf16* kb, const bf16* vb,
                        int64_t slot_stride, int64_t head_stride, const I* tokens, int64_t len,
                        int64_t nh, int64_t d, float scale, bf16* o, int64_t o_head_stride,
                        std::vector<float>& buf) {
  static_assert(G >= 1 && G <= 4, "one 4-lane group of query rows per KV head");
  const int64_t len4 = (len + 3) & ~int64_t(3);
  buf.resize(static_cast<size_t>(nh * len4 * 4));
  float* st = buf.data();  // head h, token l, row g: st[(h * len4 + l) * 4 + g]
  const int64_t row_bytes = ((nh - 1) * head_stride + d) * static_cast<int64_t>(sizeof(bf16));
  const __m128 vscale = _mm_set1_ps(scale);
  for (int64_t l = 0; l < len; ++l) {
    const bf16* row = slot_row(kb, tokens, l, len, slot_stride, row_bytes);
    for (int64_t h = 0; h < nh; ++h) {
      const bf16* k = row + h * head_stride;
      const bf16* qh = q + h * G * q_head_stride;
      __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t i = 0; i < d; i += 32) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(k + i);
        for (int g = 0; g < G; ++g)
          a[g] = _mm512_dpbf16_ps(a[g], (__m512bh)_mm512_loadu_si512(qh + g * q_head_stride + i), kv);
      }
      _mm_storeu_ps(st + (h * len4 + l) * 4, _mm_mul_ps(hsum4(a[0], a[1], a[2], a[3]), vscale));
    }
  }
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  for (int64_t h = 0; h < nh; ++h) {
    float* sh = st + h * len4 * 4;
    for (int64_t l = len; l < len4; ++l) _mm_storeu_ps(sh + l * 4, _mm512_castps512_ps128(ninf));
    const int64_t n = len4 * 4;  // a multiple of 16
    __m512 m = ninf;
    for (int64_t i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sh + i));
    m = fold_max4(m);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sh + i), m));
      _mm512_storeu_ps(sh + i, e);
      sum = _mm512_add_ps(sum, e);
    }
    // the padded tokens' exp(-87.3) (~1e-38) never reaches PV and is lost in the sum
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), fold_add4(sum));
    for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(sh + i, _mm512_mul_ps(_mm512_loadu_ps(sh + i), inv));
  }
  for (int64_t h = 0; h < nh; ++h) {
    const float* sh = st + h * len4 * 4;
    for (int64_t i = 0; i < d; i += 64) {
      __m512 acc[G][4];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
      for (int64_t l = 0; l < len; ++l) {
        const bf16* v = slot_row(vb, tokens, l, len, slot_stride, row_bytes, h == 0 && i == 0) +
                       h * head_stride + i;
        const __m512 v0 = load16(v), v1 = load16(v + 16), v2 = load16(v + 32), v3 = load16(v + 48);
        for (int g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(sh[l * 4 + g]);
          acc[g][0] = _mm512_fmadd_ps(p, v0, acc[g][0]);
          acc[g][1] = _mm512_fmadd_ps(p, v1, acc[g][1]);
          acc[g][2] = _mm512_fmadd_ps(p, v2, acc[g][2]);
          acc[g][3] = _mm512_fmadd_ps(p, v3, acc[g][3]);
        }
      }
      for (int g = 0; g < G; ++g) {
        float tmp[64];
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(tmp + 16 * c, acc[g][c]);
        bf16* orow = o + (h * G + g) * o_head_stride + i;
        for (int c = 0; c < 64; ++c) orow[c] = from_f<bf16>(tmp[c]);
      }
    }
  }
}
#define FERRY_BF16DP 1
#else
#define FERRY_BF16DP 0
#endif

template <typename T, typename I>
void decode_impl(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                 at::Tensor& o, const at::Tensor& req_to_token, const at::Tensor& rows,
                 const at::Tensor& seq_lens, double sm_scale, int64_t window, float softcap,
                 const float* sinks) {
  const int64_t bsz = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_buffer.size(1);
  const int64_t group = hq / hkv;
  const T* qp = static_cast<T*>(q.data_ptr());
  const T* kp = static_cast<T*>(k_buffer.data_ptr());
  const T* vp = static_cast<T*>(v_buffer.data_ptr());
  T* op = static_cast<T*>(o.data_ptr());
  const I* r2t = req_to_token.data_ptr<I>();
  const int64_t r2t_stride = req_to_token.stride(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  const int64_t slot_stride = k_buffer.stride(0);  // k and v share the layout (checked)
  const int64_t head_stride = k_buffer.stride(1);
  const float scale = static_cast<float>(sm_scale);
  // Whole requests per task (each slot's K/V row is read once, contiguously) when there are
  // enough requests to keep the threads busy; else one task per (request, KV head).
  const int64_t nh = bsz >= 4 * at::get_num_threads() ? hkv : 1;
  const int64_t per_req = hkv / nh;
  // A sliding window of `window` keys: request b reads its last min(len, window) tokens only.
  auto first = [&](int64_t b) { return window > 0 ? std::max<int64_t>(lp[b] - window, 0) : 0; };
  // the bf16 dot task has its own softmax, without the soft-cap and the sinks
  const bool plain_softmax = softcap <= 0.f && sinks == nullptr;
  (void)plain_softmax;
  // Small steps run on the calling thread: waking the pool (passive OpenMP waiting) costs
  // more than ~4k token-heads of work.
  int64_t work = 0;
  for (int64_t b = 0; b < bsz; ++b) work += (lp[b] - first(b)) * hkv;
  const int64_t grain = work < 4096 ? bsz * per_req : 1;
  // FERRY_CPU_BF16_DOT=0: the grouped fp32 task for bf16 too (for comparisons and tests)
  const char* dp_env = std::getenv("FERRY_CPU_BF16_DOT");
  const bool dp_off = dp_env != nullptr && std::string(dp_env) == "0";
  (void)dp_off;
  at::parallel_for(0, bsz * per_req, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / per_req, h0 = (t % per_req) * nh;
      const T* qb = qp + b * q.stride(0) + h0 * group * q.stride(1);
      T* ob = op + b * o.stride(0) + h0 * group * o.stride(1);
      const int64_t lo = first(b), len = lp[b] - lo;
      const I* tb = r2t + rp[b] * r2t_stride + lo;
      const float* sk = sinks ? sinks + h0 * group : nullptr;
#if FERRY_BF16DP
      if constexpr (std::is_same_v<T, bf16>) {
        if (d % 64 == 0 && group <= 4 && !dp_off && plain_softmax) {
          switch (group) {
#define FERRY_BF16DP_CASE(G)                                                                    \
  case G:                                                                                       \
    decode_task_bf16dp<I, G>(qb, q.stride(1), kp + h0 * head_stride, vp + h0 * head_stride,     \
                             slot_stride, head_stride, tb, len, nh, d, scale, ob,               \
                             o.stride(1), buf);                                                 \
    continue;
            FERRY_BF16DP_CASE(1) FERRY_BF16DP_CASE(2) FERRY_BF16DP_CASE(3) FERRY_BF16DP_CASE(4)
#undef FERRY_BF16DP_CASE
            default: break;
          }
        }
      }
#endif
#if defined(__AVX512F__) || FERRY_AVX2
      if (d % (2 * kW) == 0 && group <= 6) {
        switch (group) {
#define FERRY_GROUPED(G)                                                                       \
  case G:                                                                                      \
    decode_task_grouped<T, I, G>(qb, q.stride(1), kp + h0 * head_stride, vp + h0 * head_stride, \
                                 slot_stride, head_stride, tb, len, nh, d, scale, ob,           \
                                 o.stride(1), buf, softcap, sk);                                \
    continue;
          FERRY_GROUPED(1) FERRY_GROUPED(2) FERRY_GROUPED(3)
          FERRY_GROUPED(4) FERRY_GROUPED(5) FERRY_GROUPED(6)
#undef FERRY_GROUPED
          default: break;
        }
      }
#endif
      decode_task<T, I>(qb, q.stride(1), kp + h0 * head_stride, vp + h0 * head_stride,
                        slot_stride, head_stride, tb, len, nh * group, group, d, scale, ob,
                        o.stride(1), buf, softcap, sk);
    }
  });
}

// Decode attention: q [B, Hq, D] against each request's first seq_lens[b] tokens, whose
// slots are req_to_token[rows[b], :seq_lens[b]]; writes o [B, Hq, D]. Variants (0 / None:
// off): sliding_window W > 0 reads the last W tokens only; logit_softcap > 0 caps the scaled
// scores (cap * tanh(s / cap)); sinks [Hq] float32 logits join the softmax denominator only.
void decode_attention(const at::Tensor& q, const at::Tensor& k_buffer,
                      const at::Tensor& v_buffer, at::Tensor o, const at::Tensor& req_to_token,
                      const at::Tensor& rows, const at::Tensor& seq_lens, double sm_scale,
                      int64_t sliding_window, double logit_softcap,
                      const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && o.sizes() == q.sizes(), "q and o must be [B, Hq, D]");
  TORCH_CHECK(k_buffer.dim() == 3 && v_buffer.sizes() == k_buffer.sizes() &&
                  k_buffer.strides() == v_buffer.strides(),
              "k_buffer and v_buffer must be [slots, Hkv, D] with one layout");
  TORCH_CHECK(q.size(2) == k_buffer.size(2) && q.size(1) % k_buffer.size(1) == 0,
              "head shapes do not match");
  TORCH_CHECK(q.stride(2) == 1 && o.stride(2) == 1 && k_buffer.stride(2) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_buffer.scalar_type() &&
                  q.scalar_type() == v_buffer.scalar_type() &&
                  q.scalar_type() == o.scalar_type(),
              "q, k, v and o must share a dtype");
  TORCH_CHECK(rows.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  rows.is_contiguous() && seq_lens.is_contiguous(),
              "rows and seq_lens must be contiguous int64");
  TORCH_CHECK(req_to_token.stride(1) == 1, "req_to_token rows must be contiguous");
  const bool i32 = req_to_token.scalar_type() == at::kInt;
  TORCH_CHECK(i32 || req_to_token.scalar_type() == at::kLong, "req_to_token must be int32/64");
  TORCH_CHECK(sliding_window >= 0 && logit_softcap >= 0.0,
              "sliding_window and logit_softcap must be >= 0 (0: off)");
  const float* sk = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    sinks->dim() == 1 && sinks->size(0) == q.size(1),
                "sinks must be contiguous float32 [Hq]");
    sk = sinks->data_ptr<float>();
  }
  const float cap = static_cast<float>(logit_softcap);
#define FERRY_DECODE(T, I)                                                                  \
  decode_impl<T, I>(q, k_buffer, v_buffer, o, req_to_token, rows, seq_lens, sm_scale,       \
                    sliding_window, cap, sk)
  if (q.scalar_type() == at::kFloat) {
    if (i32) FERRY_DECODE(float, int32_t);
    else FERRY_DECODE(float, int64_t);
  } else if (q.scalar_type() == at::kBFloat16) {
    if (i32) FERRY_DECODE(bf16, int32_t);
    else FERRY_DECODE(bf16, int64_t);
  } else {
    TORCH_CHECK(false, "decode_attention: float32 or bfloat16 only");
  }
#undef FERRY_DECODE
}

// Grain for at::parallel_for over `rows` rows of `per_row` elements: all rows on the calling
// thread below ~64k elements (a decode step's RMSNorm or rotary: ~5-10 us of work, less than
// waking a sleeping OpenMP thread under the passive wait policy, ~30-60 us), else `grain`.
inline int64_t row_grain(int64_t rows, int64_t per_row, int64_t grain) {
  return rows * per_row < (int64_t{1} << 16) ? std::max<int64_t>(rows, 1) : grain;
}

// RMSNorm, HF LlamaRMSNorm numerics (kernels.reference.rms_norm_ref): with a residual the sum
// x + residual is rounded to the dtype and written to new_residual; the normalised value is
// rounded to the dtype, then multiplied by weight and rounded again.
template <typename T>
void rms_impl(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
              double eps, at::Tensor& out, at::Tensor* new_residual) {
  const int64_t rows = x.size(0), h = x.size(1);
  const T* xp = static_cast<T*>(x.data_ptr());
  const T* rp = residual ? static_cast<T*>(residual->data_ptr()) : nullptr;
  const T* wp = static_cast<T*>(weight.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  T* np = new_residual ? static_cast<T*>(new_residual->data_ptr()) : nullptr;
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0;
  at::parallel_for(0, rows, row_grain(rows, h, 16), [&](int64_t begin, int64_t end) {
    std::vector<float> v(static_cast<size_t>(h));
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * xs;
      float ss = 0.f;
      if (rp) {
        const T* rr = rp + r * rs;
        T* nr = np + r * h;
        for (int64_t i = 0; i < h; ++i) {
          const T sum = from_f<T>(to_f(xr[i]) + to_f(rr[i]));
          nr[i] = sum;
          v[i] = to_f(sum);
        }
      } else {
        for (int64_t i = 0; i < h; ++i) v[i] = to_f(xr[i]);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < h; ++i) ss += v[i] * v[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + static_cast<float>(eps));
      T* orow = op + r * h;
      for (int64_t i = 0; i < h; ++i)
        orow[i] = from_f<T>(to_f(wp[i]) * to_f(from_f<T>(v[i] * inv)));
    }
  });
}

std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                 const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, H] with contiguous rows");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be [H] in x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor nr;
  const at::Tensor* res = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1 &&
                    residual->scalar_type() == x.scalar_type(),
                "residual must match x");
    res = &residual.value();
    nr = at::empty(x.sizes(), x.options());
  }
  if (x.scalar_type() == at::kFloat) rms_impl<float>(x, res, weight, eps, out, res ? &nr : nullptr);
  else if (x.scalar_type() == at::kBFloat16) rms_impl<bf16>(x, res, weight, eps, out, res ? &nr : nullptr);
  else TORCH_CHECK(false, "rms_norm: float32 or bfloat16 only");
  if (res) return {out, nr};
  return {out};
}

// silu(x[:, :I]) * x[:, I:] with the reference's two roundings (silu, then the product).
// One row: o[i] = silu(g[i]) * u[i]. A function of its own (not the parallel_for lambda's
// body) so that GCC vectorizes it: inside the lambda it did not (8 lanes here: ~5x).
template <typename T>
inline void silu_row(const T* __restrict g, const T* __restrict u, T* __restrict o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float gf = to_f(g[i]);
    const float sf = to_f(from_f<T>(gf / (1.f + exp_f(-gf))));
    o[i] = from_f<T>(sf * to_f(u[i]));
  }
}

template <typename T>
void silu_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  const T* xp = static_cast<T*>(x.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  const int64_t xs = x.stride(0);
  // SiLU's exp costs ~4x a copy per element: a quarter of row_grain's limit
  at::parallel_for(0, rows, row_grain(rows, 4 * n, 8), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_row<T>(xp + r * xs, xp + r * xs + n, op + r * n, n);
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "x must be [T, 2*I] with contiguous rows");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kFloat) silu_impl<float>(x, out);
  else if (x.scalar_type() == at::kBFloat16) silu_impl<bf16>(x, out);
  else TORCH_CHECK(false, "silu_and_mul: float32 or bfloat16 only");
  return out;
}

// In-place NeoX rotary of q [T, Hq*D] and k [T, Hkv*D] (rows may be strided views of a fused
// qkv output), fp32 math, one rounding (kernels.reference.rotary_ref).
template <typename T>
void rotary_impl(at::Tensor& q, at::Tensor& k, const at::Tensor& positions,
                 const at::Tensor& cache, int64_t d) {
  const int64_t t = q.size(0), hq = q.size(1) / d, hk = k.size(1) / d, half = d / 2;
  T* qp = static_cast<T*>(q.data_ptr());
  T* kp = static_cast<T*>(k.data_ptr());
  const int64_t qs = q.stride(0), ks = k.stride(0);
  const int64_t* pp = positions.data_ptr<int64_t>();
  const float* cp = cache.data_ptr<float>();
  const int64_t cs = cache.stride(0);
  at::parallel_for(0, t, row_grain(t, (hq + hk) * half, 16), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* cos = cp + pp[r] * cs;
      const float* sin = cos + half;
      for (int64_t h = 0; h < hq + hk; ++h) {
        T* x = h < hq ? qp + r * qs + h * d : kp + r * ks + (h - hq) * d;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
          x[i] = from_f<T>(x1 * cos[i] - x2 * sin[i]);
          x[i + half] = from_f<T>(x2 * cos[i] + x1 * sin[i]);
        }
      }
    }
  });
}

void rotary(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cache,
            int64_t head_dim) {
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2 && q.stride(1) == 1 && k.stride(1) == 1 &&
                  q.size(0) == k.size(0) && q.size(1) % head_dim == 0 &&
                  k.size(1) % head_dim == 0 && head_dim % 2 == 0,
              "q [T, Hq*D] and k [T, Hkv*D] with contiguous rows, D even");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k must share a dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == q.size(0),
              "positions must be [T] contiguous int64");
  TORCH_CHECK(cache.scalar_type() == at::kFloat && cache.dim() == 2 &&
                  cache.stride(1) == 1 && cache.size(1) == head_dim,
              "cos_sin_cache must be [P, D] float32");
  if (q.scalar_type() == at::kFloat) rotary_impl<float>(q, k, positions, cache, head_dim);
  else if (q.scalar_type() == at::kBFloat16) rotary_impl<bf16>(q, k, positions, cache, head_dim);
  else TORCH_CHECK(false, "rotary: float32 or bfloat16 only");
}

}  // namespace

TORCH_LIBRARY(ferry_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor(a!) o, "
        "Tensor req_to_token, Tensor rows, Tensor seq_lens, float sm_scale, "
        "int sliding_window=0, float logit_softcap=0., Tensor? sinks=None) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> Tensor[]");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos_sin_cache, "
        "int head_dim) -> ()");
}

TORCH_LIBRARY_IMPL(ferry_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
}
