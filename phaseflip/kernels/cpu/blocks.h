// The GGUF block formats quant.cpp multiplies, each a struct: its GGML type id, the values a block holds
// and the bytes it takes, and how a run of 32 of its values (a sub-block: the whole block of the 32-value
// formats, one of 8 in the 256-value "K" formats) is decoded into float32, into vectors (`vectors`,
// where simd.h has them) or into memory (`values`). The layouts are GGML's (public):
// Q8_0: fp16 d, 32 int8 q; w = d * q.
// Q4_0: fp16 d, 16 bytes of 4-bit q (value j in byte j's low half, j + 16 in its high half); w = d * (q - 8).
// Q4_1: fp16 d, fp16 m, the same 16 bytes; w = d * q + m.
// Q5_0: fp16 d, 32 bits of fifth bits (bit j: value j's), Q4_0's 16 bytes; w = d * (q - 16).
// Q5_1: fp16 d, fp16 m, the fifth bits, the 16 bytes; w = d * q + m.
// Q4_K: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of 4-bit q (sub-blocks
//   2i and 2i + 1 are the low and high halves of bytes 32i .. 32i + 31); w = d * sc * q - dmin * mn.
// Q6_K: 128 bytes of q's low 4 bits, 64 of its high 2, sixteen int8 scales (one per 16 values), fp16 d
//   last; w = d * sc * (q - 32); each half of 128 values takes 64 low bytes (two runs of 32 values in
//   their low halves, two in their high) and 32 high bytes (the four runs at bit pairs 0, 2, 4, 6).
// Included by quant.cpp, qrow.h (a row's dot, which layer.cpp's products on blocks take) and int8.h.
#pragma once
#include <c10/util/Half.h>
#include <cstdint>
#include <cstring>
#include "simd.h"
#ifdef __F16C__
#include <immintrin.h>
#endif

namespace blocks {

constexpr int QK = 32;   // values a sub-block

// the IEEE half at p as a float: F16C's conversion where the build has it (the int8 dots take a scale or
// two a block), else c10's
inline float half_at(const uint8_t* p) {
#ifdef __F16C__
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
#else
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
#endif
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Q4_K's 6-bit scale and min of sub-block j (0-7), packed in its 12 bytes
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

#ifdef PF_LANES
constexpr int H = QK / pf::LANES;   // vectors a sub-block

// LANES bytes as int32 lanes (signed or not), the integer steps the decoders need, and int32 to float32
#if PF_LANES == 16
using vi = __m512i;
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline vi bytes_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(load16(p)); }
inline vi bytes_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(load16(p)); }
inline vi ints(int v) { return _mm512_set1_epi32(v); }
inline vi iota(int from) { return _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), ints(from)); }
inline vi band(vi a, vi b) { return _mm512_and_si512(a, b); }
inline vi bor(vi a, vi b) { return _mm512_or_si512(a, b); }
inline vi shr(vi a, vi n) { return _mm512_srlv_epi32(a, n); }
inline vi shl4(vi a) { return _mm512_slli_epi32(a, 4); }
inline pf::vf to_float(vi v) { return _mm512_cvtepi32_ps(v); }
#else
using vi = __m256i;
inline __m128i load8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
inline vi bytes_i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(load8(p)); }
inline vi bytes_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(load8(p)); }
inline vi ints(int v) { return _mm256_set1_epi32(v); }
inline vi iota(int from) { return _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), ints(from)); }
inline vi band(vi a, vi b) { return _mm256_and_si256(a, b); }
inline vi bor(vi a, vi b) { return _mm256_or_si256(a, b); }
inline vi shr(vi a, vi n) { return _mm256_srlv_epi32(a, n); }
inline vi shl4(vi a) { return _mm256_slli_epi32(a, 4); }
inline pf::vf to_float(vi v) { return _mm256_cvtepi32_ps(v); }
#endif
inline vi low4(vi v) { return band(v, ints(0xF)); }
inline vi high4(vi v) { return shr(v, ints(4)); }

// the 4-bit values of a 32-value block's 16 bytes q as integer vectors in value order: the low halves
// of the bytes are values 0-15, the high halves 16-31
inline void nibbles(const uint8_t* q, vi* v) {
#pragma GCC unroll 4
  for (int h = 0; h < H / 2; ++h) {
    const vi b = bytes_u8(q + h * pf::LANES);
    v[h] = low4(b);
    v[h + H / 2] = high4(b);
  }
}

// Q5's values: the nibbles with each value's fifth bit (bit j of `bits` for value j) as their bit 4
inline void fives(const uint8_t* q, uint32_t bits, vi* v) {
  nibbles(q, v);
  const vi all = ints(static_cast<int>(bits)), one = ints(1);
#pragma GCC unroll 4
  for (int h = 0; h < H; ++h) v[h] = bor(v[h], shl4(band(shr(all, iota(h * pf::LANES)), one)));
}

// a 32-value block's small integers q as w = d * q + off
inline void affine(const vi* q, float d, float off, pf::vf* v) {
#pragma GCC unroll 4
  for (int h = 0; h < H; ++h) v[h] = pf::fma(pf::set1(d), to_float(q[h]), pf::set1(off));
}
#endif

struct Q8_0 {
  static constexpr int64_t id = 8, values_per = 32, bytes = 34;
#ifdef PF_LANES
  static void vectors(const uint8_t* b, int, pf::vf* v) {
    const pf::vf d = pf::set1(half_at(b));
#pragma GCC unroll 4
    for (int h = 0; h < H; ++h) v[h] = pf::mul(d, to_float(bytes_i8(b + 2 + h * pf::LANES)));
  }
#endif
  static void values(const uint8_t* b, float* out) {
    const float d = half_at(b);
    for (int i = 0; i < QK; ++i) out[i] = d * static_cast<int8_t>(b[2 + i]);
  }
};

// the 32 values of a 4- or 5-bit block: its 16 nibble bytes at q (value j in byte j's low half, j + 16 in
// its high half), the fifth bits (0 for a 4-bit block), w = d * value + off
inline void small_values(const uint8_t* q, uint32_t bits, float d, float off, float* out) {
  for (int j = 0; j < QK / 2; ++j) {
    out[j] = d * ((q[j] & 0xF) | (((bits >> j) & 1) << 4)) + off;
    out[j + QK / 2] = d * ((q[j] >> 4) | (((bits >> (j + 16)) & 1) << 4)) + off;
  }
}

struct Q4_0 {
  static constexpr int64_t id = 2, values_per = 32, bytes = 18;
#ifdef PF_LANES
  static void vectors(const uint8_t* b, int, pf::vf* v) {
    vi q[H];
    nibbles(b + 2, q);
    affine(q, half_at(b), -8.f * half_at(b), v);
  }
#endif
  static void values(const uint8_t* b, float* out) { small_values(b + 2, 0, half_at(b), -8.f * half_at(b), out); }
};

struct Q4_1 {
  static constexpr int64_t id = 3, values_per = 32, bytes = 20;
#ifdef PF_LANES
  static void vectors(const uint8_t* b, int, pf::vf* v) {
    vi q[H];
    nibbles(b + 4, q);
    affine(q, half_at(b), half_at(b + 2), v);
  }
#endif
  static void values(const uint8_t* b, float* out) { small_values(b + 4, 0, half_at(b), half_at(b + 2), out); }
};

struct Q5_0 {
  static constexpr int64_t id = 6, values_per = 32, bytes = 22;
#ifdef PF_LANES
  static void vectors(const uint8_t* b, int, pf::vf* v) {
    vi q[H];
    fives(b + 6, u32_at(b + 2), q);
    affine(q, half_at(b), -16.f * half_at(b), v);
  }
#endif
  static void values(const uint8_t* b, float* out) {
    small_values(b + 6, u32_at(b + 2), half_at(b), -16.f * half_at(b), out);
  }
};

struct Q5_1 {
  static constexpr int64_t id = 7, values_per = 32, bytes = 24;
#ifdef PF_LANES
  static void vectors(const uint8_t* b, int, pf::vf* v) {
    vi q[H];
    fives(b + 8, u32_at(b + 4), q);
    affine(q, half_at(b), half_at(b + 2), v);
  }
#endif
  static void values(const uint8_t* b, float* out) { small_values(b + 8, u32_at(b + 4), half_at(b), half_at(b + 2), out); }
};

struct Q4_K {
  static constexpr int64_t id = 12, values_per = 256, bytes = 144;
  // sub-block s's scale (d * sc) and offset (-dmin * mn), and where its 32 bytes of nibbles lie
  static const uint8_t* sub(const uint8_t* b, int s, float& scale, float& off) {
    int sc, mn;
    scale_min_k4(b + 4, s, sc, mn);
    scale = half_at(b) * sc;
    off = -half_at(b + 2) * mn;
    return b + 16 + (s / 2) * 32;
  }
#ifdef PF_LANES
  static void vectors(const uint8_t* b, int s, pf::vf* v) {
    float scale, off;
    const uint8_t* q = sub(b, s, scale, off);
#pragma GCC unroll 4
    for (int h = 0; h < H; ++h) {
      const vi bytes = bytes_u8(q + h * pf::LANES);
      v[h] = pf::fma(pf::set1(scale), to_float(s & 1 ? high4(bytes) : low4(bytes)), pf::set1(off));
    }
  }
#endif
  static void values(const uint8_t* b, float* out) {
    for (int s = 0; s < 8; ++s) {
      float scale, off;
      const uint8_t* q = sub(b, s, scale, off);
      for (int l = 0; l < QK; ++l) out[s * QK + l] = scale * (s & 1 ? q[l] >> 4 : q[l] & 0xF) + off;
    }
  }
};

struct Q6_K {
  static constexpr int64_t id = 14, values_per = 256, bytes = 210;
  // sub-block s (0-7): its low bytes, which half of them (shift 0 or 4), its high bytes and bit pair, and
  // the scales of its two 16-value halves
  struct Sub {
    const uint8_t* low;
    int low_shift;
    const uint8_t* high;
    int high_shift;
    const int8_t* sc;
  };
  static Sub sub(const uint8_t* b, int s) {
    const int n = s / 4, t = s % 4;
    return {b + n * 64 + (t & 1) * 32, (t >> 1) * 4, b + 128 + n * 32, 2 * t,
            reinterpret_cast<const int8_t*>(b + 192) + n * 8 + 2 * t};
  }
#ifdef PF_LANES
  static void vectors(const uint8_t* b, int s, pf::vf* v) {
    const Sub u = sub(b, s);
    const float d = half_at(b + 208);
#pragma GCC unroll 4
    for (int h = 0; h < H; ++h) {
      const vi lo = low4(shr(bytes_u8(u.low + h * pf::LANES), ints(u.low_shift)));
      const vi hi = shl4(band(shr(bytes_u8(u.high + h * pf::LANES), ints(u.high_shift)), ints(3)));
      const float scale = d * u.sc[h * pf::LANES / 16];
      v[h] = pf::fma(pf::set1(scale), to_float(bor(lo, hi)), pf::set1(-32.f * scale));
    }
  }
#endif
  static void values(const uint8_t* b, float* out) {
    const float d = half_at(b + 208);
    for (int s = 0; s < 8; ++s) {
      const Sub u = sub(b, s);
      for (int l = 0; l < QK; ++l) {
        const int q = ((u.low[l] >> u.low_shift) & 0xF) | (((u.high[l] >> u.high_shift) & 3) << 4);
        out[s * QK + l] = d * u.sc[l / 16] * (q - 32);
      }
    }
  }
};

// fn(B()) for the format with GGML type id `type`; another id an error naming the served ones
template <typename Fn>
decltype(auto) with_format(int64_t type, Fn&& fn) {
  switch (type) {
    case Q8_0::id: return fn(Q8_0());
    case Q4_0::id: return fn(Q4_0());
    case Q5_0::id: return fn(Q5_0());
    case Q5_1::id: return fn(Q5_1());
    case Q4_K::id: return fn(Q4_K());
    case Q6_K::id: return fn(Q6_K());
    default:
      TORCH_CHECK(type == Q4_1::id, "quant: block format ", type, " is not served (served: Q4_0 = 2, "
                  "Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q6_K = 14)");
      return fn(Q4_1());
  }
}

}  // namespace blocks
