// Products of 5 .. MAX_ROWS rows for gemv.cpp ("wide"; quant.cpp packs x the same way): x's rows packed into
// panels, transposed (`pack`), NR weight rows at a time multiplied with each panel in a register tile
// (tile.h: each weight value broadcast against vectors of x's rows, no horizontal sums). `wide::dispatch`
// picks the panel width from the row count; the caller gives it at most MAX_ROWS rows and y to write.
// Vectors of AVX-512 or AVX2 (simd.h), plain loops on a CPU with neither.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <type_traits>
#include <vector>
#include "parallel.h"
#include "simd.h"
#include "tile.h"

namespace wide {

#ifdef PF_LANES
// x transposed into xt, [K][Mp] float32 (or [K/2][Mp][2] bf16 pairs for the bf16 dot instruction), Mp =
// M padded to whole vectors (LANES rows) with zeros: the tile's b. Dotting each weight row with each row
// of x instead (the one-pass form extended) is no faster than oneDNN: a load of x per product and a
// horizontal sum per output.
// Weight rows at once for MB vectors of x rows: at least 8 independent sums (an FMA's latency over its
// issue rate) where the registers allow, at most 16 of AVX-512's 32 registers, 12 of AVX2's 16
constexpr int wide_nr(int mb) {
  if (pf::LANES == 16) return mb == 1 ? 8 : mb == 2 ? 6 : 4;
  return mb == 1 ? 8 : std::max(1, 12 / mb);
}

// 8 rows (s0 apart) x 8 columns of x as float32, transposed: dst[k * ld + 0..7] = column k's 8 values
template <typename W>
inline void transpose8(const W* x, int64_t s0, float* dst, int64_t ld) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = pf::load8(x + i * s0);
  pf::transpose8x8(r);
  for (int k = 0; k < 8; ++k) _mm256_storeu_ps(dst + k * ld, r[k]);
}

// Rows m_from .. M - 1 of x [M, K] (strides s0, s1) into the panels `run` reads: 8 x 8 blocks
// transposed in registers where the values become float32 lanes and x's rows are contiguous (one value
// at a time throughout would be a visible share of a 128-row product), the rest one value at a time
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
// broadcasts per 12 FMAs); a panel of 32 rows would leave room for 3 weight rows (4 loads of x per 12
// FMAs, 73 KiB of x per sweep of K=576), of 64 rows for 1, both slower than 16-row panels, in float32
// and in bf16 (its broadcast a 16-bit one and a mask, pf::broadcast). AVX-512: float32 panels of 32
// rows (72 KiB of x per sweep of K=576; AVX2's 16 are 36 KiB), not 64 (147 KiB, 4 loads of x from L2
// per 16 FMAs), which fall short of the cores' peak from 64 rows up; bf16 pairs keep 64-row panels (the
// same 72 KiB), a little faster than 32-row ones.
template <typename W>
constexpr int panel_mb() { return pf::LANES == 16 && sizeof(typename tile::Ops<W>::B) == 2 ? 4 : 2; }

// x's rows packed into the calling thread's panel buffer, kept between calls (a fresh one would cost an
// allocation and its zeroing per product; it holds up to MAX_ROWS x the widest K), zeroed where no value
// lands: the last panel (its padding rows) and an odd K's last pair. The panels are packed over torch's
// threads.
template <typename W, int64_t Mp>
const typename tile::Ops<W>::B* packed(const at::Tensor& x, int64_t Kp) {
  using T = typename tile::Ops<W>::B;
  constexpr int64_t ks = tile::Ops<W>::kstep;
  const int64_t M = x.size(0), K = x.size(1), panels = (M + Mp - 1) / Mp;
  thread_local std::vector<T> xt;
  if (xt.size() < size_t(panels * Kp * Mp)) xt.resize(panels * Kp * Mp);
  T* tp = xt.data();
  std::fill(tp + (panels - 1) * Kp * Mp, tp + panels * Kp * Mp, T(0));
  if (Kp != K)
    for (int64_t p = 0; p + 1 < panels; ++p) std::fill(tp + (p * Kp + K - 1) * Mp, tp + (p + 1) * Kp * Mp, T(0));
  const W* xp = x.data_ptr<W>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  par::ranges(panels, 1, [&](int64_t p0, int64_t p1) {
    pack<W, T, Mp, ks>(xp, s0, s1, p0 * Mp, std::min(M, p1 * Mp), K, Kp, tp);
  });
  return tp;
}

// y's rows m0 .. m1 - 1 (N apart) at columns n .. n + rows - 1 from a tile's part [rows][Mp] (its row
// m0 first), a row of y at a time: y's rows share L1 sets when N * 4 is a multiple of 4 KiB (gate/up's
// 3072), and rows written a column at a time miss L1 at every store
template <typename W, int NR, int64_t Mp>
inline void put_rows(const float* part, int64_t rows, W* y, int64_t N, int64_t n, int64_t m0, int64_t m1) {
  if (rows == NR)
    for (int64_t m = m0; m < m1; ++m) {
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) y[m * N + n + r] = static_cast<W>(part[r * Mp + m - m0]);
    }
  else
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t r = 0; r < rows; ++r) y[m * N + n + r] = static_cast<W>(part[r * Mp + m - m0]);
}

template <typename W, int MB>
void run(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  using T = typename tile::Ops<W>::B;
  constexpr int64_t Mp = MB * pf::LANES, ks = tile::Ops<W>::kstep;
  constexpr int NR = wide_nr(MB);
  const int64_t N = w.size(0), K = w.size(1), ldw = w.stride(0), M = x.size(0);
  const int64_t panels = (M + Mp - 1) / Mp, Kp = (K + ks - 1) / ks * ks;
  const T* tp = packed<W, Mp>(x, Kp);
  const W* wp = w.data_ptr<W>();
  W* yp = y.data_ptr<W>();
  par::ranges((N + NR - 1) / NR, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float part[NR * Mp];
    for (int64_t n = b0 * NR; n < std::min(N, b1 * NR); n += NR) {
      const int64_t rows = std::min<int64_t>(NR, N - n);
      const char* ahead = reinterpret_cast<const char*>(wp + (n + NR) * ldw);   // never dereferenced
      for (int64_t p = 0; p < panels; ++p) {
        const T* panel = tp + p * Kp * Mp;
        if (rows == NR) tile::rows<W, NR, MB, true>(wp + n * ldw, ldw, panel, Mp, K, part, Mp, ahead);
        else
          for (int64_t r = 0; r < rows; ++r)
            tile::rows<W, 1, MB, true>(wp + (n + r) * ldw, ldw, panel, Mp, K, part + r * Mp, Mp, ahead);
        put_rows<W, NR, Mp>(part, rows, yp, N, n, p * Mp, std::min(M, (p + 1) * Mp));
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
  par::ranges(N, 1, [&](int64_t n0, int64_t n1) {
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
