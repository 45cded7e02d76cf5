// Products of GGUF blocks (blocks.h) with a few rows of activations quantized to int8 per block of the
// weights' format, 32 or 256 values (llama.cpp's approach, public knowledge: its Q8_0 and Q8_K; int8_x.h's
// Rows): AVX512-VNNI's vpdpbusd multiplies 32 unsigned bytes by 32 signed ones and sums them four at a time
// into 8 int32 lanes (256-bit vectors: single-pumped on Zen 4), which the scales turn into float32. With
// x's scale dx and q = round(x / dx):
// - Q5_0 and Q5_1 give each run's weights as w = a * u + c, u unsigned (< 32): the run's dot is
//   a * dx * sum(u * q) + c * dx * sum(q), a block at a time (dot_runs);
// - Q4_0 and Q4_1 (int8_nibbles.h) the same, 8 blocks' integer sums in the lanes of one vector that their
//   scales (d * dx) turn into float32 at once, Q4_0's -8 in the integer sum (-8 sum(q));
// - Q4_K and Q6_K (int8_k.h): runs share dx (one per 256 values), their products add up in int32 across
//   the block with the runs' scales, one float conversion a block;
// - Q8_0 (and Q6_K in int8_wide.h) give signed w (Q6_K's q - 32) and a scale for each 16 values:
//   sum(|w| * sign(w) q) per lane, times its lane's scale (lanes 0-3 hold values 0-15, 4-7 values 16-31).
// A weight row's blocks are read once for all rows of x. Included by qrow.h and quant.cpp; compiled where the
// CPU has AVX512-VNNI, -VL and -BW (PF_INT8_DOT), else quant.cpp keeps its float32 paths.
#pragma once
#include "int8_k.h"
#include "int8_nibbles.h"
#include "int8_x.h"
#ifdef PF_INT8_DOT

namespace int8dot {

// Unsigned runs: u, with w = a * u + c (dot_runs's, and int8_wide.h's for every format)
inline __m256i run(blocks::Q4_0, const uint8_t* b, int, float& a, float& c) {
  a = half(b), c = -8.f * a;
  return nibbles(b + 2);
}
inline __m256i run(blocks::Q4_1, const uint8_t* b, int, float& a, float& c) {
  a = half(b), c = half(b + 2);
  return nibbles(b + 4);
}
inline __m256i run(blocks::Q5_0, const uint8_t* b, int, float& a, float& c) {
  a = half(b), c = -16.f * a;
  return fives(b + 6, blocks::u32_at(b + 2));
}
inline __m256i run(blocks::Q5_1, const uint8_t* b, int, float& a, float& c) {
  a = half(b), c = half(b + 2);
  return fives(b + 8, blocks::u32_at(b + 4));
}
inline __m256i run(blocks::Q4_K, const uint8_t* b, int s, float& a, float& c) {
  int sc, mn;
  blocks::scale_min_k4(b + 4, s, sc, mn);
  a = half(b) * sc, c = -half(b + 2) * mn;
  const __m256i q = load32(b + 16 + (s / 2) * 32);
  return low4(s & 1 ? _mm256_srli_epi16(q, 4) : q);
}

// Signed runs: w int8, and the scale of each int32 lane of a product
inline __m256i run(blocks::Q8_0, const uint8_t* b, int, __m256& scale) {
  scale = _mm256_set1_ps(half(b));
  return load32(b + 2);
}
inline __m256i run(blocks::Q6_K, const uint8_t* b, int s, __m256& scale) {
  const blocks::Q6_K::Sub u = blocks::Q6_K::sub(b, s);
  const float d = half(b + 208);
  scale = _mm256_set_m128(_mm_set1_ps(d * u.sc[1]), _mm_set1_ps(d * u.sc[0]));
  const __m256i lo = low4(shift_right(load32(u.low), u.low_shift));
  const __m256i hi = _mm256_and_si256(shift_right(load32(u.high), u.high_shift), _mm256_set1_epi8(3));
  return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
}

template <typename B>
constexpr bool is_signed = std::is_same_v<B, blocks::Q8_0> || std::is_same_v<B, blocks::Q6_K>;

// out[r * M + m] = (weight row r of R, `ld` bytes apart, each `runs` runs of 32 in blocks of format B) .
// x's row m, for M rows of x. Each weight row's blocks are read once for all rows of x. A row's
// accumulator adds one block at a time, each add waiting for the last (~4 cycles: at one row of x that,
// not the memory, bounds a 4-bit row's read); R rows side by side overlap R such chains.
template <typename B, int M, int R = 1>
inline void dot_runs(const uint8_t* row, int64_t ld, int64_t runs, const Rows& x, float* out) {
  constexpr int subs = B::values_per / QK;
  __m256 acc[R][M];
  float extra[R][M];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps(), extra[r][m] = 0.f;
  for (int64_t b = 0; b < runs / subs; ++b) {
#pragma GCC unroll 8
    for (int s = 0; s < subs; ++s) {   // unrolled: each run's s a constant, its scales' branches folded
      const int64_t i = b * subs + s;
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const uint8_t* blk = row + r * ld + b * B::bytes;
        if constexpr (is_signed<B>) {
          __m256 scale;
          const __m256i w = run(B(), blk, s, scale);
          const __m256i magnitude = _mm256_sign_epi8(w, w);
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m) {
            const int64_t j = m * runs + i;
            const __m256i sum = _mm256_dpbusd_epi32(_mm256_setzero_si256(), magnitude, _mm256_sign_epi8(x.run(j), w));
            const __m256 scales = _mm256_mul_ps(scale, _mm256_set1_ps(x.d[j]));
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scales, acc[r][m]);
          }
        } else {
          float a, c;
          const __m256i u = run(B(), blk, s, a, c);
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m) {
            const int64_t j = m * runs + i;
            const __m256i sum = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x.run(j));
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(a * x.d[j]), acc[r][m]);
            extra[r][m] += c * x.s[j];
          }
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) out[r * M + m] = total(acc[r][m]) + extra[r][m];
}

// dot_runs's product, by dot_k4 for Q4_K, dot_k6 for Q6_K and dot_nibbles for Q4_0 and Q4_1
template <typename B, int M, int R = 1>
inline void dot(const uint8_t* row, int64_t ld, int64_t runs, const Rows& x, float* out) {
  if constexpr (std::is_same_v<B, blocks::Q4_K>)
    dot_k4<M, R>(row, ld, runs, x, out);
  else if constexpr (std::is_same_v<B, blocks::Q6_K>)
    dot_k6<M, R>(row, ld, runs, x, out);
  else if constexpr (std::is_same_v<B, blocks::Q4_0> || std::is_same_v<B, blocks::Q4_1>)
    dot_nibbles<B, M, R>(row, ld, runs, x, out);
  else
    dot_runs<B, M, R>(row, ld, runs, x, out);
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
