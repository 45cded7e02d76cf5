// Few-row products x @ W^T on the CPU (decode steps, short prompt chunks): W [N, K] read once, in
// place, as the arena holds it (row-major, rows a stride apart); x [M, K], MAX_ROWS rows a pass; float32
// sums. Up to ONE_PASS rows, each weight row is dotted with every row of x; beyond, x is transposed and
// each weight value, broadcast, multiplies a vector of rows of x at once (cpu_wide.h).
// float32 or bfloat16 weights (x of the same dtype; the output is x's dtype). bfloat16 pairs go
// through the CPU's bf16 dot instruction (AVX512_BF16: products exact, sums in float32) where it has
// one, else are widened to float32. Vectors of AVX-512 or AVX2 (cpu_simd.h), plain loops on a CPU with
// neither. Built at run time by phaseflip/kernels/cpu_kernels.py for the machine it runs on
// (-march=native); rows are split over torch's own threads (at::parallel_for).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <algorithm>
#include <type_traits>
#include <vector>
#include "cpu_simd.h"
#include "cpu_wide.h"

namespace {

constexpr int64_t MAX_ROWS = 256;   // rows of x a pass: more are taken MAX_ROWS at a time
constexpr int64_t ONE_PASS = 4;

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
// for up to 2 rows (an FMA's latency over its issue rate wants 8 in flight), else 2 (no spill)
constexpr int dot_unroll(int m) { return pf::LANES == 16 || m > 2 ? 2 : 4; }

// out[m] = sum_k w[k] * x[m][k]: one weight row read front to back (a single memory stream: 2, 4 or 8
// rows read side by side measured 1.2-1.6x slower, software prefetch no faster), dot_unroll(M)
// independent accumulators per row of x (one chain of dependent FMAs measured slower, four no faster
// with AVX-512). Those comparisons predate the unroll pragmas: without them GCC kept acc[][] on the
// stack, a store and a reload around every FMA (bf16 rows in cache at 41-46 GB/s, 78-111 with them)
template <typename W, int M>
inline void row_dot(const W* w, const typename Lanes<W>::X* x, int64_t K, float* out) {
  using L = Lanes<W>;
  constexpr int U = dot_unroll(M);
  pf::vf acc[M][U];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) acc[m][u] = pf::zero();
  int64_t k = 0;
  for (; k + U * L::step <= K; k += U * L::step) {
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[m][u] = L::fma(acc[m][u], w + k + u * L::step, x + m * K + k + u * L::step);
  }
  for (; k + L::step <= K; k += L::step)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[m][0] = L::fma(acc[m][0], w + k, x + m * K + k);
  if (k < K)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[m][0] = L::fma_n(acc[m][0], w + k, x + m * K + k, K - k);
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
#pragma GCC unroll 8
    for (int u = 1; u < U; ++u) acc[m][0] = pf::add(acc[m][0], acc[m][u]);
    out[m] = pf::sum(acc[m][0]);
  }
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

template <typename W, int M>
void gemv_range(const W* w, int64_t ldw, const typename Lanes<W>::X* x, int64_t K, W* y, int64_t N, int64_t n0,
                int64_t n1) {
  float part[M];
  for (int64_t n = n0; n < n1; ++n) {
    row_dot<W, M>(w + n * ldw, x, K, part);
    for (int m = 0; m < M; ++m) y[m * N + n] = static_cast<W>(part[m]);
  }
}

// x's rows (of W, any strides) as the dot reads them, X values K apart: x itself where it already is,
// else widened into buf by this thread. Tensor::to's copy took a dispatch and a parallel region for a few
// KiB, 121 times a token: ~1% of both threads' time in a bf16 decode step (perf, 2026-12-02)
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

template <typename W, int M>
void run(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  using X = typename Lanes<W>::X;
  const int64_t N = w.size(0), K = w.size(1), ldw = w.stride(0);
  const W* wp = w.data_ptr<W>();
  std::vector<X> buf;
  const X* xp = dense_rows<X, W>(x, buf);
  W* yp = y.data_ptr<W>();
  const int64_t grain = std::max<int64_t>(1, 65536 / (K * (int64_t)sizeof(W)));  // ~64 KiB of weight per task
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { gemv_range<W, M>(wp, ldw, xp, K, yp, N, n0, n1); });
}

template <typename W>
void dispatch_rows(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  static_assert(ONE_PASS == 4, "one case per row count up to ONE_PASS");
  switch (x.size(0)) {
    case 1: return run<W, 1>(x, w, y);
    case 2: return run<W, 2>(x, w, y);
    case 3: return run<W, 3>(x, w, y);
    case 4: return run<W, 4>(x, w, y);
    default: return wide::dispatch<W>(x, w, y);
  }
}

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "few_rows_linear: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.size(0) >= 1, "few_rows_linear: at least one row of x, got ", x.size(0));
  TORCH_CHECK(x.scalar_type() == w.scalar_type() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "few_rows_linear: float32 or bfloat16 x and weight of one dtype, got ", x.scalar_type(), " and ",
              w.scalar_type());
  TORCH_CHECK(w.stride(1) == 1 && w.stride(0) >= w.size(1), "few_rows_linear: weight rows must be contiguous");
  TORCH_CHECK(!x.is_cuda() && !w.is_cuda(), "few_rows_linear: CPU tensors only");
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  const auto product = [&](const at::Tensor& xs, at::Tensor& ys) {
    if (w.scalar_type() == at::kFloat) dispatch_rows<float>(xs, w, ys);
    else dispatch_rows<c10::BFloat16>(xs, w, ys);
  };
  const int64_t M = x.size(0), passes = (M + MAX_ROWS - 1) / MAX_ROWS, step = (M + passes - 1) / passes;
  if (passes == 1) {   // no views: two narrows cost ~4 us, 121 times a decode step
    product(x, y);
    return y;
  }
  for (int64_t m0 = 0; m0 < M; m0 += step) {   // equal passes: x's panels stay in L2 (513 rows: 3 x 171)
    at::Tensor part = y.narrow(0, m0, std::min(step, M - m0));   // y's rows, N apart, written in place
    product(x.narrow(0, m0, part.size(0)), part);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(phaseflip_cpu, m) {
  m.def("few_rows_linear(Tensor x, Tensor weight) -> Tensor");
  m.impl("few_rows_linear", c10::DispatchKey::CPU, TORCH_FN(few_rows_linear));
}
