// Products of GGUF blocks (blocks.h) with a few rows of activations quantized to int8 per block of the
// weights' format, 32 or 256 values (llama.cpp's approach, public knowledge: its Q8_0 and Q8_K):
// AVX512-VNNI's vpdpbusd multiplies 32 unsigned bytes by 32 signed ones and sums them four at a time into
// 8 int32 lanes (256-bit vectors: single-pumped on Zen 4), which a run's scales turn into float32. With
// x's scale dx and q = round(x / dx):
// - most formats give each run's weights as w = a * u + c, u unsigned (< 64): the run's dot is
//   a * dx * sum(u * q) + c * dx * sum(q) (Q4_1, Q5_0, Q5_1: a block);
// - Q4_0's -8 goes into the integer sum instead (-8 sum(q), x.sum), 8 blocks' sums in the lanes of one
//   vector that d * dx scales (dot_q40);
// - Q4_K's runs share dx (one per 256 values): each run's u8 x s8 products summed in int16 pairs times the
//   run's 6-bit scale add up in int32 across the block, one float conversion a block (dot_k4);
// - Q6_K's runs share dx too: each run's unsigned 6-bit q times x in int16 pairs times the int8 scale of
//   its 16 values, in int32 across the block, the 32 taken from every q through x's sums per 16 (dot_k6);
// - Q8_0 (and Q6_K in int8_wide.h) give signed w (Q6_K's q - 32) and a scale for each 16 values:
//   sum(|w| * sign(w) q) per lane, times its lane's scale (lanes 0-3 hold values 0-15, 4-7 values 16-31).
// A weight row's blocks are read once for all rows of x. Included by qrow.h and quant.cpp; compiled where the
// CPU has AVX512-VNNI, -VL and -BW (PF_INT8_DOT), else quant.cpp keeps its float32 paths.
#pragma once
#include "blocks.h"
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(__F16C__)
#define PF_INT8_DOT 1
#include <immintrin.h>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace int8dot {

using blocks::QK;

inline float half(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Rows of x [M, K] (dense float32) quantized per `group` values (32, or 256 for the K formats; K a multiple
// of it): q int8, the group's scale max|x| / 127 as d of each of its runs of 32, s = d * sum(q) per run,
// runs in x's order (run i at x + i * 32); for what each format's dot adds from x's sums, per 32-value
// group sum (Q4_0), per 256-value group sum16 (Q6_K)
struct Rows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sum;     // per run: the sum of q
  std::vector<int16_t> sum16;   // per 16 values: the sum of q
  int64_t group = QK;

  void quantize(const float* x, int64_t M, int64_t K, int64_t values) {
    const int64_t runs = M * K / QK, per = values / QK;
    group = values;
    q.resize(M * K);
    d.resize(runs);
    s.resize(runs);
    (per == 1 ? sum.resize(runs) : sum16.resize(2 * runs));
    for (int64_t g = 0; g < runs; g += per) {
      __m512 top = _mm512_setzero_ps();
      for (int64_t v = g * QK; v < (g + per) * QK; v += 16)
        top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(x + v)));
      const float amax = _mm512_reduce_max_ps(top);
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      for (int64_t i = g; i < g + per; ++i) {
        const __m512 a = _mm512_loadu_ps(x + i * QK), b = _mm512_loadu_ps(x + i * QK + 16);
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data() + i * QK), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data() + i * QK + 16), _mm512_cvtsepi32_epi8(qb));
        d[i] = amax / 127.f;
        if (per == 1) {
          sum[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
          s[i] = d[i] * static_cast<float>(sum[i]);
        } else {
          sum16[2 * i] = static_cast<int16_t>(_mm512_reduce_add_epi32(qa));
          sum16[2 * i + 1] = static_cast<int16_t>(_mm512_reduce_add_epi32(qb));
          s[i] = d[i] * static_cast<float>(sum16[2 * i] + sum16[2 * i + 1]);
        }
      }
    }
  }

  __m256i run(int64_t j) const { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.data() + j * QK)); }
};

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline __m256i shift_right(__m256i v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }  // then mask

// a 32-value block's 16 bytes of nibbles in value order: low halves are values 0-15, high halves 16-31 (one
// load into both halves of the vector, the high one's 16-bit lanes shifted by 4, then a mask)
inline __m256i nibbles(const uint8_t* q) {
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m256i shift = _mm256_set_epi64x(0x0004000400040004, 0x0004000400040004, 0, 0);
  return low4(_mm256_srlv_epi16(both, shift));
}

// Q5's values: nibbles plus bit 4 from the 32 fifth bits (bit j: value j's)
inline __m256i fives(const uint8_t* q, uint32_t bits) {
  return _mm256_or_si256(nibbles(q), _mm256_and_si256(_mm256_movm_epi8(bits), _mm256_set1_epi8(0x10)));
}

// Unsigned runs: u, with w = a * u + c
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

inline float total(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q2, _mm_movehdup_ps(q2)));
}

// out[r * M + m] = the sum of acc[r][m]'s lanes
template <int R, int M>
inline void totals(const __m256 (&acc)[R][M], float* out) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) out[r * M + m] = total(acc[r][m]);
}

// Q4_K's 6-bit scales sc and mins mn of block b's 8 runs as 8 bytes each (byte s: run s's), from its 12 bytes
// as three 32-bit words, four runs' values a word (what scale_min_k4 takes one at a time)
inline void k4_bytes(const uint8_t* b, uint64_t& sc, uint64_t& mn) {
  uint32_t u[3];
  __builtin_memcpy(u, b + 4, 12);
  constexpr uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
  sc = (u[0] & six) | uint64_t((u[2] & four) | (((u[0] >> 6) & two) << 4)) << 32;
  mn = (u[1] & six) | uint64_t(((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4)) << 32;
}

// Q4_K's dot (as dot_runs below) with x quantized per 256 (x.d the same over a block's 8 runs): each run's
// u8 x s8 products summed in pairs (int16), times its 6-bit scale and summed in int32 across the block's 8
// runs; one float conversion and FMA a block (d * dx), the offsets' term as one 8-lane FMA a block
template <int M, int R>
inline void dot_k4(const uint8_t* row, int64_t ld, int64_t runs, const Rows& x, float* out) {
  __m256 acc[R][M] = {}, extra[R][M] = {};
  for (int64_t b = 0; b < runs / 8; ++b) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = row + r * ld + b * blocks::Q4_K::bytes;
      uint64_t sc, mn;
      k4_bytes(blk, sc, mn);
      const __m256i s32 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(sc)));
      alignas(32) int32_t pair[8];   // run s's scale in both int16 halves of a 32-bit word
      _mm256_store_si256(reinterpret_cast<__m256i*>(pair), _mm256_or_si256(s32, _mm256_slli_epi32(s32, 16)));
      const __m256i m32 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mn)));
      const __m256 offset = _mm256_mul_ps(_mm256_set1_ps(-half(blk + 2)), _mm256_cvtepi32_ps(m32));
      const float d = half(blk);
      __m256i isum[M][2];
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
        const __m256i q = load32(blk + 16 + (s / 2) * 32);
        const __m256i u = low4(s & 1 ? _mm256_srli_epi16(q, 4) : q);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m)
          isum[m][s & 1] = _mm256_dpwssd_epi32(isum[m][s & 1], _mm256_maddubs_epi16(u, x.run(m * runs + b * 8 + s)),
                                               _mm256_set1_epi32(pair[s]));
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
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
      __m256i pairs[2];   // scale g (of values 16g .. 16g + 15) in both int16 halves of word g % 8
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_cvtepi8_epi32(h ? _mm_srli_si128(sc, 8) : sc);
        pairs[h] = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
      }
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc);
      const float d = half(blk + 208);
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
              _mm256_dpwssd_epi32(isum[m][s & 1], _mm256_maddubs_epi16(u, x.run(m * runs + b * 8 + s)), scale);
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

// Lane i: 16 times the sum of lanes 0-3 of s[i] plus the sum of its lanes 4-7
inline __m256i sum8(const __m256i (&s)[8]) {
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
  return _mm256_add_epi32(_mm256_slli_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), 4),
                          _mm256_permute2x128_si256(u0, u1, 0x31));
}

// The float16 scales at the start of the first n (<= 8) of 8 blocks `stride` bytes apart, as float32, 0 in
// lanes n-7: a byte permute of the blocks' first 128 bytes where AVX512-VBMI has it and all 8 are there,
// else a masked gather (which reads no byte of the blocks past n)
template <int stride>
inline __m256 scales8(const uint8_t* p, int n) {
#ifdef __AVX512VBMI__
  if (n == 8 && 7 * stride + 1 < 128) {
    alignas(64) static constexpr auto index = [] {
      struct { int8_t b[64]; } t{};
      for (int i = 0; i < 16; ++i) t.b[i] = static_cast<int8_t>(stride * (i / 2) + i % 2);
      return t;
    }();
    const __m512i both = _mm512_permutex2var_epi8(_mm512_loadu_si512(p), _mm512_load_si512(index.b),
                                                  _mm512_loadu_si512(p + 64));
    return _mm256_cvtph_ps(_mm512_castsi512_si128(both));
  }
#endif
  const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(stride));
  const __mmask8 in = static_cast<__mmask8>((1u << n) - 1);
  const __m256i words = _mm256_mmask_i32gather_epi32(_mm256_setzero_si256(), in, at, p, 1);
  return _mm256_cvtph_ps(_mm256_cvtepi32_epi16(words));
}

// Q4_0's dot (as dot_runs below), 8 blocks at a time: each block's 16 bytes in both halves of a vector, the
// low halves' nibbles (values 0-15) masked in lanes 0-3, the high ones (16-31) masked unshifted (16 times
// their value) in lanes 4-7; each block's 8 lanes of vpdpbusd's sums into one int32 lane of a vector
// (sum8: the low lanes times 16, so the block's sum is 16 sum(u * q)), the 8 taken from every u as
// -128 sum(q) in the same lane; one float conversion and scaling (d * dx / 16: exact, a power of two)
// serve 8 blocks. The last group (runs not a multiple of 8) takes its n blocks, zeros in the rest.
template <int M, int R, bool whole>
inline void q40_group(const uint8_t* row, int64_t ld, int64_t runs, int64_t b, int n, const Rows& x,
                      __m256 (&acc)[R][M]) {
  using B = blocks::Q4_0;
  const __m256i halves = _mm256_set_epi64x(-0x0F0F0F0F0F0F0F10LL, -0x0F0F0F0F0F0F0F10LL, 0x0F0F0F0F0F0F0F0FLL,
                                           0x0F0F0F0F0F0F0F0FLL);   // 0x0F in bytes 0-15, 0xF0 in 16-31
  if constexpr (whole) n = 8;
  const __mmask8 in = static_cast<__mmask8>((1u << n) - 1);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const uint8_t* blk = row + r * ld + b * B::bytes;
    __m256i u[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i)
      u[i] = i < n ? _mm256_and_si256(halves, _mm256_broadcastsi128_si256(_mm_loadu_si128(
                                                  reinterpret_cast<const __m128i*>(blk + i * B::bytes + 2))))
                   : _mm256_setzero_si256();
    const __m256 d = scales8<B::bytes>(blk, n);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const int64_t j = m * runs + b;
      __m256i sums[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i)
        sums[i] = i < n ? _mm256_dpbusd_epi32(_mm256_setzero_si256(), u[i], x.run(j + i)) : _mm256_setzero_si256();
      const __m256i qsum = whole ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sum.data() + j))
                                 : _mm256_maskz_loadu_epi32(in, x.sum.data() + j);
      const __m256i total = _mm256_sub_epi32(sum8(sums), _mm256_slli_epi32(qsum, 7));
      const __m256 dx = whole ? _mm256_loadu_ps(x.d.data() + j) : _mm256_maskz_loadu_ps(in, x.d.data() + j);
      acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_mul_ps(dx, _mm256_set1_ps(1.f / 16))),
                                  acc[r][m]);
    }
  }
}

template <int M, int R>
inline void dot_q40(const uint8_t* row, int64_t ld, int64_t runs, const Rows& x, float* out) {
  __m256 acc[R][M] = {};
  const int64_t whole = runs / 8 * 8;
  for (int64_t b = 0; b < whole; b += 8) q40_group<M, R, true>(row, ld, runs, b, 8, x, acc);
  if (whole < runs) q40_group<M, R, false>(row, ld, runs, whole, static_cast<int>(runs - whole), x, acc);
  totals(acc, out);
}

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

// dot_runs's product, by dot_k4 for Q4_K and dot_k6 for Q6_K
template <typename B, int M, int R = 1>
inline void dot(const uint8_t* row, int64_t ld, int64_t runs, const Rows& x, float* out) {
  if constexpr (std::is_same_v<B, blocks::Q4_K>)
    dot_k4<M, R>(row, ld, runs, x, out);
  else if constexpr (std::is_same_v<B, blocks::Q6_K>)
    dot_k6<M, R>(row, ld, runs, x, out);
  else if constexpr (std::is_same_v<B, blocks::Q4_0>)
    dot_q40<M, R>(row, ld, runs, x, out);
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
