// ferry's CPU kernels for weight-only low-bit linear layers (kernels/quant/reference.py's layouts):
//
//   q4: qweight uint8 [N, K/2] (per 32 weights: byte j = weight j | weight j+16 << 4),
//       scales and mins [N, K/G] fp16 or fp32, weight = scale * q + min;
//   q8: qweight int8 [N, K], scales [N, K/G], weight = scale * q.
//
// wq_linear(x [M, K] fp32/bf16, qweight, scales, mins?) -> [M, N] in x's dtype, for small M
// (decode). With 1-3 activation rows it unpacks 32 weights at a time to fp32 and accumulates
// x * q per group in fp32, then adds scale * dot + min * sum(x over the group) (the min term
// needs only the activations' group sums, computed once per call). With 4 or more rows it
// reads the packed weights once per tile of up to 16 rows: each 32 weights are unpacked and
// dequantized (scale * q + min) to fp32 once and multiplied into every row of the tile.
// AVX2+FMA+F16C where the build has them, scalar loops otherwise. Threads over output rows
// (at::parallel_for, torch's intra-op pool).
//
// wq_dequant(qweight, scales, mins?, dtype) -> [N, K] float32/bfloat16 (prefill: the caller
// multiplies with torch's GEMM). Both are exact in fp32 up to the order of the sums; built
// with ops.cpp by kernels/cpu_ops.py into torch.ops.ferry_cpu.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define WQ_AVX2 1
#include <immintrin.h>
#else
#define WQ_AVX2 0
#endif

namespace {

using bf16 = uint16_t;
using half = c10::Half;

inline float sval(const float* p, int64_t i) { return p[i]; }
inline float sval(const half* p, int64_t i) { return static_cast<float>(p[i]); }

inline void store(float* p, float v) { *p = v; }
inline void store(bf16* p, float x) {  // round to nearest even, NaN kept quiet
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  *p = static_cast<bf16>(x != x ? 0x7fc0u : r);
}

#if WQ_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 weights of one chunk as 4 x 8 floats: w[0] = weights 0-7, w[1] = 16-23, w[2] = 8-15,
// w[3] = 24-31 (the activations are loaded in the same order): each 8 bytes are zero-extended
// to 32 bits once and split into their low and high nibbles there
inline void unpack_q4(const uint8_t* p, __m256 w[4]) {
  const __m256i m4 = _mm256_set1_epi32(0x0F);
  const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i b1 =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, m4));
  w[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
  w[2] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, m4));
  w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
}
constexpr int kQ4Order[4] = {0, 16, 8, 24};
// the most activation rows that share one unpacking of the weights (rows_avx2_multi)
constexpr int kMultiMaxM = 16;
constexpr int kQ8Order[4] = {0, 8, 16, 24};
inline void unpack_q8(const int8_t* p, __m256 w[4]) {
  for (int i = 0; i < 4; ++i)
    w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
}

// one row's ng scales (or mins) as floats in buf (F16C, 8 at a time)
inline const float* row_floats(const float* p, int64_t, float*) { return p; }
inline const float* row_floats(const half* p, int64_t ng, float* buf) {
  int64_t g = 0;
  for (; g + 8 <= ng; g += 8)
    _mm256_storeu_ps(buf + g, _mm256_cvtph_ps(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(p + g))));
  for (; g < ng; ++g) buf[g] = static_cast<float>(p[g]);
  return buf;
}

// Output rows [n0, n1) for activation rows [0, MT): y[m][n] (fp32). NA accumulators per
// activation row (independent FMA chains), summed at the end of each group and scaled; the
// min term is sum_g min_g * xs[m][g], a vector dot at the end of the row.
template <bool Q4, typename S, int MT, int NA>
void rows_avx2(const float* x, int64_t K, const float* xs, const uint8_t* qw, const S* sc,
               const S* mn, int64_t G, int64_t n0, int64_t n1, float* y, int64_t N,
               float* sbuf, float* mbuf) {
  const int64_t ng = K / G, cpg = G / 32;
  const int64_t row_bytes = Q4 ? K / 2 : K;
  const int64_t chunk_bytes = Q4 ? 16 : 32;
  const int* order = Q4 ? kQ4Order : kQ8Order;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = qw + n * row_bytes;
    const float* s = row_floats(sc + n * ng, ng, sbuf);
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
      __m256 ga[MT][NA];
      for (int m = 0; m < MT; ++m)
        for (int a = 0; a < NA; ++a) ga[m][a] = _mm256_setzero_ps();
      for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c) {
        __m256 w[4];
        if constexpr (Q4) unpack_q4(row + c * chunk_bytes, w);
        else unpack_q8(reinterpret_cast<const int8_t*>(row) + c * chunk_bytes, w);
        for (int m = 0; m < MT; ++m) {
          const float* xp = x + m * K + c * 32;
          for (int i = 0; i < 4; ++i)
            ga[m][i % NA] =
                _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xp + order[i]), ga[m][i % NA]);
        }
      }
      const __m256 sg = _mm256_broadcast_ss(s + g);
      for (int m = 0; m < MT; ++m) {
        __m256 t = ga[m][0];
        for (int a = 1; a < NA; ++a) t = _mm256_add_ps(t, ga[m][a]);
        acc[m] = _mm256_fmadd_ps(t, sg, acc[m]);
      }
    }
    if constexpr (Q4) {
      const float* mg = row_floats(mn + n * ng, ng, mbuf);
      int64_t g = 0;
      for (; g + 8 <= ng; g += 8) {
        const __m256 mv = _mm256_loadu_ps(mg + g);
        for (int m = 0; m < MT; ++m)
          acc[m] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + m * ng + g), acc[m]);
      }
      for (int m = 0; m < MT; ++m) {
        float tail = 0.f;
        for (int64_t r = g; r < ng; ++r) tail += mg[r] * xs[m * ng + r];
        y[m * N + n] = hsum(acc[m]) + tail;
      }
    } else {
      for (int m = 0; m < MT; ++m) y[m * N + n] = hsum(acc[m]);
    }
  }
}

// Output rows [n0, n1) for MT (4..16) activation rows at once: each 32-weight chunk is
// unpacked and dequantized (scale * q + min, one FMA) to fp32 once, in registers, and then
// multiplied into all MT rows (one accumulator per row; GCC keeps what fits in the 16 ymm
// registers and spills the rest to L1). The rows_avx2 tiles above re-unpack every chunk for
// each tile of up to 4 rows and fold the scale per (row, group); here that is done once per
// chunk, so at 8-16 rows the work per weight is the row FMAs alone.
template <bool Q4, typename S, int MT>
void rows_avx2_multi(const float* x, int64_t K, const uint8_t* qw, const S* sc, const S* mn,
                     int64_t G, int64_t n0, int64_t n1, float* y, int64_t N, float* sbuf,
                     float* mbuf) {
  const int64_t ng = K / G, cpg = G / 32;
  const int64_t row_bytes = Q4 ? K / 2 : K;
  const int64_t chunk_bytes = Q4 ? 16 : 32;
  const int* order = Q4 ? kQ4Order : kQ8Order;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = qw + n * row_bytes;
    const float* s = row_floats(sc + n * ng, ng, sbuf);
    const float* mg = Q4 ? row_floats(mn + n * ng, ng, mbuf) : nullptr;
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
      const __m256 sg = _mm256_broadcast_ss(s + g);
      const __m256 mv = Q4 ? _mm256_broadcast_ss(mg + g) : _mm256_setzero_ps();
      for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c) {
        __m256 w[4];
        if constexpr (Q4) {
          unpack_q4(row + c * chunk_bytes, w);
          for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(w[i], sg, mv);
        } else {
          unpack_q8(reinterpret_cast<const int8_t*>(row) + c * chunk_bytes, w);
          for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(w[i], sg);
        }
        const float* xc = x + c * 32;
        for (int m = 0; m < MT; ++m) {
          const float* xp = xc + m * K;
          // two short chains per row: the rows give the FMA units their independent work
          const __m256 t0 = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xp + order[0]), acc[m]);
          const __m256 t1 = _mm256_mul_ps(w[1], _mm256_loadu_ps(xp + order[1]));
          const __m256 u0 = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xp + order[2]), t0);
          const __m256 u1 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xp + order[3]), t1);
          acc[m] = _mm256_add_ps(u0, u1);
        }
      }
    }
    for (int m = 0; m < MT; ++m) y[m * N + n] = hsum(acc[m]);
  }
}

//  one tile of mt (4..16) rows: the instance for that many
template <bool Q4, typename S, int MT = 4>
void rows_multi_dispatch(int mt, const float* x, int64_t K, const uint8_t* qw, const S* sc,
                         const S* mn, int64_t G, int64_t n0, int64_t n1, float* y, int64_t N,
                         float* sbuf, float* mbuf) {
  if constexpr (MT <= kMultiMaxM) {
    if (mt == MT)
      rows_avx2_multi<Q4, S, MT>(x, K, qw, sc, mn, G, n0, n1, y, N, sbuf, mbuf);
    else
      rows_multi_dispatch<Q4, S, MT + 1>(mt, x, K, qw, sc, mn, G, n0, n1, y, N, sbuf, mbuf);
  }
}
#endif

// the same computation with scalar loops (no AVX2 in the build)
template <bool Q4, typename S>
void rows_scalar(const float* x, int64_t M, int64_t K, const float* xs, const uint8_t* qw,
                 const S* sc, const S* mn, int64_t G, int64_t n0, int64_t n1, float* y,
                 int64_t N) {
  const int64_t ng = K / G;
  const int64_t row_bytes = Q4 ? K / 2 : K;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = qw + n * row_bytes;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      float acc = 0.f;
      for (int64_t g = 0; g < ng; ++g) {
        float dot = 0.f;
        for (int64_t e = g * G; e < (g + 1) * G; ++e) {
          float q;
          if constexpr (Q4) {
            const int64_t c = e / 32, j = e % 32;
            const uint8_t b = row[c * 16 + (j & 15)];
            q = static_cast<float>(j < 16 ? (b & 0xF) : (b >> 4));
          } else {
            q = static_cast<float>(reinterpret_cast<const int8_t*>(row)[e]);
          }
          dot += q * xr[e];
        }
        acc += sval(sc, n * ng + g) * dot;
        if constexpr (Q4) acc += sval(mn, n * ng + g) * xs[m * ng + g];
      }
      y[m * N + n] = acc;
    }
  }
}

template <bool Q4, typename S>
void linear_impl(const float* x, int64_t M, int64_t K, const uint8_t* qw, const S* sc,
                 const S* mn, int64_t G, int64_t N, float* y) {
  const int64_t ng = K / G;
  std::vector<float> xs(Q4 ? M * ng : 0);
  if constexpr (Q4) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < ng; ++g) {
        float s = 0.f;
        for (int64_t e = g * G; e < (g + 1) * G; ++e) s += x[m * K + e];
        xs[m * ng + g] = s;
      }
  }
  // >= ~32k weights per task: a small layer stays on fewer threads than waking them costs
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / K);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
#if WQ_AVX2
    std::vector<float> buf(2 * ng);
    float *sb = buf.data(), *mb = buf.data() + ng;
    int64_t m = 0;
    // tiles of up to 16 rows, as even as they go (17 rows: 9 + 8); 4 rows or more take the
    // shared-unpacking kernel, 1-3 the per-row-group one (less work per weight at M = 1)
    const int64_t tiles = (M + kMultiMaxM - 1) / kMultiMaxM;
    for (int64_t t = 0; t < tiles && M - m >= 4; ++t) {
      const int64_t mt = (M - m + (tiles - t) - 1) / (tiles - t);
      rows_multi_dispatch<Q4, S>(static_cast<int>(mt), x + m * K, K, qw, sc, mn, G, n0, n1,
                                 y + m * N, N, sb, mb);
      m += mt;
    }
    for (; m + 2 <= M; m += 2)
      rows_avx2<Q4, S, 2, 4>(x + m * K, K, xs.data() + m * ng, qw, sc, mn, G, n0, n1,
                             y + m * N, N, sb, mb);
    for (; m < M; ++m)
      rows_avx2<Q4, S, 1, 4>(x + m * K, K, xs.data() + m * ng, qw, sc, mn, G, n0, n1,
                             y + m * N, N, sb, mb);
#else
    rows_scalar<Q4, S>(x, M, K, xs.data(), qw, sc, mn, G, n0, n1, y, N);
#endif
  });
}

struct Layout {
  bool q4;
  int64_t n, k, g;
};

Layout check_layout(const at::Tensor& qweight, const at::Tensor& scales,
                    const c10::optional<at::Tensor>& mins) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "qweight must be 2-D contiguous");
  const bool q4 = qweight.scalar_type() == at::kByte;
  TORCH_CHECK(q4 || qweight.scalar_type() == at::kChar, "qweight: uint8 (q4) or int8 (q8)");
  const int64_t n = qweight.size(0), k = q4 ? 2 * qweight.size(1) : qweight.size(1);
  TORCH_CHECK(scales.dim() == 2 && scales.is_contiguous() && scales.size(0) == n &&
                  scales.size(1) > 0 && k % scales.size(1) == 0,
              "scales must be [N, K / G] contiguous");
  const int64_t g = k / scales.size(1);
  TORCH_CHECK(g % 32 == 0, "the group size must be a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat,
              "scales: float16 or float32");
  if (q4) {
    TORCH_CHECK(mins.has_value() && mins->sizes() == scales.sizes() && mins->is_contiguous() &&
                    mins->scalar_type() == scales.scalar_type(),
                "q4 needs mins shaped and typed like scales");
  }
  return {q4, n, k, g};
}

template <typename F>
void dispatch(const Layout& l, const at::Tensor& scales, F&& f) {
  if (scales.scalar_type() == at::kHalf) {
    if (l.q4) f(std::true_type{}, static_cast<const half*>(nullptr));
    else f(std::false_type{}, static_cast<const half*>(nullptr));
  } else {
    if (l.q4) f(std::true_type{}, static_cast<const float*>(nullptr));
    else f(std::false_type{}, static_cast<const float*>(nullptr));
  }
}

at::Tensor wq_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& mins) {
  const Layout l = check_layout(qweight, scales, mins);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == l.k, "x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x: float32 or bfloat16");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, l.n}, x.options().dtype(at::kFloat));
  dispatch(l, scales, [&](auto q4, auto stag) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(stag)>>;
    const S* mp = q4 ? static_cast<const S*>(mins->data_ptr()) : nullptr;
    linear_impl<decltype(q4)::value, S>(xf.data_ptr<float>(), M, l.k,
                                        static_cast<const uint8_t*>(qweight.data_ptr()),
                                        static_cast<const S*>(scales.data_ptr()), mp, l.g, l.n,
                                        y.data_ptr<float>());
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

template <bool Q4, typename S, typename T>
void dequant_impl(const uint8_t* qw, const S* sc, const S* mn, int64_t N, int64_t K, int64_t G,
                  T* out) {
  const int64_t ng = K / G, row_bytes = Q4 ? K / 2 : K;
  at::parallel_for(0, N, std::max<int64_t>(1, (int64_t{1} << 16) / K), [&](int64_t n0,
                                                                           int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = qw + n * row_bytes;
      T* o = out + n * K;
      for (int64_t g = 0; g < ng; ++g) {
        const float s = sval(sc, n * ng + g), mg = Q4 ? sval(mn, n * ng + g) : 0.f;
        for (int64_t c = g * G / 32; c < (g + 1) * G / 32; ++c) {
          if constexpr (Q4) {
            for (int j = 0; j < 16; ++j) {
              const uint8_t b = row[c * 16 + j];
              store(o + c * 32 + j, s * static_cast<float>(b & 0xF) + mg);
              store(o + c * 32 + 16 + j, s * static_cast<float>(b >> 4) + mg);
            }
          } else {
            const int8_t* q = reinterpret_cast<const int8_t*>(row) + c * 32;
            for (int j = 0; j < 32; ++j) store(o + c * 32 + j, s * static_cast<float>(q[j]));
          }
        }
      }
    }
  });
}

at::Tensor wq_dequant(const at::Tensor& qweight, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& mins, at::ScalarType dtype) {
  const Layout l = check_layout(qweight, scales, mins);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype: float32 or bfloat16");
  at::Tensor out = at::empty({l.n, l.k}, qweight.options().dtype(dtype));
  dispatch(l, scales, [&](auto q4, auto stag) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(stag)>>;
    constexpr bool Q4 = decltype(q4)::value;
    const S* mp = Q4 ? static_cast<const S*>(mins->data_ptr()) : nullptr;
    const auto* qp = static_cast<const uint8_t*>(qweight.data_ptr());
    const auto* sp = static_cast<const S*>(scales.data_ptr());
    if (dtype == at::kFloat)
      dequant_impl<Q4, S, float>(qp, sp, mp, l.n, l.k, l.g, out.data_ptr<float>());
    else
      dequant_impl<Q4, S, bf16>(qp, sp, mp, l.n, l.k, l.g,
                                static_cast<bf16*>(out.data_ptr()));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ferry_cpu, m) {
  m.def("wq_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins) -> Tensor");
  m.def("wq_dequant(Tensor qweight, Tensor scales, Tensor? mins, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(ferry_cpu, CPU, m) {
  m.impl("wq_linear", &wq_linear);
  m.impl("wq_dequant", &wq_dequant);
}
