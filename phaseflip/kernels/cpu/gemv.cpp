// Few-row products x @ W^T on the CPU (decode steps, short prompt chunks): W [N, K] read once, in
// place, as the arena holds it (row-major, rows a stride apart); x [M, K], MAX_ROWS rows a pass; float32
// sums. Up to ONE_PASS rows, each weight row is dotted with every row of x; beyond, x is transposed and
// each weight value, broadcast, multiplies a vector of rows of x at once (wide.h).
// float32 or bfloat16 weights (x of the same dtype; the output is x's dtype). bfloat16 pairs go
// through the CPU's bf16 dot instruction (AVX512_BF16: products exact, sums in float32) where it has
// one, else are widened to float32. Vectors of AVX-512 or AVX2 (simd.h), plain loops on a CPU with
// neither. Built at run time by phaseflip/kernels/cpu/library.py for the machine it runs on
// (-march=native); rows are split over torch's threads (parallel.h's ranges).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <algorithm>
#include <type_traits>
#include <vector>
#include "dot.h"
#include "dtype.h"
#include "parallel.h"
#include "simd.h"
#include "wide.h"

namespace {

constexpr int64_t MAX_ROWS = 256;   // rows of x a pass: more are taken MAX_ROWS at a time
constexpr int64_t ONE_PASS = 4;

using dot::Lanes;
using dot::dense_rows;
using dot::gemv_range;

template <typename W, int M>
void run(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  using X = typename Lanes<W>::X;
  const int64_t N = w.size(0), K = w.size(1), ldw = w.stride(0);
  const W* wp = w.data_ptr<W>();
  std::vector<X> buf;
  const X* xp = dense_rows<X, W>(x, buf);
  W* yp = y.data_ptr<W>();
  const int64_t grain = std::max<int64_t>(1, 65536 / (K * (int64_t)sizeof(W)));  // ~64 KiB of weight per task
  par::ranges(N, grain, [&](int64_t n0, int64_t n1) { gemv_range<W, M>(wp, ldw, xp, K, yp, N, n0, n1); });
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

// y = x @ w^T in passes of at most MAX_ROWS rows of x, equal ones: x's panels stay in L2 (513 rows: 3 x 171)
template <typename W>
void passes(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  const int64_t M = x.size(0), count = (M + MAX_ROWS - 1) / MAX_ROWS, step = (M + count - 1) / count;
  if (count == 1) return dispatch_rows<W>(x, w, y);   // no views: a narrow costs a dispatch, every product
  for (int64_t m0 = 0; m0 < M; m0 += step) {
    at::Tensor part = y.narrow(0, m0, std::min(step, M - m0));   // y's rows, N apart, written in place
    dispatch_rows<W>(x.narrow(0, m0, part.size(0)), w, part);
  }
}

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "few_rows_linear: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.size(0) >= 1, "few_rows_linear: at least one row of x, got ", x.size(0));
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "few_rows_linear: x and weight of one dtype, got ",
              x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(w.stride(1) == 1 && w.stride(0) >= w.size(1), "few_rows_linear: weight rows must be contiguous");
  TORCH_CHECK(!x.is_cuda() && !w.is_cuda(), "few_rows_linear: CPU tensors only");
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  dtype::dispatch("few_rows_linear", w.scalar_type(), [&](auto zero) { passes<decltype(zero)>(x, w, y); });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(phaseflip, m) {
  m.def("cpu_few_rows_linear(Tensor x, Tensor weight) -> Tensor");
  m.impl("cpu_few_rows_linear", c10::DispatchKey::CPU, TORCH_FN(few_rows_linear));
}
