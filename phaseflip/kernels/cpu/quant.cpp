// Products x @ W^T with W in a GGUF block format, as the file holds it: each weight row a run of blocks, each
// block scales and small integers (the formats: blocks.h). x [M, K] float32 or bfloat16 (the output is x's
// dtype), float32 sums. The weight is read once a product, at its quantized size: what a decode step's time
// is (it reads every weight). Where the process takes int8 products (qrow::int8_x: the CPU has AVX2, and the
// engine's block_products is int8), x is quantized to int8 per block of the format's values (32, or 256 for
// the K formats) at every row count (llama.cpp's approach) and multiplied by integer dot products: up to
// FEW_ROWS rows of x, each weight row's blocks read once for all of them (int8.h; a few such passes up to
// few_rows.h's limit); more, 16 (VNNI) or 8 (AVX2) weight rows at a time unpacked into L1 for an integer
// register tile (int8_wide.h). Otherwise x is never rounded (the "exact" products, those of the decoded
// weights): up to FEW_ROWS rows each block is decoded in registers and multiplied with every row as it is
// (qrow.h's fused_dot); more, x is packed into panels as for the float32 kernel's wide form and a few weight
// rows at a time are decoded into an L1 buffer for its register tile (`tiled`). Without vectors, each weight
// row is decoded into float32 and dotted with every row of x. Also rows of W decoded to float32 by index
// (`quant_rows`: a quantized embedding's lookup).
// Vectors of AVX-512 or AVX2 (simd.h), plain loops on a CPU with neither. Built with the other kernels by
// phaseflip/kernels/cpu/library.py; rows split over torch's threads (parallel.h's ranges).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>
#include "blocks.h"
#include "dot.h"
#include "dtype.h"
#include "few_rows.h"
#include "int8.h"
#include "int8_wide.h"
#include "parallel.h"
#include "qrow.h"
#include "simd.h"
#include "tile.h"
#include "wide.h"

namespace {

constexpr int64_t PASS_ROWS = 256;  // more rows: at most this many a pass (x's panels or int8 rows stay in L2)
using blocks::QK;
using few_rows::FEW_ROWS;
using few_rows::few_rows_limit;
using qrow::decode_row;

#ifdef PF_LANES
using qrow::fused_dot;

template <typename B>
void fused_rows(const uint8_t* row, int64_t K, const float* x, int64_t M, float* out) {
  switch (M) {
    case 1: return fused_dot<B, 1>(row, K, x, out);
    case 2: return fused_dot<B, 2>(row, K, x, out);
    case 3: return fused_dot<B, 3>(row, K, x, out);
    case 4: return fused_dot<B, 4>(row, K, x, out);
    case 5: return fused_dot<B, 5>(row, K, x, out);
    case 6: return fused_dot<B, 6>(row, K, x, out);
    case 7: return fused_dot<B, 7>(row, K, x, out);
    default: return fused_dot<B, 8>(row, K, x, out);
  }
}
#endif

// y's columns n0..n1 (weight rows) for the M rows of x (at most FEW_ROWS with vectors): each block
// decoded in registers for all of them; without vectors, each weight row decoded into float32 and
// dotted with every row of x
template <typename B, typename X>
void rows(const uint8_t* wp, int64_t ldw, const float* xf, int64_t M, int64_t K, X* yp, int64_t N, int64_t n0,
          int64_t n1) {
#ifdef PF_LANES
  float out[FEW_ROWS];
  for (int64_t n = n0; n < n1; ++n) {
    fused_rows<B>(wp + n * ldw, K, xf, M, out);
    for (int64_t m = 0; m < M; ++m) yp[m * N + n] = static_cast<X>(out[m]);
  }
#else
  std::vector<float> row(K);
  float out;
  for (int64_t n = n0; n < n1; ++n) {
    decode_row<B>(wp + n * ldw, K, row.data());
    for (int64_t m = 0; m < M; ++m) {
      dot::row_dot<float, 1>(row.data(), xf + m * K, K, &out);
      yp[m * N + n] = static_cast<X>(out);
    }
  }
#endif
}

#ifdef PF_LANES
// More than FEW_ROWS rows of float32 x: x's rows packed into panels as the wide forms pack them
// (wide.h); NR weight rows at a time decoded into this thread's float32 buffer, where they stay in L1
// while the register tile (tile.h) multiplies them with every panel: each weight row is decoded once a
// pass, and no decoded weight reaches memory
template <typename B, typename X, int MB>
void tiled(const at::Tensor& xf, const uint8_t* wp, int64_t ldw, int64_t N, X* yp, int64_t ldy) {
  constexpr int64_t Mp = MB * pf::LANES;
  constexpr int NR = wide::wide_nr(MB);
  const int64_t M = xf.size(0), K = xf.size(1), panels = (M + Mp - 1) / Mp;
  const float* tp = wide::packed<float, Mp>(xf, K);
  par::ranges((N + NR - 1) / NR, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float part[NR * Mp];
    std::vector<float> decoded(NR * K);
    for (int64_t n = b0 * NR; n < std::min(N, b1 * NR); n += NR) {
      const int64_t here = std::min<int64_t>(NR, N - n);
      for (int64_t r = 0; r < here; ++r) decode_row<B>(wp + (n + r) * ldw, K, decoded.data() + r * K);
      for (int64_t p = 0; p < panels; ++p) {
        const float* panel = tp + p * K * Mp;
        if (here == NR) tile::rows<float, NR, MB>(decoded.data(), K, panel, Mp, K, part, Mp);
        else
          for (int64_t r = 0; r < here; ++r)
            tile::rows<float, 1, MB>(decoded.data() + r * K, K, panel, Mp, K, part + r * Mp, Mp);
        wide::put_rows<X, NR, Mp>(part, here, yp, ldy, n, p * Mp, std::min(M, (p + 1) * Mp));
      }
    }
  });
}

// MB: the vectors of LANES rows in one panel (1 .. wide::panel_mb), as wide::dispatch picks it
template <typename B, typename X, int MB = 1>
void tiled_rows(const at::Tensor& xf, const uint8_t* wp, int64_t ldw, int64_t N, X* yp, int64_t ldy) {
  if constexpr (MB < wide::panel_mb<float>())
    if (xf.size(0) > MB * pf::LANES) return tiled_rows<B, X, MB + 1>(xf, wp, ldw, N, yp, ldy);
  tiled<B, X, MB>(xf, wp, ldw, N, yp, ldy);
}
#endif

#ifdef PF_INT8_DOT
// Up to FEW_ROWS rows of x: x quantized to int8 per block of B's values once, then integer products
// (int8.h); a weight row's blocks are read once for all rows
template <typename B, typename X>
void int8_rows(const at::Tensor& x, const uint8_t* wp, int64_t ldw, int64_t N, X* yp) {
  const int64_t M = x.size(0), K = x.size(1), runs = K / QK;
  std::vector<float> buf;
  int8dot::Rows qx;
  qx.quantize(dot::dense_rows<float, X>(x, buf), M, K, B::values_per);
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K / B::values_per * B::bytes));
  par::ranges(N, grain, [&](int64_t n0, int64_t n1) {
    const uint8_t* w = wp + n0 * ldw;
    switch (M) {
      case 1: return int8dot::rows<B, 1>(w, ldw, n1 - n0, runs, qx, yp + n0, N);
      case 2: return int8dot::rows<B, 2>(w, ldw, n1 - n0, runs, qx, yp + n0, N);
      case 3: return int8dot::rows<B, 3>(w, ldw, n1 - n0, runs, qx, yp + n0, N);
      case 4: return int8dot::rows<B, 4>(w, ldw, n1 - n0, runs, qx, yp + n0, N);
      case 5: return int8dot::rows<B, 5>(w, ldw, n1 - n0, runs, qx, yp + n0, N);
      case 6: return int8dot::rows<B, 6>(w, ldw, n1 - n0, runs, qx, yp + n0, N);
      case 7: return int8dot::rows<B, 7>(w, ldw, n1 - n0, runs, qx, yp + n0, N);
      default: return int8dot::rows<B, 8>(w, ldw, n1 - n0, runs, qx, yp + n0, N);
    }
  });
}

// More than FEW_ROWS rows of x (one pass): x quantized to int8 per block of B's values, and each group of
// int8wide::NR weight rows unpacked once into this thread's buffer for the integer register tile
// (int8_wide.h), which meets every row of x
template <typename B, typename X>
void int8_wide(const at::Tensor& x, const uint8_t* wp, int64_t ldw, int64_t N, X* yp, int64_t ldy) {
  using int8wide::MR, int8wide::NR;
  constexpr int R = int8wide::scale_run<B>;
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<float> buf, xs;
  int8dot::Rows qx;
  qx.quantize(dot::dense_rows<float, X>(x, buf), M, K, B::values_per);
  int8wide::offsets(qx, M, K, R, xs);
  par::ranges((N + NR - 1) / NR, 1, [&](int64_t g0, int64_t g1) {
    static thread_local int8wide::Group g;
    alignas(64) float part[MR * NR];
    for (int64_t n = g0 * NR; n < std::min(N, g1 * NR); n += NR) {
      const int64_t here = std::min<int64_t>(NR, N - n);
      g.fill<B>(wp + n * ldw, ldw, here, K);
      for (int64_t m = 0; m < M; m += MR) {
        const int64_t mt = std::min<int64_t>(MR, M - m);
        int8wide::tile_rows<R, int8wide::signed_bytes<B>, int8wide::fold<B>>(g, qx, xs, m, mt, K, part);
        for (int64_t r = 0; r < mt; ++r)
          for (int64_t c = 0; c < here; ++c) yp[(m + r) * ldy + n + c] = static_cast<X>(part[r * NR + c]);
      }
    }
  });
}
#endif

// fn(m0, rows) for each pass of at most `most` of x's M rows, the passes as equal as they come
template <typename Fn>
void in_passes(int64_t M, int64_t most, const Fn& fn) {
  const int64_t count = (M + most - 1) / most, step = (M + count - 1) / count;
  for (int64_t m0 = 0; m0 < M; m0 += step) fn(m0, std::min(step, M - m0));
}

template <typename B, typename X>
void run(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), ldw = w.stride(0);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  X* yp = y.data_ptr<X>();
#ifdef PF_INT8_DOT
  if (qrow::int8_x()) {
    if (M <= few_rows_limit<B>())
      return in_passes(M, FEW_ROWS, [&](int64_t m0, int64_t rows) {
        int8_rows<B, X>(x.narrow(0, m0, rows), wp, ldw, N, yp + m0 * N);
      });
    return in_passes(M, PASS_ROWS, [&](int64_t m0, int64_t rows) {
      int8_wide<B, X>(x.narrow(0, m0, rows), wp, ldw, N, yp + m0 * N, N);
    });
  }
#endif
#ifdef PF_LANES
  if (M > FEW_ROWS) {
    const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
    return in_passes(M, PASS_ROWS, [&](int64_t m0, int64_t rows) {
      tiled_rows<B, X>(xf.narrow(0, m0, rows), wp, ldw, N, yp + m0 * N, N);
    });
  }
#endif
  std::vector<float> buf;
  const float* xf = dot::dense_rows<float, X>(x, buf);
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, w.size(1)));  // ~64 KiB of blocks a task
  par::ranges(N, grain, [&](int64_t n0, int64_t n1) { rows<B, X>(wp, ldw, xf, M, K, yp, N, n0, n1); });
}

// the values and bytes of a block of the format with GGML type id `type`
std::pair<int64_t, int64_t> geometry(int64_t type) {
  return blocks::with_format(type, [](auto b) { return std::pair(decltype(b)::values_per, decltype(b)::bytes); });
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t type) {
  const auto [per, block_bytes] = geometry(type);
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "quant_linear: x [M, K] and blocks [N, bytes] expected, got ",
              x.sizes(), " and ", w.sizes());
  TORCH_CHECK(w.scalar_type() == at::kByte, "quant_linear: blocks of uint8 expected, got ", w.scalar_type());
  TORCH_CHECK(x.size(1) % per == 0, "quant_linear: x's K = ", x.size(1), " is not a whole number of ", per,
              "-value blocks");
  TORCH_CHECK(w.size(1) == x.size(1) / per * block_bytes, "quant_linear: x's K = ", x.size(1), " takes ",
              x.size(1) / per * block_bytes, " bytes of blocks a row, got ", w.size(1));
  TORCH_CHECK(w.stride(1) == 1, "quant_linear: each row's blocks must be contiguous");
  TORCH_CHECK(!x.is_cuda() && !w.is_cuda(), "quant_linear: CPU tensors only");
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) > 0)
    blocks::with_format(type, [&](auto b) {
      dtype::dispatch("quant_linear", x.scalar_type(), [&](auto zero) { run<decltype(b), decltype(zero)>(x, w, y); });
    });
  return y;
}

// rows `ids` of W (an embedding's lookup) decoded into float32 [len(ids), K]
at::Tensor quant_rows(const at::Tensor& w, const at::Tensor& ids, int64_t type) {
  const auto [per, block_bytes] = geometry(type);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.stride(1) == 1 && w.size(1) % block_bytes == 0,
              "quant_rows: blocks uint8 [N, whole blocks a row] with contiguous rows expected, got ", w.sizes());
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "quant_rows: ids int64 [T] expected, got ",
              ids.scalar_type(), " ", ids.sizes());
  const int64_t N = w.size(0), K = w.size(1) / block_bytes * per, T = ids.size(0);
  const at::Tensor idc = ids.contiguous();
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "quant_rows: id ", ip[t], " is outside the ", N, " rows");
  at::Tensor out = at::empty({T, K}, w.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  blocks::with_format(type, [&](auto b) {
    par::ranges(T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) decode_row<decltype(b)>(wp + ip[t] * w.stride(0), K, op + t * K);
    });
  });
  return out;
}

// whether this build has the integer dot products (the CPU has AVX2): int8 products can be set
bool quant_has_int8_dot() { return qrow::has_int8_dot; }

// whether products on blocks quantize x to int8 per block of the format's values now (qrow::int8_x)
bool quant_int8_x() { return qrow::int8_x(); }

// set quant_int8_x() to `on`; returns the setting it replaced
bool quant_set_int8_x(bool on) {
  TORCH_CHECK(!on || qrow::has_int8_dot, "quant_set_int8_x: this build has no integer dot products (the CPU "
              "lacks AVX2): products on blocks multiply x as it is");
  return qrow::set_int8_x(on);
}

// the rows of x up to which the format's products with int8 x take the few-rows dots (few_rows_limit)
int64_t quant_few_rows(int64_t type) {
  return blocks::with_format(type, [](auto b) { return few_rows_limit<decltype(b)>(); });
}

// set quant_few_rows(type) to `rows` (>= 0), or back to its default (-1); returns the limit it replaced
int64_t quant_set_few_rows(int64_t type, int64_t rows) {
  TORCH_CHECK(rows >= -1, "quant_set_few_rows: rows must be >= 0 (or -1: the default), got ", rows);
  const int64_t before = quant_few_rows(type);   // the type checked
  few_rows::set(type, rows);
  return before;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(phaseflip, m) {
  m.def("cpu_quant_linear(Tensor x, Tensor blocks, int type) -> Tensor");
  m.impl("cpu_quant_linear", c10::DispatchKey::CPU, TORCH_FN(quant_linear));
  m.def("cpu_quant_rows(Tensor blocks, Tensor ids, int type) -> Tensor");
  m.impl("cpu_quant_rows", c10::DispatchKey::CPU, TORCH_FN(quant_rows));
  m.def("cpu_quant_has_int8_dot() -> bool", TORCH_FN(quant_has_int8_dot));
  m.def("cpu_quant_int8_x() -> bool", TORCH_FN(quant_int8_x));
  m.def("cpu_quant_set_int8_x(bool on) -> bool", TORCH_FN(quant_set_int8_x));
  m.def("cpu_quant_few_rows(int type) -> int", TORCH_FN(quant_few_rows));
  m.def("cpu_quant_set_few_rows(int type, int rows) -> int", TORCH_FN(quant_set_few_rows));
}
