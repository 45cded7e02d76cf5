// int8.h's products on the K formats' blocks (Q4_K, Q6_K), x quantized per 256 values (one dx a block).
// Included by int8.h.
#pragma once
#include "int8_x.h"
#ifdef PF_INT8_DOT

namespace int8dot {

// Q4_K's 6-bit scales sc and mins mn of block b's 8 runs as 8 bytes each (byte s: run s's), from its 12 bytes
// as three 32-bit words, four runs' values a word (what scale_min_k4 takes one at a time)
inline void k4_bytes(const uint8_t* b, uint64_t& sc, uint64_t& mn) {
  uint32_t u[3];
  __builtin_memcpy(u, b + 4, 12);
  constexpr uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
  sc = (u[0] & six) | uint64_t((u[2] & four) | (((u[0] >> 6) & two) << 4)) << 32;
  mn = (u[1] & six) | uint64_t(((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4)) << 32;
}

// Q4_K's dot (as int8.h's dot) with x quantized per 256 (x.d the same over a block's 8 runs): each run's
// u8 x s8 products summed in pairs (int16), times its 6-bit scale and summed in int32 across the block's 8
// runs; one float conversion and FMA a block (d * dx), the offsets' term as one 8-lane FMA a block
template <int M, int R>
inline void dot_k4(const uint8_t* row, int64_t ld, int64_t runs, const Rows& x, float* out) {
  __m256 acc[R][M] = {}, extra[R][M] = {};
  for (int64_t b = 0; b < runs / 8; ++b) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = row + r * ld + b * blocks::Q4_K::bytes;
      pf::prefetch_ahead<blocks::Q4_K::bytes>(blk);
      uint64_t sc, mn;
      k4_bytes(blk, sc, mn);
      const __m256i s32 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(sc)));
      // run s's scale in both int16 halves of word s
      const __m256i pair = _mm256_or_si256(s32, _mm256_slli_epi32(s32, 16));
      const __m256i m32 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mn)));
      const __m256 offset = _mm256_mul_ps(_mm256_set1_ps(-half_at(blk + 2)), _mm256_cvtepi32_ps(m32));
      const float d = half_at(blk);
      __m256i isum[M][2];
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
        const __m256i q = load32(blk + 16 + (s / 2) * 32);
        const __m256i u = low4(s & 1 ? _mm256_srli_epi16(q, 4) : q);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m)
          isum[m][s & 1] = dpwssd(isum[m][s & 1], _mm256_maddubs_epi16(u, x.run(m * runs + b * 8 + s)),
                                               _mm256_permutevar8x32_epi32(pair, _mm256_set1_epi32(s)));
      }
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const int64_t j = m * runs + b * 8;
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(isum[m][0], isum[m][1])),
                                    _mm256_set1_ps(d * x.d[j]), acc[r][m]);
        extra[r][m] = _mm256_fmadd_ps(offset, _mm256_loadu_ps(x.s.data() + j), extra[r][m]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_add_ps(acc[r][m], extra[r][m]);
  totals(acc, out);
}

// Q6_K's dot with x quantized per 256 (x.d the same over a block's 8 runs): each run's unsigned 6-bit q
// times x summed in int16 pairs, times the int8 scale of its 16 values (lanes 0-3 and 4-7 of the int32
// sums), summed in int32 across the block; the 32 taken from every q as -32 * sc * sum(x's q) for each
// 16 values (x.sum16) at the block's end; one float conversion and FMA a block (d * dx)
template <int M, int R>
inline void dot_k6(const uint8_t* row, int64_t ld, int64_t runs, const Rows& x, float* out) {
  __m256 acc[R][M] = {};
  const __m256i low = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  for (int64_t b = 0; b < runs / 8; ++b) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = row + r * ld + b * blocks::Q6_K::bytes;
      pf::prefetch_ahead<blocks::Q6_K::bytes>(blk);
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
      __m256i pairs[2];   // scale g (of values 16g .. 16g + 15) in both int16 halves of word g % 8
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_cvtepi8_epi32(h ? _mm_srli_si128(sc, 8) : sc);
        pairs[h] = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
      }
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc);
      const float d = half_at(blk + 208);
      __m256i isum[M][2];
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
        const blocks::Q6_K::Sub sub = blocks::Q6_K::sub(blk, s);
        const int t = s % 4;
        const __m256i lo = _mm256_and_si256(shift_right(load32(sub.low), sub.low_shift), low);
        const __m256i h = load32(sub.high);   // bit pair t at bits 4-5
        const __m256i hi =
            _mm256_and_si256(t < 2 ? _mm256_slli_epi16(h, 4 - 2 * t) : _mm256_srli_epi16(h, 2 * t - 4), bits45);
        const __m256i u = _mm256_or_si256(lo, hi);
        const __m256i scale = _mm256_permutevar8x32_epi32(
            pairs[s / 4], _mm256_set_epi32(2 * t + 1, 2 * t + 1, 2 * t + 1, 2 * t + 1, 2 * t, 2 * t, 2 * t, 2 * t));
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m)
          isum[m][s & 1] =
              dpwssd(isum[m][s & 1], _mm256_maddubs_epi16(u, x.run(m * runs + b * 8 + s)), scale);
      }
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const int64_t j = m * runs + b * 8;
        const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sum16.data() + 2 * j));
        const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16, sums), 5);
        const __m256i sum = _mm256_sub_epi32(_mm256_add_epi32(isum[m][0], isum[m][1]), offset);
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d * x.d[j]), acc[r][m]);
      }
    }
  }
  totals(acc, out);
}

}  // namespace int8dot
#endif
