// Few-row products x @ W^T on the CPU for the decode step: W [N, K] read once, in place, as the
// arena holds it (row-major, rows a stride apart); x [M, K] with M <= MAX_ROWS; float32 sums.
// float32 or bfloat16 weights (x of the same dtype; the output is x's dtype). bfloat16 pairs go
// through the CPU's bf16 dot instruction (AVX512_BF16: products exact, sums in float32) where it has
// one, else are widened to float32. Built at run time by phaseflip/kernels/cpu_kernels.py for the
// machine it runs on (-march=native); rows are split over torch's own threads (at::parallel_for).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <type_traits>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PF_AVX512 1
#endif

namespace {

constexpr int64_t MAX_ROWS = 4;

#ifdef PF_AVX512
// One lane step of a dot product: 16 float32 (k .. k+15) or 32 bfloat16 (pairs multiplied and summed
// by the CPU's bf16 dot instruction where it has one, else widened to float32 16 at a time).
template <typename W> struct Lanes;
template <> struct Lanes<float> {
  using X = float;  // what x is held as
  static constexpr int64_t step = 16;
  static __mmask16 mask(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
  static __m512 fma(__m512 acc, const float* w, const float* x, __mmask16 m) {
    return _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w), _mm512_maskz_loadu_ps(m, x), acc);
  }
};
#ifdef __AVX512BF16__
template <> struct Lanes<c10::BFloat16> {
  using X = c10::BFloat16;
  static constexpr int64_t step = 32;
  static __mmask32 mask(int64_t n) { return n >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1ull << n) - 1); }
  static __m512 fma(__m512 acc, const c10::BFloat16* w, const c10::BFloat16* x, __mmask32 m) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(m, w), (__m512bh)_mm512_maskz_loadu_epi16(m, x));
  }
};
#else
template <> struct Lanes<c10::BFloat16> {
  using X = float;
  static constexpr int64_t step = 16;
  static __mmask16 mask(int64_t n) { return Lanes<float>::mask(n); }
  static __m512 fma(__m512 acc, const c10::BFloat16* w, const float* x, __mmask16 m) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, w));
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)), _mm512_maskz_loadu_ps(m, x), acc);
  }
};
#endif

// out[m] = sum_k w[k] * x[m][k]: one weight row read front to back (a single memory stream: 2, 4 or 8
// rows read side by side measured 1.2-1.6x slower, software prefetch no faster), two independent
// accumulators per row of x (one chain of dependent FMAs measured slower, four no faster)
template <typename W, int M>
inline void row_dot(const W* w, const typename Lanes<W>::X* x, int64_t K, float* out) {
  using L = Lanes<W>;
  constexpr int U = 2;
  __m512 acc[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + U * L::step <= K; k += U * L::step) {
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < M; ++m)
        acc[m][u] = L::fma(acc[m][u], w + k + u * L::step, x + m * K + k + u * L::step, L::mask(L::step));
  }
  for (; k < K; k += L::step)
    for (int m = 0; m < M; ++m) acc[m][0] = L::fma(acc[m][0], w + k, x + m * K + k, L::mask(K - k));
  for (int m = 0; m < M; ++m) {
    for (int u = 1; u < U; ++u) acc[m][0] = _mm512_add_ps(acc[m][0], acc[m][u]);
    out[m] = _mm512_reduce_add_ps(acc[m][0]);
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

template <typename W, int M>
void run(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  using X = typename Lanes<W>::X;
  const int64_t N = w.size(0), K = w.size(1), ldw = w.stride(0);
  const W* wp = w.data_ptr<W>();
  at::Tensor xl = x.to(std::is_same<X, float>::value ? at::kFloat : at::kBFloat16).contiguous();
  const X* xp = xl.data_ptr<X>();
  W* yp = y.data_ptr<W>();
  const int64_t grain = std::max<int64_t>(1, 65536 / (K * (int64_t)sizeof(W)));  // ~64 KiB of weight per task
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { gemv_range<W, M>(wp, ldw, xp, K, yp, N, n0, n1); });
}

template <typename W>
void dispatch_rows(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  switch (x.size(0)) {
    case 1: return run<W, 1>(x, w, y);
    case 2: return run<W, 2>(x, w, y);
    case 3: return run<W, 3>(x, w, y);
    default: return run<W, 4>(x, w, y);
  }
}

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "few_rows_linear: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= MAX_ROWS, "few_rows_linear: 1..", MAX_ROWS, " rows, got ", x.size(0));
  TORCH_CHECK(x.scalar_type() == w.scalar_type() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "few_rows_linear: float32 or bfloat16 x and weight of one dtype, got ", x.scalar_type(), " and ",
              w.scalar_type());
  TORCH_CHECK(w.stride(1) == 1 && w.stride(0) >= w.size(1), "few_rows_linear: weight rows must be contiguous");
  TORCH_CHECK(!x.is_cuda() && !w.is_cuda(), "few_rows_linear: CPU tensors only");
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  if (w.scalar_type() == at::kFloat) dispatch_rows<float>(x, w, y);
  else dispatch_rows<c10::BFloat16>(x, w, y);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(phaseflip_cpu, m) {
  m.def("few_rows_linear(Tensor x, Tensor weight) -> Tensor");
  m.impl("few_rows_linear", c10::DispatchKey::CPU, TORCH_FN(few_rows_linear));
}
