// The float32 vector the CPU kernels compute in, one set of names for
// the two instruction sets they are written for: AVX-512 (F + BW: 16 lanes, masked loads) and AVX2 + FMA
// (8 lanes; a short tail is copied into a zeroed vector, AVX2 has no mask registers). Where the CPU has
// neither, PF_LANES stays undefined and the kernels run their plain loops. bfloat16 values are widened
// to float32 on load (a bf16 is the top half of a float32).
#pragma once
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PF_LANES 16
#ifdef __AVX512BF16__
#define PF_BF16_DOT 1   // the bf16 pair-dot instruction (vdpbf16ps)
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PF_LANES 8
#endif

#ifdef PF_LANES
namespace pf {

constexpr int64_t LANES = PF_LANES;

// How far ahead of its reads a product of a few rows of x asks for a weight stream's next bytes: one
// core's hardware prefetchers keep too few cache misses in flight for a decode step's stream of weights
// (latency-bound, well under the memory's bandwidth), and 1 KiB ahead in each stream covers the latency
// (docs/performance.md, "A decode step's weights prefetched"). A prefetch past the weights' end is harmless.
constexpr int64_t PREFETCH_AHEAD = 1024;

// Prefetch the `bytes` bytes PREFETCH_AHEAD past p, a cache line at a time
template <int64_t bytes>
inline void prefetch_ahead(const void* p) {
  const char* at = static_cast<const char*>(p) + PREFETCH_AHEAD;
#pragma GCC unroll 8
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(at + o, _MM_HINT_T0);
}

// 8 vectors of 8 32-bit lanes transposed in place: r[k]'s lane i becomes r[i]'s lane k (bit patterns kept:
// the integer kernels pass bytes through it)
inline void transpose8x8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);       // r_i[0] r_i+1[0] r_i[1] r_i+1[1] | [4] [5]
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);   // [2] [3] | [6] [7]
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));       // 4 rows' [0] | [4]
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));   // [1] | [5]
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));   // [2] | [6]
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));   // [3] | [7]
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x20);
    r[j + 4] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x31);
  }
}

// 8 values as float32 in a 256-bit vector, which both instruction sets have (bfloat16 widened)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

#if PF_LANES == 16
using vf = __m512;
inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float v) { return _mm512_set1_ps(v); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline vf widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline vf load(const c10::BFloat16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vf broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline vf broadcast(const c10::BFloat16* p) {   // its 16 bits in every lane's top half
  int16_t bits;
  std::memcpy(&bits, p, 2);
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_set1_epi16(bits), _mm512_set1_epi32(int(0xFFFF0000u))));
}
inline __mmask16 first(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
// the first n (< LANES) values, the other lanes zero
inline vf load_n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }
inline vf load_n(const c10::BFloat16* p, int64_t n) { return widen(_mm256_maskz_loadu_epi16(first(n), p)); }
inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf fma(vf a, vf b, vf acc) { return _mm512_fmadd_ps(a, b, acc); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline float sum(vf v) { return _mm512_reduce_add_ps(v); }
inline float max_lane(vf v) { return _mm512_reduce_max_ps(v); }
inline vf round_even(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf times_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }   // p * 2^n, n whole
#else
using vf = __m256;
inline vf zero() { return _mm256_setzero_ps(); }
inline vf set1(float v) { return _mm256_set1_ps(v); }
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline vf load(const c10::BFloat16* p) { return load8(p); }
inline vf broadcast(const float* p) { return _mm256_set1_ps(*p); }
inline vf broadcast(const c10::BFloat16* p) {   // its 16 bits in every lane's top half (a 16-bit
  int16_t bits;                                 // broadcast and a mask: no scalar widening)
  std::memcpy(&bits, p, 2);
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_set1_epi16(bits), _mm256_set1_epi32(int(0xFFFF0000u))));
}
template <typename T>
inline vf load_n(const T* p, int64_t n) {
  T part[8] = {};
  std::copy_n(p, n, part);
  return load(part);
}
inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf fma(vf a, vf b, vf acc) { return _mm256_fmadd_ps(a, b, acc); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
inline float sum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float max_lane(vf v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline vf round_even(vf v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf times_pow2(vf p, vf n) {   // p * 2^n for whole n in [-126, 127]: n added to p's exponent field
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// e^x for x <= 0 (scores less their max): 2^(x log2 e) split into 2^n and 2^f, |f| <= 1/2, by its Taylor
// series to degree 7 (relative error < 1e-8 before rounding); x below -87 counts as -87 (e^-87 ~ 1.6e-38,
// a normal float). The library's expf takes one value at a time: too slow for a step's scores.
inline vf exp_neg(vf x) {
  const vf t = mul(max(x, set1(-87.f)), set1(1.4426950408889634f));
  const vf n = round_even(t);
  const vf f = mul(sub(t, n), set1(0.6931471805599453f));   // in nats
  vf p = set1(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = fma(p, f, set1(c));
  return times_pow2(p, n);
}

}  // namespace pf
#endif
