// Products of 5 .. MAX_ROWS rows for gemv.cpp ("wide"; its only includer): x's rows packed into
// panels, transposed (`pack`), each weight value broadcast against a vector of x's rows (`wide_rows`),
// NR weight rows' sums for a panel's rows in registers. `wide::dispatch` picks the panel width from the
// row count; the caller gives it at most MAX_ROWS rows and y to write. Vectors of AVX-512 or AVX2
// (simd.h), plain loops on a CPU with neither.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>
#include "simd.h"

namespace wide {

#ifdef PF_LANES
// x transposed into xt, [K][Mp] float32 (or [K/2][Mp][2] bf16 pairs for the bf16 dot instruction), Mp =
// M padded to whole vectors (LANES rows) with zeros: one weight value (pair), broadcast, times one vector
// of xt is LANES rows' terms, so NR weight rows' sums for every row of x stay in registers and no sum is
// horizontal. Dotting each weight row with each row of x (the one-pass form extended) ran no faster
// than oneDNN: a load of x per product and a horizontal sum per output.
// Weight rows at once for MB vectors of x rows: at least 8 independent sums (an FMA's latency over its
// issue rate) where the registers allow, at most 16 of AVX-512's 32 registers, 12 of AVX2's 16
constexpr int wide_nr(int mb) {
  if (pf::LANES == 16) return mb == 1 ? 8 : mb == 2 ? 6 : 4;
  return mb == 1 ? 8 : std::max(1, 12 / mb);
}

template <typename W> struct Wide {   // xt in float32, a weight value broadcast
  using T = float;   // xt's element
  static constexpr int64_t kstep = 1;
  static pf::vf load(const T* p) { return pf::load(p); }
  static pf::vf pair(const W* w) { return pf::broadcast(w); }
  static pf::vf last(const W* w) { return pair(w); }
  static pf::vf fma(pf::vf acc, pf::vf x, pf::vf w) { return pf::fma(x, w, acc); }
};
#ifdef PF_BF16_DOT
template <> struct Wide<c10::BFloat16> {
  using T = c10::BFloat16;
  static constexpr int64_t kstep = 2;
  static __m512bh load(const T* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512bh pair(const c10::BFloat16* w) {
    int32_t two;
    std::memcpy(&two, w, 4);
    return (__m512bh)_mm512_set1_epi32(two);
  }
  static __m512bh last(const c10::BFloat16* w) {   // an odd K's last value, paired with zero
    uint16_t one;
    std::memcpy(&one, w, 2);
    return (__m512bh)_mm512_set1_epi32(one);
  }
  static __m512 fma(__m512 acc, __m512bh x, __m512bh w) { return _mm512_dpbf16_ps(acc, x, w); }
};
#endif

// out[r * Mp + m] = sum_k w_r[k] * x[m][k] for NR weight rows (ldw apart), every padded row m.
// Meanwhile the next NR rows (from `ahead` on) are fetched, a line each time this step's share of
// them crosses one: NR rows read side by side are NR streams, which the hardware's prefetch follows
// poorly (without this, eight rows side by side read at under half a one-row product's speed).
template <typename W, int MB, int NR>
inline void wide_rows(const W* w, int64_t ldw, const typename Wide<W>::T* xt, int64_t K, float* out,
                      const char* ahead) {
  using B = Wide<W>;
  constexpr int64_t Mp = MB * pf::LANES;
  pf::vf acc[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < MB; ++b) acc[r][b] = pf::zero();
  constexpr int64_t share = NR * sizeof(W);   // bytes of the next rows to fetch per k
  auto step = [&](int64_t k, bool tail) {
    if (((k * share) & 63) < share * B::kstep) _mm_prefetch(ahead + k * share, _MM_HINT_T0);
    decltype(B::load(xt)) xv[MB];
    for (int b = 0; b < MB; ++b) xv[b] = B::load(xt + k * Mp + b * pf::LANES * B::kstep);
    for (int r = 0; r < NR; ++r) {
      const auto wv = tail ? B::last(w + r * ldw + k) : B::pair(w + r * ldw + k);
      for (int b = 0; b < MB; ++b) acc[r][b] = B::fma(acc[r][b], xv[b], wv);
    }
  };
  int64_t k = 0;
  for (; k + B::kstep <= K; k += B::kstep) step(k, false);
  if (k < K) step(k, true);
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < MB; ++b) pf::store(out + r * Mp + b * pf::LANES, acc[r][b]);
}

// 8 rows (s0 apart) x 8 columns of x as float32, transposed: dst[k * ld + 0..7] = column k's 8 values
template <typename W>
inline void transpose8(const W* x, int64_t s0, float* dst, int64_t ld) {
  __m256 r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = pf::load8(x + i * s0);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);       // r_i[0] r_i+1[0] r_i[1] r_i+1[1] | [4] [5]
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);   // [2] [3] | [6] [7]
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));       // 4 rows' [0] | [4]
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));   // [1] | [5]
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));   // [2] | [6]
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));   // [3] | [7]
  }
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(dst + j * ld, _mm256_permute2f128_ps(u[j], u[j + 4], 0x20));
    _mm256_storeu_ps(dst + (j + 4) * ld, _mm256_permute2f128_ps(u[j], u[j + 4], 0x31));
  }
}

// Rows m_from .. M - 1 of x [M, K] (strides s0, s1) into the panels `run` reads: 8 x 8 blocks
// transposed in registers where the values become float32 lanes and x's rows are contiguous, the rest
// one value at a time. Packing one value at a time throughout, on one thread, into a fresh zeroed buffer
// per call is a visible share of each layer's products at 128 rows; the blocks in registers, the panels
// packed over torch's threads and the thread's kept buffer (`run`) make it a small one.
template <typename W, typename T, int64_t Mp, int64_t ks>
void pack(const W* xp, int64_t s0, int64_t s1, int64_t m_from, int64_t M, int64_t K, int64_t Kp, T* tp) {
  int64_t m8 = m_from, k8 = 0;
  if constexpr (ks == 1 && std::is_same<T, float>::value)
    if (s1 == 1) {
      m8 = m_from + (M - m_from) / 8 * 8, k8 = K / 8 * 8;
      for (int64_t m0 = m_from; m0 < m8; m0 += 8)
        for (int64_t k0 = 0; k0 < k8; k0 += 8)
          transpose8(xp + m0 * s0 + k0, s0, tp + m0 / Mp * Kp * Mp + k0 * Mp + m0 % Mp, Mp);
    }
  const auto put = [&](int64_t m, int64_t k) {
    tp[m / Mp * Kp * Mp + (k / ks * Mp + m % Mp) * ks + k % ks] = static_cast<T>(xp[m * s0 + k * s1]);
  };
  for (int64_t m = m_from; m < m8; ++m)
    for (int64_t k = k8; k < K; ++k) put(m, k);
  for (int64_t m = m8; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) put(m, k);
}

// x's rows transposed in panels of up to panel_mb vectors of rows: [panel][K][Mp] (bf16 pairs:
// [K/2][Mp][2]), zero beyond the last row; each group of weight rows is multiplied with every panel in
// turn while it sits in L1/L2. AVX2: panels of 16 rows, 6 weight rows at once (2 loads of x and 6
// broadcasts per 12 FMAs); one panel of 32 rows would leave room for 3 weight rows (4 loads of x per 12
// FMAs, 73 KiB of x per sweep of K=576), of 64 rows for 1, and both run markedly slower than 16-row
// panels, in float32 and in bf16 (its broadcast a 16-bit one and a mask, pf::broadcast). AVX-512:
// float32 panels of 32 rows (72 KiB of x per sweep of K=576; AVX2's 16 are 36 KiB), not 64 (147 KiB, 4
// loads of x from L2 per 16 FMAs): from 64 rows up they run near the cores' peak, where 64-row panels
// fall well short (8-32 rows alike either way); bf16 pairs keep 64-row panels (the
// same 72 KiB), a little faster than 32-row ones.
template <typename W>
constexpr int panel_mb() { return pf::LANES == 16 && sizeof(typename Wide<W>::T) == 2 ? 4 : 2; }

template <typename W, int MB>
void run(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  using T = typename Wide<W>::T;
  constexpr int64_t Mp = MB * pf::LANES, ks = Wide<W>::kstep;
  const int64_t N = w.size(0), K = w.size(1), ldw = w.stride(0), M = x.size(0);
  const int64_t panels = (M + Mp - 1) / Mp, Kp = (K + ks - 1) / ks * ks;
  // the calling thread's buffer, kept between calls (a fresh one would cost an allocation and its zeroing
  // per product; it holds up to MAX_ROWS x the widest K), zeroed where no value lands: the last panel
  // (its padding rows) and an odd K's last pair
  thread_local std::vector<T> xt;
  if (xt.size() < size_t(panels * Kp * Mp)) xt.resize(panels * Kp * Mp);
  T* tp = xt.data();
  std::fill(tp + (panels - 1) * Kp * Mp, tp + panels * Kp * Mp, T(0));
  if (Kp != K)
    for (int64_t p = 0; p + 1 < panels; ++p) std::fill(tp + (p * Kp + K - 1) * Mp, tp + (p + 1) * Kp * Mp, T(0));
  const W* xp = x.data_ptr<W>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    pack<W, T, Mp, ks>(xp, s0, s1, p0 * Mp, std::min(M, p1 * Mp), K, Kp, tp);
  });
  const W* wp = w.data_ptr<W>();
  W* yp = y.data_ptr<W>();
  constexpr int NR = wide_nr(MB);
  at::parallel_for(0, (N + NR - 1) / NR, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float part[NR * Mp];
    for (int64_t n = b0 * NR; n < std::min(N, b1 * NR); n += NR) {
      const int64_t rows = std::min<int64_t>(NR, N - n);
      const char* ahead = reinterpret_cast<const char*>(wp + (n + NR) * ldw);   // never dereferenced
      for (int64_t p = 0; p < panels; ++p) {
        const T* panel = tp + p * Kp * Mp;
        if (rows == NR) wide_rows<W, MB, NR>(wp + n * ldw, ldw, panel, K, part, ahead);
        else
          for (int64_t r = 0; r < rows; ++r)
            wide_rows<W, MB, 1>(wp + (n + r) * ldw, ldw, panel, K, part + r * Mp, ahead);
        // a row of y at a time: N floats apart, y's rows share L1 sets when N * 4 is a multiple of 4
        // KiB (gate/up's 3072), and 16 rows written a column at a time miss L1 at every store
        const int64_t m1 = std::min(M, (p + 1) * Mp);
        if (rows == NR)
          for (int64_t m = p * Mp; m < m1; ++m) {
#pragma GCC unroll 8
            for (int r = 0; r < NR; ++r) yp[m * N + n + r] = static_cast<W>(part[r * Mp + m - p * Mp]);
          }
        else
          for (int64_t m = p * Mp; m < m1; ++m)
            for (int64_t r = 0; r < rows; ++r) yp[m * N + n + r] = static_cast<W>(part[r * Mp + m - p * Mp]);
      }
    }
  });
}

// MB: the vectors of LANES rows in one panel of x's rows (1 .. panel_mb); more rows take more panels
template <typename W, int MB = 1>
void dispatch(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  if constexpr (MB < panel_mb<W>())
    if (x.size(0) > MB * pf::LANES) return dispatch<W, MB + 1>(x, w, y);
  run<W, MB>(x, w, y);
}
#else
template <typename W>
void dispatch(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {   // plain loops
  const at::Tensor xl = x.to(at::kFloat).contiguous();
  const int64_t N = w.size(0), K = w.size(1), ldw = w.stride(0), M = x.size(0);
  const float* xp = xl.data_ptr<float>();
  const W* wp = w.data_ptr<W>();
  W* yp = y.data_ptr<W>();
  at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) {
        float s = 0.f;
        for (int64_t k = 0; k < K; ++k) s += static_cast<float>(wp[n * ldw + k]) * xp[m * K + k];
        yp[m * N + n] = static_cast<W>(s);
      }
  });
}
#endif

}  // namespace wide
