// Products x @ W^T with W in a GGUF block format, as the file holds it: each weight row a run of
// blocks, each block a scale and small integers (Q8_0: an fp16 scale d and 32 int8 q, w = d * q).
// x [M, K] float32 or bfloat16 (the output is x's dtype), float32 sums. The weight is read once a
// product, at its quantized size: what a decode step's time is (it reads every weight). Up to
// FUSED_ROWS rows of x, each block is decoded in registers and multiplied with every row as it is
// (nothing stored between); more rows, each weight row is decoded into float32 in this thread's buffer
// and dotted with every row of x (at 32 rows slower than the float32 kernel: docs/performance.md).
// Vectors of AVX-512 or AVX2 (simd.h), plain loops on a CPU with neither. Built with the other kernels
// by phaseflip/kernels/cpu/library.py; rows split over torch's threads (parallel.h's ranges).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <algorithm>
#include <cstring>
#include <vector>
#include "dtype.h"
#include "parallel.h"
#include "simd.h"

namespace {

// GGML's type ids of the block formats decoded here
constexpr int64_t Q8_0 = 8;
constexpr int64_t FUSED_ROWS = 4;   // rows of x up to which a block is decoded in registers for all of them

struct Format {
  int64_t block_values, block_bytes;
};

Format format_of(int64_t type) {
  TORCH_CHECK(type == Q8_0, "quant_linear: block format ", type, " is not served (served: Q8_0 = 8)");
  return {32, 34};
}

inline float half_to_float(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// one Q8_0 block (fp16 d, then 32 int8 q) as 32 float32 values d * q
inline void decode_q8_0(const uint8_t* block, float* out) {
  const float d = half_to_float(block);
  const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
#if PF_LANES == 16
  const __m512 vd = _mm512_set1_ps(d);
  for (int h = 0; h < 2; ++h) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h));
    _mm512_storeu_ps(out + 16 * h, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))));
  }
#elif PF_LANES == 8
  const __m256 vd = _mm256_set1_ps(d);
  for (int h = 0; h < 4; ++h) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * h));
    _mm256_storeu_ps(out + 8 * h, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))));
  }
#else
  for (int i = 0; i < 32; ++i) out[i] = d * q[i];
#endif
}

#ifdef PF_LANES
// LANES int8 values as float32
inline pf::vf load_i8(const int8_t* q) {
#if PF_LANES == 16
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
#else
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
#endif
}

// out[m] = (one Q8_0 weight row) . x[m] for M (<= FUSED_ROWS) rows of x, K apart: each block's values
// scaled in registers and multiplied with every row of x as they are, nothing stored between
template <int M>
void q8_0_dot(const uint8_t* row, int64_t blocks, const float* x, int64_t K, float* out) {
  constexpr int H = 32 / pf::LANES;   // vectors a block
  pf::vf acc[M][2];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = pf::zero();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * 34;
    const pf::vf d = pf::set1(half_to_float(block));
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) {
      const pf::vf w = pf::mul(d, load_i8(q + h * pf::LANES));
      const float* xb = x + b * 32 + h * pf::LANES;
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[m][h & 1] = pf::fma(w, pf::load(xb + m * K), acc[m][h & 1]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) out[m] = pf::sum(pf::add(acc[m][0], acc[m][1]));
}
#endif

void decode_row(int64_t type, const uint8_t* row, int64_t K, float* out) {
  const Format f = format_of(type);
  for (int64_t b = 0; b < K / f.block_values; ++b) decode_q8_0(row + b * f.block_bytes, out + b * f.block_values);
}

inline float dot(const float* a, const float* b, int64_t K) {
#ifdef PF_LANES
  pf::vf acc0 = pf::zero(), acc1 = pf::zero();
  int64_t k = 0;
  for (; k + 2 * pf::LANES <= K; k += 2 * pf::LANES) {
    acc0 = pf::fma(pf::load(a + k), pf::load(b + k), acc0);
    acc1 = pf::fma(pf::load(a + k + pf::LANES), pf::load(b + k + pf::LANES), acc1);
  }
  float s = pf::sum(pf::add(acc0, acc1));
  for (; k < K; ++k) s += a[k] * b[k];
  return s;
#else
  float s = 0.f;
  for (int64_t k = 0; k < K; ++k) s += a[k] * b[k];
  return s;
#endif
}

// x's rows as float32, K apart
template <typename X>
std::vector<float> float_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), s0 = x.stride(0), s1 = x.stride(1);
  const X* p = x.data_ptr<X>();
  std::vector<float> out(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) out[m * K + k] = static_cast<float>(p[m * s0 + k * s1]);
  return out;
}

// y's rows n0..n1 for M rows of x: fused where the format and M allow (few rows), else each weight row
// decoded into `row` and dotted with every row of x
template <typename X>
void rows(int64_t type, const uint8_t* wp, int64_t ldw, const float* xf, int64_t M, int64_t K, X* yp, int64_t N,
          int64_t n0, int64_t n1) {
#ifdef PF_LANES
  if (type == Q8_0 && M <= FUSED_ROWS) {
    float out[FUSED_ROWS];
    for (int64_t n = n0; n < n1; ++n) {
      switch (M) {
        case 1: q8_0_dot<1>(wp + n * ldw, K / 32, xf, K, out); break;
        case 2: q8_0_dot<2>(wp + n * ldw, K / 32, xf, K, out); break;
        case 3: q8_0_dot<3>(wp + n * ldw, K / 32, xf, K, out); break;
        default: q8_0_dot<4>(wp + n * ldw, K / 32, xf, K, out);
      }
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = static_cast<X>(out[m]);
    }
    return;
  }
#endif
  std::vector<float> row(K);
  for (int64_t n = n0; n < n1; ++n) {
    decode_row(type, wp + n * ldw, K, row.data());
    for (int64_t m = 0; m < M; ++m) yp[m * N + n] = static_cast<X>(dot(row.data(), xf + m * K, K));
  }
}

template <typename X>
void run(const at::Tensor& x, const at::Tensor& w, int64_t type, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), ldw = w.stride(0);
  const std::vector<float> xf = float_rows<X>(x);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  X* yp = y.data_ptr<X>();
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, w.size(1)));  // ~64 KiB of blocks a task
  par::ranges(N, grain, [&](int64_t n0, int64_t n1) { rows<X>(type, wp, ldw, xf.data(), M, K, yp, N, n0, n1); });
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t type) {
  const Format f = format_of(type);
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "quant_linear: x [M, K] and blocks [N, bytes] expected, got ",
              x.sizes(), " and ", w.sizes());
  TORCH_CHECK(w.scalar_type() == at::kByte, "quant_linear: blocks of uint8 expected, got ", w.scalar_type());
  TORCH_CHECK(x.size(1) % f.block_values == 0 && w.size(1) == x.size(1) / f.block_values * f.block_bytes,
              "quant_linear: x's K = ", x.size(1), " takes ", x.size(1) / f.block_values * f.block_bytes,
              " bytes of blocks a row, got ", w.size(1));
  TORCH_CHECK(w.stride(1) == 1, "quant_linear: each row's blocks must be contiguous");
  TORCH_CHECK(!x.is_cuda() && !w.is_cuda(), "quant_linear: CPU tensors only");
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) > 0)
    dtype::dispatch("quant_linear", x.scalar_type(), [&](auto zero) { run<decltype(zero)>(x, w, type, y); });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(phaseflip, m) {
  m.def("cpu_quant_linear(Tensor x, Tensor blocks, int type) -> Tensor");
  m.impl("cpu_quant_linear", c10::DispatchKey::CPU, TORCH_FN(quant_linear));
}
