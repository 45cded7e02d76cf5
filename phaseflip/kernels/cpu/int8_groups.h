// int8.h's products on the 4- and 5-bit 32-value formats' blocks (Q4_0, Q4_1, Q5_0, Q5_1), 8 blocks a
// vector of sums (x quantized per 32 values).
// Included by int8.h.
#pragma once
#include <bit>
#include "int8_x.h"
#ifdef PF_INT8_DOT

namespace int8dot {

// all ones in lanes 0 to n - 1 (n <= 8), zeros above: a mask for AVX2's masked loads and gathers
inline __m256i first(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Lane i: the sum of s[i]'s lanes, lanes 0-3 shifted left by `low` bits first
template <int low>
inline __m256i sum8(const __m256i (&s)[8]) {
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
  return _mm256_add_epi32(_mm256_slli_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), low),
                          _mm256_permute2x128_si256(u0, u1, 0x31));
}

#ifdef __AVX512VBMI__
// Bytes 2f and 2f + 1 of 4 blocks `stride` bytes apart at p, from the 128 bytes at w (the low 8 bytes)
template <int stride, int f>
inline __m128i halves4(const uint8_t* p, const uint8_t* w) {
  alignas(64) static constexpr auto index = [] {
    struct { int8_t b[64]; } t{};
    for (int i = 0; i < 8; ++i) t.b[i] = static_cast<int8_t>(stride * (i / 2) + 2 * f + i % 2);
    return t;
  }();
  const __m512i shift = _mm512_add_epi8(_mm512_load_si512(index.b), _mm512_set1_epi8(static_cast<char>(p - w)));
  return _mm512_castsi512_si128(_mm512_permutex2var_epi8(_mm512_loadu_si512(w), shift, _mm512_loadu_si512(w + 64)));
}
#endif

// Field f (bytes 2f, 2f + 1: a float16) of the first n (<= 8) of 8 blocks `stride` (16-42) bytes apart at p,
// as float32, 0 in lanes n-7: where AVX512-VBMI has it and all 8 are there, byte permutes of windows inside
// the 8 blocks (blocks 0-3 from the 128 bytes at p, 4-7 from the 128 that end the blocks, or start at block
// 4 where the blocks are longer); else a masked gather (no byte of the blocks past n read)
template <int stride, int f>
inline __m256 halves8(const uint8_t* p, int n) {
  static_assert(stride >= 16 && 3 * stride + 2 * f + 1 < 128);
#ifdef __AVX512VBMI__
  if (n == 8 && 3 * stride + 2 * f + 1 < 64) {   // blocks 0-3 in the 64 bytes at p, 4-7 in those at block 4
    alignas(64) static constexpr auto index = [] {
      struct { int8_t b[64]; } t{};
      for (int i = 0; i < 16; ++i) t.b[i] = static_cast<int8_t>((i / 8) * 64 + stride * (i / 2 % 4) + 2 * f + i % 2);
      return t;
    }();
    const __m512i both = _mm512_permutex2var_epi8(_mm512_loadu_si512(p), _mm512_load_si512(index.b),
                                                  _mm512_loadu_si512(p + 4 * stride));
    return _mm256_cvtph_ps(_mm512_castsi512_si128(both));
  }
  if (n == 8) {
    const uint8_t* back = p + (stride <= 32 ? 8 * stride - 128 : 4 * stride);
    const __m128i lo = halves4<stride, f>(p, p), hi = halves4<stride, f>(p + 4 * stride, back);
    return _mm256_cvtph_ps(_mm_unpacklo_epi64(lo, hi));
  }
#endif
  const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(stride));
  const __m256i words = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), reinterpret_cast<const int*>(p + 2 * f),
                                                    at, first(n), 1);
  // each word's low 16 bits: bytes 0-1, 4-5, 8-9, 12-13 of each half, then the halves' low 8 bytes together
  const __m256i low16 = _mm256_shuffle_epi8(
      words, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9, 12, 13, -1,
                              -1, -1, -1, -1, -1, -1, -1));
  return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(low16, 0b1000)));
}

// The values of x for 8 runs from p (one a run), 0 past the first n (a masked load reads nothing past them)
template <bool whole, typename T>
inline auto runs8(const T* p, int n) {
  if constexpr (std::is_same_v<T, float>)
    return whole ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first(n));
  else
    return whole ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                 : _mm256_maskload_epi32(reinterpret_cast<const int*>(p), first(n));
}

// What a 4- or 5-bit format gives the grouped dot: the shift of its lanes 0-3 (4: with VNNI, Q4's high
// nibbles are read unshifted, 16 times their value; AVX2's int16 pairs cannot hold 2 * 240 * 127), its
// integer offset (w = d * (u - offset)) or an fp16 m (w = d * u + m) at byte 2
template <typename B>
struct Group {
  static constexpr bool q4 = std::is_same_v<B, blocks::Q4_0> || std::is_same_v<B, blocks::Q4_1>;
#ifdef PF_INT8_VNNI
  static constexpr int low = q4 ? 4 : 0;
#else
  static constexpr int low = 0;
#endif
  static constexpr int offset = std::is_same_v<B, blocks::Q4_0> ? 8 : std::is_same_v<B, blocks::Q5_0> ? 16 : 0;
  static constexpr bool m = std::is_same_v<B, blocks::Q4_1> || std::is_same_v<B, blocks::Q5_1>;
};

// Block b's unsigned bytes u for vpdpbusd
template <typename B>
inline __m256i unsigned_bytes(const uint8_t* b) {
  const __m256i halves = _mm256_set_epi64x(-0x0F0F0F0F0F0F0F10LL, -0x0F0F0F0F0F0F0F10LL, 0x0F0F0F0F0F0F0F0FLL,
                                           0x0F0F0F0F0F0F0F0FLL);   // 0x0F in bytes 0-15, 0xF0 in 16-31
  const auto both = [&](const uint8_t* q) {
    return _mm256_and_si256(halves, _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  };
  if constexpr (std::is_same_v<B, blocks::Q4_0>) return Group<B>::low ? both(b + 2) : nibbles(b + 2);
  if constexpr (std::is_same_v<B, blocks::Q4_1>) return Group<B>::low ? both(b + 4) : nibbles(b + 4);
  if constexpr (std::is_same_v<B, blocks::Q5_0>) return fives(b + 6, blocks::u32_at(b + 2));
  if constexpr (std::is_same_v<B, blocks::Q5_1>) return fives(b + 8, blocks::u32_at(b + 4));
}

// The dot of a 4- or 5-bit format's rows (as int8.h's dot), 8 blocks at a time: each block's vpdpbusd
// sums (8 lanes) into one int32 lane of a vector (sum8), so one float conversion and scaling (d * dx) serve
// 8 blocks. Q4's blocks: their 16 bytes in both halves of a vector, the low nibbles (values 0-15) masked in
// lanes 0-3, the high ones (16-31) masked unshifted (16 times their value) in lanes 4-7; the low lanes' sum
// counted 16 times too and dx / 16 (exact: a power of two). An integer offset comes off each block's sum as
// offset * sum(q) (x.sum, times 16 for Q4); an m adds m * dx * sum(q) (x.s) in 8 lanes. A last group (runs
// not a multiple of 8) takes its n blocks, zeros in the rest.
template <typename B, int M, int R, bool whole>
inline void group(const uint8_t* row, int64_t ld, int64_t runs, int64_t b, int n, const Rows& x,
                  __m256 (&acc)[R][M], __m256 (&extra)[R][M]) {
  using G = Group<B>;
  if constexpr (whole) n = 8;
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const uint8_t* blk = row + r * ld + b * B::bytes;
    if constexpr (whole) pf::prefetch_ahead<8 * B::bytes>(blk);
    __m256i u[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) u[i] = i < n ? unsigned_bytes<B>(blk + i * B::bytes) : _mm256_setzero_si256();
    const __m256 d = halves8<B::bytes, 0>(blk, n);
    [[maybe_unused]] __m256 mins;
    if constexpr (G::m) mins = halves8<B::bytes, 1>(blk, n);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const int64_t j = m * runs + b;
      __m256i sums[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i)
        sums[i] = i < n ? dpbusd(_mm256_setzero_si256(), u[i], x.run(j + i)) : _mm256_setzero_si256();
      __m256i total = sum8<G::low>(sums);
      if constexpr (G::offset != 0)   // a power of two
        total = _mm256_sub_epi32(total, _mm256_slli_epi32(runs8<whole>(x.sum.data() + j, n),
                                                          std::countr_zero(unsigned(G::offset)) + G::low));
      const __m256 dx = _mm256_mul_ps(runs8<whole>(x.d.data() + j, n), _mm256_set1_ps(1.f / (1 << G::low)));
      acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, dx), acc[r][m]);
      if constexpr (G::m) extra[r][m] = _mm256_fmadd_ps(mins, runs8<whole>(x.s.data() + j, n), extra[r][m]);
    }
  }
}

template <typename B, int M, int R>
inline void dot_groups(const uint8_t* row, int64_t ld, int64_t runs, const Rows& x, float* out) {
  __m256 acc[R][M] = {}, extra[R][M] = {};
  const int64_t whole = runs / 8 * 8;
  for (int64_t b = 0; b < whole; b += 8) group<B, M, R, true>(row, ld, runs, b, 8, x, acc, extra);
  if (whole < runs) group<B, M, R, false>(row, ld, runs, whole, static_cast<int>(runs - whole), x, acc, extra);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_add_ps(acc[r][m], extra[r][m]);
  totals(acc, out);
}

// Whether the 4- and 5-bit formats' dot takes a block at a time (dot_blocks) for a few rows of x: on AVX2,
// where the grouped form's 8 sums and horizontal adds spill out of the 16 vector registers and its scales
// take a gather (faster up to 6 rows of x, slower at 8: docs/performance.md); with VNNI the grouped form
// (its scales by byte permutes where there is VBMI)
#ifdef PF_INT8_VNNI
constexpr bool BLOCK_AT_A_TIME = false;
#else
constexpr bool BLOCK_AT_A_TIME = true;
#endif

// The dot of a 4- or 5-bit format's rows (as int8.h's dot), a block at a time: each block's u8 x s8 products
// summed in 8 int32 lanes (dpbusd), converted and scaled by d * dx; the
// offset or m term c * dx * sum(q) (x.s) as one scalar FMA a block, c = -offset * d or m
template <typename B, int M, int R>
inline void dot_blocks(const uint8_t* row, int64_t ld, int64_t runs, const Rows& x, float* out) {
  using G = Group<B>;
  static_assert(G::low == 0, "the block's u as its values");
  __m256 acc[R][M] = {};
  float extra[R][M] = {};
  for (int64_t b = 0; b < runs; ++b) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = row + r * ld + b * B::bytes;
      const __m256i u = unsigned_bytes<B>(blk);
      const float d = half_at(blk);
      const float c = G::m ? half_at(blk + 2) : -G::offset * d;
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const int64_t j = m * runs + b;
        const __m256i sum = dpbusd(_mm256_setzero_si256(), u, x.run(j));
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d * x.d[j]), acc[r][m]);
        extra[r][m] += c * x.s[j];
      }
    }
  }
  totals(acc, out);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) out[r * M + m] += extra[r][m];
}

}  // namespace int8dot
#endif
