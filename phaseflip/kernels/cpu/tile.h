// The register tile both small-matrix kernels compute in: R rows of a (weight rows in wide.h's 5-256 row
// products; queries, then probabilities, in prefill.cpp's prompt-chunk attention) against V vectors of
// columns of b (x's rows transposed; K's positions, then V's columns). Each value of a, broadcast,
// multiplies V vectors of b's row k, so the R x V sums stay in registers over the whole inner dimension
// and no sum is horizontal. Vectors of AVX-512 or AVX2 (simd.h); a CPU with neither has no tiles.
#pragma once
#include <c10/util/BFloat16.h>
#include <cstdint>
#include <cstring>
#include "simd.h"

namespace tile {
#ifdef PF_LANES
// The element kinds of a tile whose a holds W: b in float32, a's values broadcast (bfloat16 widened); or,
// with the CPU's bf16 pair-dot instruction (AVX512_BF16), b as [K/2][columns][2] bfloat16 pairs and a's
// values broadcast two at a time, a pair per lane's dot
template <typename W> struct Ops {
  using B = float;   // b's element
  static constexpr int64_t kstep = 1;   // values of k per step
  static pf::vf load(const B* p) { return pf::load(p); }
  static pf::vf pair(const W* a) { return pf::broadcast(a); }
  static pf::vf last(const W* a) { return pair(a); }
  static pf::vf fma(pf::vf acc, pf::vf b, pf::vf a) { return pf::fma(b, a, acc); }
};
#ifdef PF_BF16_DOT
template <> struct Ops<c10::BFloat16> {
  using B = c10::BFloat16;
  static constexpr int64_t kstep = 2;
  static __m512bh load(const B* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512bh pair(const c10::BFloat16* a) {
    int32_t two;
    std::memcpy(&two, a, 4);
    return (__m512bh)_mm512_set1_epi32(two);
  }
  static __m512bh last(const c10::BFloat16* a) {   // an odd K's last value, paired with zero
    uint16_t one;
    std::memcpy(&one, a, 2);
    return (__m512bh)_mm512_set1_epi32(one);
  }
  static __m512 fma(__m512 acc, __m512bh b, __m512bh a) { return _mm512_dpbf16_ps(acc, b, a); }
};
#endif

// c[r * ldc + j] = sum_k a[r * lda + k] * b[k * ldb + j] for R rows of a and the V * LANES columns j of
// b (bf16 pairs: b's pair k / 2 at b + k * ldb), K values of k. With Fetch, the R rows that follow a's
// (from `ahead` on, contiguous) are fetched meanwhile, a line each time this step's share of them crosses
// one: R rows read side by side are R streams, which the hardware's prefetch follows poorly.
template <typename W, int R, int V, bool Fetch = false>
inline void rows(const W* a, int64_t lda, const typename Ops<W>::B* b, int64_t ldb, int64_t K, float* c,
                 int64_t ldc, const char* ahead = nullptr) {
  using O = Ops<W>;
  pf::vf acc[R][V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v] = pf::zero();
  constexpr int64_t share = R * sizeof(W);   // bytes of the next rows to fetch per k
  auto step = [&](int64_t k, bool tail) {
    if constexpr (Fetch)
      if (((k * share) & 63) < share * O::kstep) _mm_prefetch(ahead + k * share, _MM_HINT_T0);
    decltype(O::load(b)) bv[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) bv[v] = O::load(b + k * ldb + v * pf::LANES * O::kstep);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const auto av = tail ? O::last(a + r * lda + k) : O::pair(a + r * lda + k);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v] = O::fma(acc[r][v], bv[v], av);
    }
  };
  int64_t k = 0;
  for (; k + O::kstep <= K; k += O::kstep) step(k, false);
  if (k < K) step(k, true);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) pf::store(c + r * ldc + v * pf::LANES, acc[r][v]);
}
#endif
}  // namespace tile
