// Activations for int8.h's products: rows of x quantized to int8 per block of the weights' format (Rows),
// and the vector pieces every form of the products shares (a block's nibbles, lane totals). Included by
// int8.h, compiled where it is (PF_INT8_DOT).
#pragma once
#include "blocks.h"
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(__F16C__)
#define PF_INT8_DOT 1
#include <immintrin.h>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace int8dot {

using blocks::half_at;
using blocks::QK;

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
