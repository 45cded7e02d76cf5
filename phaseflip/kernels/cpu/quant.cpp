// Products x @ W^T with W in a GGUF block format, as the file holds it: each weight row a run of
// blocks, each block scales and small integers (the formats: blocks.h).
// x [M, K] float32 or bfloat16 (the output is x's dtype), float32 sums. The weight is read once a
// product, at its quantized size: what a decode step's time is (it reads every weight). Up to
// FUSED_ROWS rows of x, each block is decoded in registers and multiplied with every row as it is
// (nothing stored between); more rows, x is packed into panels as for the float32 kernel's wide form
// and a few weight rows at a time are decoded into an L1 buffer for its register tile (`tiled`): in
// float32, or, for bfloat16 x on a CPU with the bf16 pair-dot instruction, in bfloat16 (each decoded
// weight rounded to the nearest bf16, as a bf16 checkpoint's weights are) for the tile's bf16 pairs.
// Without vectors, each weight row is decoded into float32 and dotted with every row of x.
// Also rows of W decoded to float32 by index (`quant_rows`: a quantized embedding's lookup).
// Vectors of AVX-512 or AVX2 (simd.h), plain loops on a CPU with neither. Built with the other kernels
// by phaseflip/kernels/cpu/library.py; rows split over torch's threads (parallel.h's ranges).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>
#include "blocks.h"
#include "dot.h"
#include "dtype.h"
#include "int8.h"
#include "parallel.h"
#include "qrow.h"
#include "simd.h"
#include "tile.h"
#include "wide.h"

namespace {

constexpr int64_t FUSED_ROWS = 8;   // rows of x up to which each block is decoded in registers for all
constexpr int64_t INT8_ROWS = 4;    // rows of x up to which blocks take int8 products (int8.h)
constexpr int64_t PASS_ROWS = 256;  // more rows: x packed into panels, at most this many rows a pass
using blocks::QK;
using qrow::decode_row;   // into float32; the bfloat16 one below
#ifdef PF_LANES
using blocks::H;
#endif

#ifdef PF_BF16_DOT
// a weight row of K values decoded into bfloat16 (rounded to nearest even) for the bf16 tile
template <typename B>
void decode_row(const uint8_t* row, int64_t K, c10::BFloat16* out) {
  for (int64_t b = 0; b < K / B::values_per; ++b)
    for (int s = 0; s < B::values_per / QK; ++s) {
      pf::vf v[H];
      B::vectors(row + b * B::bytes, s, v);
      for (int h = 0; h < H; ++h)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * B::values_per + s * QK + h * pf::LANES),
                            (__m256i)_mm512_cvtneps_pbh(v[h]));
    }
}
#endif

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

// y's columns n0..n1 (weight rows) for the M rows of x (at most FUSED_ROWS with vectors): each block
// decoded in registers for all of them; without vectors, each weight row decoded into float32 and
// dotted with every row of x
template <typename B, typename X>
void rows(const uint8_t* wp, int64_t ldw, const float* xf, int64_t M, int64_t K, X* yp, int64_t N, int64_t n0,
          int64_t n1) {
#ifdef PF_LANES
  float out[FUSED_ROWS];
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
// More than FUSED_ROWS rows of x: x's rows packed into panels as the wide forms pack them (wide.h; E:
// float32, or bfloat16 pairs); NR weight rows at a time decoded into this thread's buffer of E, where
// they stay in L1 while the register tile (tile.h) multiplies them with every panel: each weight row is
// decoded once a pass, and no decoded weight reaches memory
template <typename B, typename X, typename E, int MB>
void tiled(const at::Tensor& xe, const uint8_t* wp, int64_t ldw, int64_t N, X* yp, int64_t ldy) {
  constexpr int64_t Mp = MB * pf::LANES;
  constexpr int NR = wide::wide_nr(MB);
  const int64_t M = xe.size(0), K = xe.size(1), panels = (M + Mp - 1) / Mp;
  const auto* tp = wide::packed<E, Mp>(xe, K);   // K: whole runs of 32, so whole bf16 pairs
  par::ranges((N + NR - 1) / NR, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float part[NR * Mp];
    std::vector<E> decoded(NR * K);
    for (int64_t n = b0 * NR; n < std::min(N, b1 * NR); n += NR) {
      const int64_t here = std::min<int64_t>(NR, N - n);
      for (int64_t r = 0; r < here; ++r) decode_row<B>(wp + (n + r) * ldw, K, decoded.data() + r * K);
      for (int64_t p = 0; p < panels; ++p) {
        const auto* panel = tp + p * K * Mp;
        if (here == NR) tile::rows<E, NR, MB>(decoded.data(), K, panel, Mp, K, part, Mp);
        else
          for (int64_t r = 0; r < here; ++r)
            tile::rows<E, 1, MB>(decoded.data() + r * K, K, panel, Mp, K, part + r * Mp, Mp);
        wide::put_rows<X, NR, Mp>(part, here, yp, ldy, n, p * Mp, std::min(M, (p + 1) * Mp));
      }
    }
  });
}

// MB: the vectors of LANES rows in one panel (1 .. wide::panel_mb), as wide::dispatch picks it
template <typename B, typename X, typename E, int MB = 1>
void tiled_rows(const at::Tensor& xe, const uint8_t* wp, int64_t ldw, int64_t N, X* yp, int64_t ldy) {
  if constexpr (MB < wide::panel_mb<E>())
    if (xe.size(0) > MB * pf::LANES) return tiled_rows<B, X, E, MB + 1>(xe, wp, ldw, N, yp, ldy);
  tiled<B, X, E, MB>(xe, wp, ldw, N, yp, ldy);
}

// the tile's element for x of type X: bfloat16 pairs for bfloat16 x where the CPU has the pair-dot
// instruction, else float32
template <typename X>
#ifdef PF_BF16_DOT
using TileOf = std::conditional_t<std::is_same_v<X, c10::BFloat16>, c10::BFloat16, float>;
#else
using TileOf = float;
#endif
#endif

#ifdef PF_INT8_DOT
// Up to INT8_ROWS rows of x: x quantized to int8 per run of 32 once, then integer products (int8.h); a
// weight row's blocks are read once for all rows
template <typename B, typename X>
void int8_rows(const at::Tensor& x, const uint8_t* wp, int64_t ldw, int64_t N, X* yp) {
  const int64_t M = x.size(0), K = x.size(1), runs = K / QK;
  std::vector<float> buf;
  int8dot::Rows qx;
  qx.quantize(dot::dense_rows<float, X>(x, buf), M, K);
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K / B::values_per * B::bytes));
  par::ranges(N, grain, [&](int64_t n0, int64_t n1) {
    float out[INT8_ROWS];
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = wp + n * ldw;
      switch (M) {
        case 1: int8dot::dot<B, 1>(row, runs, qx, out); break;
        case 2: int8dot::dot<B, 2>(row, runs, qx, out); break;
        case 3: int8dot::dot<B, 3>(row, runs, qx, out); break;
        default: int8dot::dot<B, 4>(row, runs, qx, out);
      }
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = static_cast<X>(out[m]);
    }
  });
}
#endif

template <typename B, typename X>
void run(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), ldw = w.stride(0);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  X* yp = y.data_ptr<X>();
#ifdef PF_INT8_DOT
  if (M <= INT8_ROWS) return int8_rows<B, X>(x, wp, ldw, N, yp);
#endif
#ifdef PF_LANES
  if (M > FUSED_ROWS) {   // passes of at most PASS_ROWS rows: their panels stay in L2
    using E = TileOf<X>;
    const at::Tensor xe = std::is_same_v<E, X> ? x : x.to(at::kFloat);
    const int64_t count = (M + PASS_ROWS - 1) / PASS_ROWS, step = (M + count - 1) / count;
    for (int64_t m0 = 0; m0 < M; m0 += step)
      tiled_rows<B, X, E>(xe.narrow(0, m0, std::min(step, M - m0)), wp, ldw, N, yp + m0 * N, N);
    return;
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

// rows of x above which this build multiplies bfloat16 x with the format's weights decoded into bfloat16
// (-1: never; it decodes them into float32)
int64_t quant_bf16_tile_rows() {
#ifdef PF_BF16_DOT
  return FUSED_ROWS;
#else
  return -1;
#endif
}

// rows of x up to which this build multiplies the format's blocks with int8 activations (0: never)
int64_t quant_int8_rows(int64_t type) {
  blocks::with_format(type, [](auto) { return 0; });   // the type checked
#ifdef PF_INT8_DOT
  return INT8_ROWS;
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(phaseflip, m) {
  m.def("cpu_quant_linear(Tensor x, Tensor blocks, int type) -> Tensor");
  m.impl("cpu_quant_linear", c10::DispatchKey::CPU, TORCH_FN(quant_linear));
  m.def("cpu_quant_rows(Tensor blocks, Tensor ids, int type) -> Tensor");
  m.impl("cpu_quant_rows", c10::DispatchKey::CPU, TORCH_FN(quant_rows));
  m.def("cpu_quant_int8_rows(int type) -> int", TORCH_FN(quant_int8_rows));
  m.def("cpu_quant_bf16_tile_rows() -> int", TORCH_FN(quant_bf16_tile_rows));
}
