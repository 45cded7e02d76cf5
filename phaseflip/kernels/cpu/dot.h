// The dot product of weight rows with up to a few rows of x, and a range of weight rows so dotted
// (`gemv_range`, `gemv_rows`): what the few-rows product (gemv.cpp) and the fused decode layers
// (layer.cpp) stream the weights through, and x's rows as they read them (`dense_rows`). float32 or
// bfloat16 weights; x float32, or bfloat16 where the CPU's bf16 pair-dot instruction serves
// (Lanes<W>::X); sums in float32.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <cstdint>
#include <type_traits>
#include <vector>
#include "simd.h"

namespace dot {
#ifdef PF_LANES
// One lane step of a dot product: LANES float32 products (bfloat16 weights widened), or, with the CPU's
// bf16 dot instruction (AVX512_BF16), 32 bfloat16 pairs multiplied and summed by it; `fma_n` for the
// last n < step values of a row.
template <typename W> struct Lanes {
  using X = float;  // what x is held as
  static constexpr int64_t step = pf::LANES;
  static pf::vf fma(pf::vf acc, const W* w, const float* x) { return pf::fma(pf::load(w), pf::load(x), acc); }
  static pf::vf fma_n(pf::vf acc, const W* w, const float* x, int64_t n) {
    return pf::fma(pf::load_n(w, n), pf::load_n(x, n), acc);
  }
};
#ifdef PF_BF16_DOT
template <> struct Lanes<c10::BFloat16> {
  using X = c10::BFloat16;
  static constexpr int64_t step = 32;
  static __m512 fma_n(__m512 acc, const X* w, const X* x, int64_t n) {
    const __mmask32 m = n >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1ull << n) - 1);
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(m, w), (__m512bh)_mm512_maskz_loadu_epi16(m, x));
  }
  static __m512 fma(__m512 acc, const X* w, const X* x) { return fma_n(acc, w, x, step); }
};
#endif

// Independent sums per row of x: 2 with AVX-512's 32 registers; with AVX2's 16 registers of 8 lanes, 4
// for up to 2 rows (an FMA's latency over its issue rate wants 8 in flight), 2 up to 4 rows, else 1 (no
// spill)
constexpr int dot_unroll(int m) { return pf::LANES == 16 ? 2 : m <= 2 ? 4 : m <= 4 ? 2 : 1; }

// out[r * M + m] = weight row r (of R, `ld` apart) . x's row m, for M rows of x: each weight row read front
// to back, U independent accumulators per (weight row, row of x), each stream prefetched ahead
// (pf::prefetch_ahead). Neighbouring rows read side by side are slower (streams of one row each, too short
// for the prefetchers): R rows are one of each of R parts (gemv_range). One row alone wants dot_unroll(M)
// accumulators (one chain of dependent FMAs is slower, four no faster with AVX-512); R rows give R chains.
// The unroll pragmas keep acc in registers: without them GCC keeps it on the stack, a store and a reload
// around every FMA
template <typename W, int M, int R, int U>
inline void rows_dot(const W* w, int64_t ld, const typename Lanes<W>::X* x, int64_t K, float* out) {
  using L = Lanes<W>;
  pf::vf acc[R][M][U];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) acc[r][m][u] = pf::zero();
  int64_t k = 0;
  for (; k + U * L::step <= K; k += U * L::step) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) pf::prefetch_ahead<U * L::step * sizeof(W)>(w + r * ld + k);
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m)
          acc[r][m][u] = L::fma(acc[r][m][u], w + r * ld + k + u * L::step, x + m * K + k + u * L::step);
  }
  for (; k + L::step <= K; k += L::step)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[r][m][0] = L::fma(acc[r][m][0], w + r * ld + k, x + m * K + k);
  if (k < K)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[r][m][0] = L::fma_n(acc[r][m][0], w + r * ld + k, x + m * K + k, K - k);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
#pragma GCC unroll 8
      for (int u = 1; u < U; ++u) acc[r][m][0] = pf::add(acc[r][m][0], acc[r][m][u]);
      out[r * M + m] = pf::sum(acc[r][m][0]);
    }
}

// out[m] = sum_k w[k] * x[m][k]: one weight row (rows_dot's, alone)
template <typename W, int M>
inline void row_dot(const W* w, const typename Lanes<W>::X* x, int64_t K, float* out) {
  rows_dot<W, M, 1, dot_unroll(M)>(w, 0, x, K, out);
}
#else
template <typename W> struct Lanes { using X = float; };

template <typename W, int M>
inline void row_dot(const W* w, const float* x, int64_t K, float* out) {
  for (int m = 0; m < M; ++m) {
    float s = 0.f;
    for (int64_t k = 0; k < K; ++k) s += static_cast<float>(w[k]) * x[m * K + k];
    out[m] = s;
  }
}
#endif

// x's rows (of dtype W, any strides) as the dot reads them, X values K apart: x itself where it already is,
// else widened into buf by this thread (Tensor::to's copy would take a dispatch and a parallel region for
// a few KiB, once per product of a step)
template <typename X, typename W>
const X* dense_rows(const at::Tensor& x, std::vector<X>& buf) {
  const int64_t M = x.size(0), K = x.size(1), s0 = x.stride(0), s1 = x.stride(1);
  const W* p = x.data_ptr<W>();
  if constexpr (std::is_same<X, W>::value)
    if (s1 == 1 && (s0 == K || M == 1)) return p;
  buf.resize(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) buf[m * K + k] = static_cast<X>(p[m * s0 + k * s1]);
  return buf.data();
}

#ifdef PF_LANES
// Weight rows read in step by gemv_range at M rows of x: 4, or fewer where the R * M accumulators would
// not fit the registers (16 with AVX-512's 32, 8 with AVX2's 16)
constexpr int dot_parts(int m) {
  const int fit = (pf::LANES == 16 ? 16 : 8) / m;
  return fit < 1 ? 1 : fit > 4 ? 4 : fit;
}
#endif

// y[m * N + n] = weight row n . x's row m for n in [n0, n1) and M rows of x: the range cut in
// dot_parts(M) parts read in step (row i of each part at once, each part one stream forward through
// memory; one row at a time leaves the memory idle while a row's sums finish), the tail row by row
template <typename W, int M>
void gemv_range(const W* w, int64_t ldw, const typename Lanes<W>::X* x, int64_t K, W* y, int64_t N, int64_t n0,
                int64_t n1) {
  float part[M];
  int64_t n = n0;
#ifdef PF_LANES
  constexpr int R = dot_parts(M);
  if constexpr (R > 1) {
    const int64_t len = (n1 - n0) / R;
    float out[R * M];
    for (int64_t i = 0; i < len; ++i) {
      rows_dot<W, M, R, 1>(w + (n0 + i) * ldw, len * ldw, x, K, out);
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) y[m * N + n0 + i + r * len] = static_cast<W>(out[r * M + m]);
    }
    n = n0 + R * len;
  }
#endif
  for (; n < n1; ++n) {
    row_dot<W, M>(w + n * ldw, x, K, part);
    for (int m = 0; m < M; ++m) y[m * N + n] = static_cast<W>(part[m]);
  }
}

// gemv_range for M rows of x, M at run time (1 .. MAX_ROWS)
constexpr int MAX_ROWS = 8;
template <typename W>
void gemv_rows(int M, const W* w, int64_t ldw, const typename Lanes<W>::X* x, int64_t K, W* y, int64_t N,
               int64_t n0, int64_t n1) {
  static_assert(MAX_ROWS == 8, "one case per row count up to MAX_ROWS");
  switch (M) {
    case 1: return gemv_range<W, 1>(w, ldw, x, K, y, N, n0, n1);
    case 2: return gemv_range<W, 2>(w, ldw, x, K, y, N, n0, n1);
    case 3: return gemv_range<W, 3>(w, ldw, x, K, y, N, n0, n1);
    case 4: return gemv_range<W, 4>(w, ldw, x, K, y, N, n0, n1);
    case 5: return gemv_range<W, 5>(w, ldw, x, K, y, N, n0, n1);
    case 6: return gemv_range<W, 6>(w, ldw, x, K, y, N, n0, n1);
    case 7: return gemv_range<W, 7>(w, ldw, x, K, y, N, n0, n1);
    default: return gemv_range<W, 8>(w, ldw, x, K, y, N, n0, n1);
  }
}

}  // namespace dot
