// Products of GGUF blocks (blocks.h) with a few rows of activations quantized to int8 per block of the
// weights' format, 32 or 256 values (llama.cpp's approach, public knowledge: its Q8_0 and Q8_K; int8_x.h's
// Rows): unsigned bytes times signed ones summed into 8 int32 lanes (int8_x.h's dpbusd: AVX512-VNNI's
// vpdpbusd, four at a time, where present; else AVX2's vpmaddubsw and vpmaddwd), which the scales turn into
// float32. With x's scale dx and q = round(x / dx), a run of 32 weights w = a * u + c (u unsigned) has the dot
// a * dx * sum(u * q) + c * dx * sum(q):
// - Q4_0, Q4_1, Q5_0, Q5_1 (int8_groups.h) sum 8 blocks' integer sums into the lanes of one vector that
//   their scales (d * dx) turn into float32 at once, an integer offset c / a in the integer sum; on AVX2, up
//   to 6 rows of x, a block at a time (dot_blocks);
// - Q8_0's signed w as |w| times x with w's signs, a block at a time (dot_q80);
// - Q4_K and Q6_K (int8_k.h): runs share dx (one per 256 values), their products add up in int32 across
//   the block with the runs' scales, one float conversion a block.
// Included by qrow.h, quant.cpp and int8_wide.h; compiled where the CPU has AVX2, FMA and F16C
// (PF_INT8_DOT), else quant.cpp keeps its float32 paths.
#pragma once
#include "int8_groups.h"
#include "int8_k.h"
#include "int8_x.h"
#ifdef PF_INT8_DOT

namespace int8dot {

// Q8_0's dot (as dot below), a block at a time: sum(|w| * sign(w) q) in 8 lanes, times d * dx. (The grouped
// form of int8_groups.h, measured on Zen 4, is slower here: its lane sums cost more than the 8 scalings they
// save a block of 34 bytes, which the memory bounds anyway.)
template <int M, int R>
inline void dot_q80(const uint8_t* row, int64_t ld, int64_t runs, const Rows& x, float* out) {
  __m256 acc[R][M] = {};
  for (int64_t b = 0; b < runs; ++b) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = row + r * ld + b * blocks::Q8_0::bytes;
      if (b % 2 == 0) pf::prefetch_ahead<2 * blocks::Q8_0::bytes>(blk);
      const __m256i w = load32(blk + 2), magnitude = _mm256_sign_epi8(w, w);
      const __m256 d = _mm256_set1_ps(half_at(blk));
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const int64_t j = m * runs + b;
        const __m256i sum = dpbusd(_mm256_setzero_si256(), magnitude, _mm256_sign_epi8(x.run(j), w));
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(x.d[j])), acc[r][m]);
      }
    }
  }
  totals(acc, out);
}

// out[r * M + m] = (weight row r of R, `ld` bytes apart, each `runs` runs of 32 in blocks of format B) .
// x's row m, for M rows of x: int8_k.h's dot for Q4_K and Q6_K, int8_groups.h's for the 4- and 5-bit
// 32-value formats. Each weight row's blocks are read once for all rows of x.
template <typename B, int M, int R = 1>
inline void dot(const uint8_t* row, int64_t ld, int64_t runs, const Rows& x, float* out) {
  if constexpr (std::is_same_v<B, blocks::Q4_K>)
    dot_k4<M, R>(row, ld, runs, x, out);
  else if constexpr (std::is_same_v<B, blocks::Q6_K>)
    dot_k6<M, R>(row, ld, runs, x, out);
  else if constexpr (std::is_same_v<B, blocks::Q8_0>)
    dot_q80<M, R>(row, ld, runs, x, out);
  else if constexpr (BLOCK_AT_A_TIME && M <= 6)
    dot_blocks<B, M, R>(row, ld, runs, x, out);
  else
    dot_groups<B, M, R>(row, ld, runs, x, out);
}

// y[m * ldy + n] = weight row n (of N, `ld` bytes apart) . x's row m, for M rows of x. R = 4 / M weight
// rows side by side, so that ~4 accumulators' chains overlap: the rows cut in R parts read in step, row i
// of each part at once, each part one stream forward through memory (R neighbouring rows would be R
// streams of one row each, too short for the hardware's prefetchers to follow). x quantized per block of B's
// values (Rows::quantize with B::values_per)
template <typename B, int M, typename Y>
inline void rows(const uint8_t* w, int64_t ld, int64_t N, int64_t runs, const Rows& x, Y* y, int64_t ldy) {
  constexpr int R = M < 4 ? 4 / M : 1;
  const int64_t part = N / R;
  float out[R * M];
  for (int64_t i = 0; i < part; ++i) {
    dot<B, M, R>(w + i * ld, part * ld, runs, x, out);
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) y[m * ldy + i + r * part] = static_cast<Y>(out[r * M + m]);
  }
  for (int64_t n = R * part; n < N; ++n) {
    dot<B, M>(w + n * ld, 0, runs, x, out);
    for (int m = 0; m < M; ++m) y[m * ldy + n] = static_cast<Y>(out[m]);
  }
}

}  // namespace int8dot
#endif
