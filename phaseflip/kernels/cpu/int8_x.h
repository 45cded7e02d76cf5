// Activations for int8.h's products: rows of x quantized to int8 per block of the weights' format (Rows),
// and the vector pieces every form of the products shares (a block's nibbles, the integer dots, lane
// totals). Included by int8.h, compiled where it is (PF_INT8_DOT: AVX2, FMA and F16C, every x86-64 of the
// last decade); PF_INT8_VNNI where AVX512-VNNI's vpdpbusd sums u8 x s8 products four at a time into int32,
// else AVX2's vpmaddubsw sums them in pairs into int16, which saturates past 32767 (each format keeps its u
// small enough: int8_groups.h's Group::low, int8_wide.h's signed_bytes), and vpmaddwd adds the pairs into
// int32.
#pragma once
#include "blocks.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PF_INT8_DOT 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define PF_INT8_VNNI 1
#endif
#if !defined(PF_INT8_VNNI) && !defined(__AVXVNNI__)
#define PF_INT8_PAIRS 1   // no vpdpbusd: a u8 x s8 dot is vpmaddubsw's int16 pairs, then vpmaddwd
#endif
#include <immintrin.h>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace int8dot {

using blocks::half_at;
using blocks::QK;

// the sum of v's 8 int32 lanes
inline int32_t lane_sum(__m256i v) {
  const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i q2 = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
  return _mm_cvtsi128_si32(_mm_add_epi32(q2, _mm_shuffle_epi32(q2, 1)));
}

// max |x[i]| over n (a multiple of 16) values
inline float abs_max(const float* x, int64_t n) {
  pf::vf top = pf::zero();
  for (int64_t v = 0; v < n; v += pf::LANES) {
    const pf::vf a = pf::load(x + v);
    top = pf::max(top, pf::max(a, pf::sub(pf::zero(), a)));
  }
  return pf::max_lane(top);
}

// 32 values of x times inv rounded to int8 (|x| * inv <= 127) into q; half[h]: the sum of values 16h-16h+15
inline void quantize_run(const float* x, float inv, int8_t* q, int32_t (&half)[2]) {
  const __m256 scale = _mm256_set1_ps(inv);
  __m256i v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), scale));
  half[0] = lane_sum(_mm256_add_epi32(v[0], v[1]));
  half[1] = lane_sum(_mm256_add_epi32(v[2], v[3]));
  // the packs work within 128-bit halves: their dwords hold values 0-3, 8-11, 16-19, 24-27, 4-7, 12-15, ...
  const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  const __m256i order = _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), order);
}

// Rows of x [M, K] (dense float32) quantized per `group` values (32, or 256 for the K formats; K a multiple
// of it): q int8, the group's scale max|x| / 127 as d of each of its runs of 32, s = d * sum(q) per run,
// runs in x's order (run i at x + i * 32); for what each format's dot adds from x's sums, per 32-value
// group sum (the integer offsets of Q4_0 and Q5_0), per 256-value group sum16 (Q6_K)
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
      const float amax = abs_max(x + g * QK, per * QK);
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int64_t i = g; i < g + per; ++i) {
        int32_t half[2];
        quantize_run(x + i * QK, inv, q.data() + i * QK, half);
        d[i] = amax / 127.f;
        if (per == 1) {
          sum[i] = half[0] + half[1];
          s[i] = d[i] * static_cast<float>(sum[i]);
        } else {
          sum16[2 * i] = static_cast<int16_t>(half[0]);
          sum16[2 * i + 1] = static_cast<int16_t>(half[1]);
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
  return low4(_mm256_srlv_epi64(both, _mm256_set_epi64x(4, 4, 0, 0)));
}

// 0x10 in byte j where bit j of `bits` is set, else 0
inline __m256i bit4(uint32_t bits) {
#ifdef PF_INT8_VNNI
  return _mm256_and_si256(_mm256_movm_epi8(bits), _mm256_set1_epi8(0x10));
#else
  // byte j of the 32 bits into byte j of the vector, then each byte's own bit kept and compared
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                             _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                                                0x0303030303030303LL));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
#endif
}

// Q5's values: nibbles plus bit 4 from the 32 fifth bits (bit j: value j's)
inline __m256i fives(const uint8_t* q, uint32_t bits) { return _mm256_or_si256(nibbles(q), bit4(bits)); }

// acc + the sums of u[i] * s[i] (u8 x s8) four at a time in 8 int32 lanes: vpdpbusd where the CPU has
// AVX512-VNNI, or AVX-VNNI (its VEX form, Intel's client cores without AVX-512: the same sums, so the AVX2
// code around it keeps its limits); else each pair's sum must fit int16 (vpmaddubsw saturates): |u| * 127 *
// 2 <= 32767, u <= 128
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#ifdef PF_INT8_VNNI
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// acc + the sums of a[i] * b[i] (s16 x s16) in pairs in 8 int32 lanes
inline __m256i dpwssd(__m256i acc, __m256i a, __m256i b) {
#ifdef PF_INT8_VNNI
  return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

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

}  // namespace int8dot
#endif
