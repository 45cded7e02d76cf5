// Products of 4-bit GGUF blocks (Q4_0, Q4_1) with a few rows of activations quantized to int8 per block
// of 32 (llama.cpp's approach, public knowledge): the nibbles and the int8 activations multiplied and
// summed four at a time by AVX512-VNNI's vpdpbusd (on 256-bit vectors: single-pumped on Zen 4), one
// int32 sum vector a block scaled by the two blocks' scales into float32. With the activations' block
// scale dx and q = round(x / dx), a row's dot is sum over blocks of d * dx * sum(nibble * q) plus the
// format's offset term: Q4_0's -8 * d and Q4_1's m, times dx * sum(q). quant.cpp's only includer;
// compiled where the CPU has AVX512-VNNI and AVX512-VL (PF_INT8_DOT), else quant.cpp keeps its float path.
#pragma once
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__F16C__)
#define PF_INT8_DOT 1
#include <immintrin.h>
#include <cstdint>
#include <vector>

namespace int8dot {

constexpr int QK = 32;

inline float half(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Rows of x [M, K] (dense float32) quantized per block of 32: q int8, the block's scale d = max|x| / 127,
// and s = d * sum(q), blocks in x's order (block i at x + i * 32)
struct Rows {
  std::vector<int8_t> q;
  std::vector<float> d, s;

  void quantize(const float* x, int64_t M, int64_t K) {
    const int64_t blocks = M * K / QK;
    q.resize(M * K);
    d.resize(blocks);
    s.resize(blocks);
    for (int64_t i = 0; i < blocks; ++i) {
      const __m512 a = _mm512_loadu_ps(x + i * QK), b = _mm512_loadu_ps(x + i * QK + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data() + i * QK), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data() + i * QK + 16), _mm512_cvtsepi32_epi8(qb));
      d[i] = amax / 127.f;
      s[i] = d[i] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
    }
  }
};

// out[m] = (one weight row of nb blocks of `bytes`, nibbles at `qoff`) . x's row m, for M rows of x;
// offset(block, d): the format's additive term a unit of x's block sum carries
template <int M, typename Offset>
inline void dot(const uint8_t* row, int64_t nb, int64_t bytes, int64_t qoff, const Rows& x, float* out,
                Offset offset) {
  __m256 acc[M];
  float extra[M];
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps(), extra[m] = 0.f;
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * bytes;
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + qoff));
    const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
    const float dw = half(blk), off = offset(blk, dw);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const int64_t i = m * nb + b;
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + i * QK));
      const __m256i sum = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, xq);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(dw * x.d[i]), acc[m]);
      extra[m] += off * x.s[i];
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
    const __m128 q2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
    out[m] = _mm_cvtss_f32(_mm_add_ss(q2, _mm_movehdup_ps(q2))) + extra[m];
  }
}

}  // namespace int8dot
#endif
