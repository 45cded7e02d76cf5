// int8.h's products on Q4_0 and Q4_1 blocks, 8 blocks a vector of sums (x quantized per 32 values).
// Included by int8.h.
#pragma once
#include "int8_x.h"
#ifdef PF_INT8_DOT

namespace int8dot {

// Lane i: 16 times the sum of lanes 0-3 of s[i] plus the sum of its lanes 4-7
inline __m256i sum8(const __m256i (&s)[8]) {
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
  return _mm256_add_epi32(_mm256_slli_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), 4),
                          _mm256_permute2x128_si256(u0, u1, 0x31));
}

// Field f (0, 1: bytes 2f, 2f + 1) of the first n (<= 8) of 8 blocks `stride` (16-20) bytes apart, float16
// as float32, 0 in lanes n-7: where AVX512-VBMI has it and all 8 are there, one byte permute of two 64-byte
// windows (blocks 0-3 at p, 4-7 at p + 4 stride); else a masked gather (no byte of the blocks past n read)
template <int stride, int f>
inline __m256 halves8(const uint8_t* p, int n) {
  static_assert(stride >= 16 && 3 * stride + 2 * f + 1 < 64);
#ifdef __AVX512VBMI__
  if (n == 8) {
    alignas(64) static constexpr auto index = [] {
      struct { int8_t b[64]; } t{};
      for (int i = 0; i < 16; ++i) t.b[i] = static_cast<int8_t>((i / 8) * 64 + stride * (i / 2 % 4) + 2 * f + i % 2);
      return t;
    }();
    const __m512i both = _mm512_permutex2var_epi8(_mm512_loadu_si512(p), _mm512_load_si512(index.b),
                                                  _mm512_loadu_si512(p + 4 * stride));
    return _mm256_cvtph_ps(_mm512_castsi512_si128(both));
  }
#endif
  const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(stride));
  const __m256i words =
      _mm256_mmask_i32gather_epi32(_mm256_setzero_si256(), static_cast<__mmask8>((1u << n) - 1), at, p + 2 * f, 1);
  return _mm256_cvtph_ps(_mm256_cvtepi32_epi16(words));
}

// x's 8 values per run from run j, 0 past the first n (a masked load reads nothing past them)
template <bool whole, typename T>
inline auto runs8(const T* p, int n) {
  const __mmask8 in = static_cast<__mmask8>((1u << n) - 1);
  if constexpr (std::is_same_v<T, float>)
    return whole ? _mm256_loadu_ps(p) : _mm256_maskz_loadu_ps(in, p);
  else
    return whole ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi32(in, p);
}

// Q4_0's and Q4_1's dot (as int8.h's dot_runs), 8 blocks at a time: each block's 16 bytes in both halves of a
// vector, the low halves' nibbles (values 0-15) masked in lanes 0-3, the high ones (16-31) masked unshifted
// (16 times their value) in lanes 4-7; each block's 8 lanes of vpdpbusd's sums into one int32 lane of a
// vector (sum8: the low lanes times 16, so the block's sum is 16 sum(u * q)); one float conversion and
// scaling (d * dx / 16: exact, a power of two) serve 8 blocks. Q4_0's 8 is taken from every u as -128 sum(q)
// in the same lane; Q4_1's offsets m add m * dx * sum(q) (x.s) in 8 lanes. A last group (runs not a
// multiple of 8) takes its n blocks, zeros in the rest.
template <typename B, int M, int R, bool whole>
inline void nibble_group(const uint8_t* row, int64_t ld, int64_t runs, int64_t b, int n, const Rows& x,
                         __m256 (&acc)[R][M], __m256 (&extra)[R][M]) {
  constexpr bool q40 = std::is_same_v<B, blocks::Q4_0>;
  constexpr int at = q40 ? 2 : 4;   // where the nibbles start
  const __m256i halves = _mm256_set_epi64x(-0x0F0F0F0F0F0F0F10LL, -0x0F0F0F0F0F0F0F10LL, 0x0F0F0F0F0F0F0F0FLL,
                                           0x0F0F0F0F0F0F0F0FLL);   // 0x0F in bytes 0-15, 0xF0 in 16-31
  if constexpr (whole) n = 8;
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const uint8_t* blk = row + r * ld + b * B::bytes;
    __m256i u[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i)
      u[i] = i < n ? _mm256_and_si256(halves, _mm256_broadcastsi128_si256(_mm_loadu_si128(
                                                  reinterpret_cast<const __m128i*>(blk + i * B::bytes + at))))
                   : _mm256_setzero_si256();
    const __m256 d = halves8<B::bytes, 0>(blk, n), mins = q40 ? d : halves8<B::bytes, 1>(blk, n);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const int64_t j = m * runs + b;
      __m256i sums[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i)
        sums[i] = i < n ? _mm256_dpbusd_epi32(_mm256_setzero_si256(), u[i], x.run(j + i)) : _mm256_setzero_si256();
      __m256i total = sum8(sums);
      if constexpr (q40) total = _mm256_sub_epi32(total, _mm256_slli_epi32(runs8<whole>(x.sum.data() + j, n), 7));
      const __m256 dx = _mm256_mul_ps(runs8<whole>(x.d.data() + j, n), _mm256_set1_ps(1.f / 16));
      acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, dx), acc[r][m]);
      if constexpr (!q40)
        extra[r][m] = _mm256_fmadd_ps(mins, runs8<whole>(x.s.data() + j, n), extra[r][m]);
    }
  }
}

template <typename B, int M, int R>
inline void dot_nibbles(const uint8_t* row, int64_t ld, int64_t runs, const Rows& x, float* out) {
  __m256 acc[R][M] = {}, extra[R][M] = {};
  const int64_t whole = runs / 8 * 8;
  for (int64_t b = 0; b < whole; b += 8) nibble_group<B, M, R, true>(row, ld, runs, b, 8, x, acc, extra);
  if (whole < runs)
    nibble_group<B, M, R, false>(row, ld, runs, whole, static_cast<int>(runs - whole), x, acc, extra);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_add_ps(acc[r][m], extra[r][m]);
  totals(acc, out);
}

}  // namespace int8dot
#endif
