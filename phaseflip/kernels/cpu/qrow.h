// One weight row in a GGUF block format (blocks.h) dotted with rows of x: decoded into float32
// (`decode_row`), decoded in registers and multiplied with up to a few rows of float32 x as it is
// (`fused_dot`), and one row of x as a one-token product reads it (`Input`, `dots`): x quantized to int8 per
// block of the weights' format (32 or 256 values) for integer products where the process takes them (`int8_x`,
// int8.h; the CPU has AVX2), else float32 x as it is. quant.cpp's products and the fused one-token decoder
// layers (layer.cpp) share these, so a token's product has one answer whichever of them runs it.
#pragma once
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>
#include "blocks.h"
#include "dot.h"
#include "int8.h"
#include "simd.h"

namespace qrow {

using blocks::QK;
#ifdef PF_LANES
using blocks::H;
#endif

// a weight row of K values decoded into out
template <typename B>
void decode_row(const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / B::values_per; ++b) {
#ifdef PF_LANES
    for (int s = 0; s < B::values_per / QK; ++s) {
      pf::vf v[H];
      B::vectors(row + b * B::bytes, s, v);
      for (int h = 0; h < H; ++h) pf::store(out + b * B::values_per + s * QK + h * pf::LANES, v[h]);
    }
#else
    B::values(row + b * B::bytes, out + b * B::values_per);
#endif
  }
}

#ifdef PF_LANES
// out[m] = (one weight row) . x[m] for M rows of x, K apart: each block decoded in registers and
// multiplied with every row of x as it is, nothing stored between
template <typename B, int M>
void fused_dot(const uint8_t* row, int64_t K, const float* x, float* out) {
  pf::vf acc[M][2];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = pf::zero();
  for (int64_t i = 0; i < K / QK; ++i) {   // i: the row's i-th run of 32 values
    pf::vf w[H];
    constexpr int64_t subs = B::values_per / QK;
    B::vectors(row + i / subs * B::bytes, static_cast<int>(i % subs), w);
#pragma GCC unroll 4
    for (int h = 0; h < H; ++h) {
      const float* xb = x + i * QK + h * pf::LANES;
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[m][h & 1] = pf::fma(w[h], pf::load(xb + m * K), acc[m][h & 1]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) out[m] = pf::sum(pf::add(acc[m][0], acc[m][1]));
}
#endif

// Whether products on blocks quantize x to int8 per block of the weights' values and multiply by integer dot
// products (int8.h: llama.cpp's numerics, and the fast path), x of every dtype, or multiply x as it is with
// the decoded weights (the "exact" products, as a dequantize-then-linear reference computes them). A process
// setting, as a rank process serves one model: int8 where the CPU has the integer dot (AVX2) until the boot
// sets the engine's choice (`set_int8_x`; kernels/cpu/quant.py); exact always on a CPU without it.
#ifdef PF_INT8_DOT
constexpr bool has_int8_dot = true;
#else
constexpr bool has_int8_dot = false;
#endif
inline std::atomic<bool> int8_setting{has_int8_dot};
inline bool int8_x() { return has_int8_dot && int8_setting.load(std::memory_order_relaxed); }

// Set int8_x() to `on` (on only where has_int8_dot); returns the setting it replaced
inline bool set_int8_x(bool on) { return int8_setting.exchange(on, std::memory_order_relaxed); }

// One row of x (K values) as `dot` reads it: int8 where int8_x(), quantized per 32 and per 256 values as the
// formats that will read it need (`set`'s flags), else float32
struct Input {
  int64_t K = 0;
  bool int8 = false;
  std::vector<float> f;
#ifdef PF_INT8_DOT
  int8dot::Rows q32, q256;
  const int8dot::Rows& per(int64_t values) const { return values == QK ? q32 : q256; }
#endif
  // x's values, held as X (a bf16 step may hold them widened to float32), for blocks of 32 values (per32)
  // and of 256 (per256)
  template <typename X>
  void set(const X* x, int64_t k, bool per32, bool per256) {
    K = k, int8 = int8_x();
    f.resize(k);
    for (int64_t i = 0; i < k; ++i) f[i] = static_cast<float>(x[i]);
#ifdef PF_INT8_DOT
    if (int8 && per32) q32.quantize(f.data(), 1, k, QK);
    if (int8 && per256) q256.quantize(f.data(), 1, k, 256);
#endif
  }
};

// out[n] = (weight row n of N, blocks B, `ld` bytes apart) . x: integer products where x is int8 (int8.h,
// several weight rows side by side), else each row decoded in registers against float32 x
template <typename B, typename O>
void dots(const uint8_t* rows, int64_t ld, int64_t N, const Input& x, O* out) {
#ifdef PF_INT8_DOT
  if (x.int8) return int8dot::rows<B, 1>(rows, ld, N, x.K / QK, x.per(B::values_per), out, 0);
#endif
  for (int64_t n = 0; n < N; ++n) {
    float one;
#ifdef PF_LANES
    fused_dot<B, 1>(rows + n * ld, x.K, x.f.data(), &one);
#else
    static thread_local std::vector<float> w;
    w.resize(x.K);
    decode_row<B>(rows + n * ld, x.K, w.data());
    dot::row_dot<float, 1>(w.data(), x.f.data(), x.K, &one);
#endif
    out[n] = static_cast<O>(one);
  }
}

}  // namespace qrow
