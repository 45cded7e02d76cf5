// Products of GGUF blocks with many rows of x quantized to int8 (int8.h's Rows, d and s per run): the integer
// form of quant.cpp's wide products. NR weight rows at a time (16 with AVX512-VNNI, 8 with AVX2) are unpacked
// into this thread's buffer (`Group`) as unsigned bytes u with w = a * u + c per run (Q8_0's signed bytes
// shifted by 128, Q6_K's by 32, whose a and c change every 16 values), laid out so that one vector load holds
// 4 consecutive values of each of the NR rows: u8 x s8 products against 4 bytes of one row of x broadcast to
// every lane (vpdpbusd; AVX2's vpmaddubsw and vpmaddwd, whose int16 pairs hold 2 * u * 127 only for u <= 128:
// Q8_0's bytes stay signed there, `signed_bytes`; the 4- to 6-bit formats' pairs add up in int16 over a few
// steps before vpmaddwd widens them, `fold`) sum them into each weight row's own lane, so a register
// tile of MR rows of x by NR weight rows needs no horizontal sums. Each run's int32 sums then become float32
// through the run's scales: a (per weight row) times x's scale dx, plus c times x's dx * sum(q) (`offsets`).
// llama.cpp's repacked GEMMs use this interleave (public knowledge); here the repack lives in L1, once per
// pass of x over a group, so the arena keeps the file's blocks.
#pragma once
#include "int8.h"
#include "simd.h"
#ifdef PF_INT8_DOT
#include <cstring>
#include <type_traits>
#include <vector>

namespace int8wide {

using blocks::QK;
using blocks::half_at, int8dot::fives, int8dot::load32, int8dot::low4, int8dot::nibbles, int8dot::shift_right;
#ifdef PF_INT8_VNNI
constexpr int NR = 16;   // weight rows a group: one lane of a vector each
constexpr int MR = 8;    // rows of x a register tile: 2 * MR + 2 of the 32 vector registers
using vi = __m512i;
using vf = __m512;
inline vi zero_i() { return _mm512_setzero_si512(); }
inline vf zero_f() { return _mm512_setzero_ps(); }
inline vi load_i(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline vf load_f(const float* p) { return _mm512_loadu_ps(p); }
inline vf set_f(float v) { return _mm512_set1_ps(v); }
inline vi set_i(int32_t v) { return _mm512_set1_epi32(v); }
inline vi dot4(vi acc, vi u, vi x) { return _mm512_dpbusd_epi32(acc, u, x); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf to_float(vi v) { return _mm512_cvtepi32_ps(v); }
inline void store_f(float* p, vf v) { _mm512_storeu_ps(p, v); }
#else
constexpr int NR = 8;
constexpr int MR = 6;    // 2 * MR + 3 of the 16
using vi = __m256i;
using vf = __m256;
inline vi zero_i() { return _mm256_setzero_si256(); }
inline vf zero_f() { return _mm256_setzero_ps(); }
inline vi load_i(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vf load_f(const float* p) { return _mm256_loadu_ps(p); }
inline vf set_f(float v) { return _mm256_set1_ps(v); }
inline vi set_i(int32_t v) { return _mm256_set1_epi32(v); }
inline vi dot4(vi acc, vi u, vi x) { return int8dot::dpbusd(acc, u, x); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf to_float(vi v) { return _mm256_cvtepi32_ps(v); }
inline void store_f(float* p, vf v) { _mm256_storeu_ps(p, v); }
#endif

// Whether the group holds format B's bytes signed, as they are (w = a * q): Q8_0 without VNNI, whose u
// (q + 128) would overflow vpmaddubsw's int16 pairs; the tile takes |q| times x with q's signs
template <typename B>
#ifdef PF_INT8_VNNI
constexpr bool signed_bytes = false;
#else
constexpr bool signed_bytes = std::is_same_v<B, blocks::Q8_0>;
#endif

// Run s of a block as unsigned bytes u, with w = a * u + c
inline __m256i run(blocks::Q4_0, const uint8_t* b, int, float& a, float& c) {
  a = half_at(b), c = -8.f * a;
  return nibbles(b + 2);
}
inline __m256i run(blocks::Q4_1, const uint8_t* b, int, float& a, float& c) {
  a = half_at(b), c = half_at(b + 2);
  return nibbles(b + 4);
}
inline __m256i run(blocks::Q5_0, const uint8_t* b, int, float& a, float& c) {
  a = half_at(b), c = -16.f * a;
  return fives(b + 6, blocks::u32_at(b + 2));
}
inline __m256i run(blocks::Q5_1, const uint8_t* b, int, float& a, float& c) {
  a = half_at(b), c = half_at(b + 2);
  return fives(b + 8, blocks::u32_at(b + 4));
}
inline __m256i run(blocks::Q4_K, const uint8_t* b, int s, float& a, float& c) {
  int sc, mn;
  blocks::scale_min_k4(b + 4, s, sc, mn);
  a = half_at(b) * sc, c = -half_at(b + 2) * mn;
  const __m256i q = load32(b + 16 + (s / 2) * 32);
  return low4(s & 1 ? _mm256_srli_epi16(q, 4) : q);
}

// Q6_K's run s as signed bytes w (q - 32), and the scale of each int32 lane of a product (values 0-15, 16-31)
inline __m256i run(blocks::Q6_K, const uint8_t* b, int s, __m256& scale) {
  const blocks::Q6_K::Sub u = blocks::Q6_K::sub(b, s);
  const float d = half_at(b + 208);
  scale = _mm256_set_m128(_mm_set1_ps(d * u.sc[1]), _mm_set1_ps(d * u.sc[0]));
  const __m256i lo = low4(shift_right(load32(u.low), u.low_shift));
  const __m256i hi = _mm256_and_si256(shift_right(load32(u.high), u.high_shift), _mm256_set1_epi8(3));
  return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
}

// the values a scale covers in format B (Q6_K: 16; the others: the whole run of 32)
template <typename B>
constexpr int scale_run = std::is_same_v<B, blocks::Q6_K> ? 16 : QK;

// Steps of 4 values whose vpmaddubsw pair sums (at most 2 * 127 * u, u the format's largest unsigned byte)
// one int16 sum holds before vpmaddwd widens it to int32, on AVX2 (a power of two, at most a scale run's
// steps): Q4's 15 all 8 steps of a run, Q5's 31 four, Q6_K's 63 two, Q8_0 (q + 128, or signed) one. Where
// a dot4 is one instruction (AVX512-VNNI, AVX-VNNI) every step takes it.
template <typename B>
constexpr int fold = [] {
#ifndef PF_INT8_PAIRS
  return 1;
#else
  constexpr int largest = std::is_same_v<B, blocks::Q8_0> ? 128 : std::is_same_v<B, blocks::Q6_K> ? 63
                          : (std::is_same_v<B, blocks::Q5_0> || std::is_same_v<B, blocks::Q5_1>) ? 31 : 15;
  int steps = 1;
  while (2 * steps * 2 * 127 * largest <= 32767 && 2 * steps <= scale_run<B> / 4) steps *= 2;
  return steps;
#endif
}();

// Run s of block blk as unsigned bytes in value order, with w = a[h] * u + c[h] for its halves h (signed
// bytes q where signed_bytes: w = a * q, c = 0)
template <typename B>
inline __m256i unsigned_run(const uint8_t* blk, int s, float a[2], float c[2]) {
  if constexpr (signed_bytes<B>) {
    a[0] = a[1] = half_at(blk), c[0] = c[1] = 0.f;
    return load32(blk + 2);
  } else if constexpr (std::is_same_v<B, blocks::Q8_0>) {
    a[0] = a[1] = half_at(blk), c[0] = c[1] = -128.f * a[0];
    return _mm256_xor_si256(load32(blk + 2), _mm256_set1_epi8(static_cast<char>(0x80)));
  } else if constexpr (std::is_same_v<B, blocks::Q6_K>) {
    __m256 scale;
    const __m256i w = run(B(), blk, s, scale);   // q - 32, scales of values 0-15 and 16-31
    a[0] = _mm256_cvtss_f32(scale), a[1] = _mm_cvtss_f32(_mm256_extractf128_ps(scale, 1));
    c[0] = -32.f * a[0], c[1] = -32.f * a[1];
    return _mm256_add_epi8(w, _mm256_set1_epi8(32));
  } else {
    const __m256i u = run(B(), blk, s, a[0], c[0]);
    a[1] = a[0], c[1] = c[0];
    return u;
  }
}

// Up to NR weight rows, unpacked: bytes [run][8 steps of 4 values][NR rows][4], and a and c [scale run][NR]
// (rows past `count` zero). A run of 8 rows at a time: decoded into registers, transposed (8 x 8 dwords),
// stored a step a vector.
struct Group {
  std::vector<uint8_t> u;
  std::vector<float> a, c;

  template <typename B>
  void fill(const uint8_t* rows, int64_t ldw, int64_t count, int64_t K) {
    constexpr int R = scale_run<B>, per = QK / R, subs = B::values_per / QK;
    const int64_t runs = K / QK;
    u.resize(runs * 8 * NR * 4), a.resize(runs * per * NR), c.resize(runs * per * NR);
    for (int64_t j = 0; j < runs; ++j) {
      for (int r8 = 0; r8 < NR; r8 += 8) {
        __m256 v[8];   // the runs' bytes
        for (int i = 0; i < 8; ++i) {
          const int64_t r = r8 + i;
          float ra[2] = {0.f, 0.f}, rc[2] = {0.f, 0.f};
          v[i] = r < count ? _mm256_castsi256_ps(unsigned_run<B>(rows + r * ldw + j / subs * B::bytes,
                                                                 static_cast<int>(j % subs), ra, rc))
                           : _mm256_setzero_ps();
          for (int h = 0; h < per; ++h) a[(j * per + h) * NR + r] = ra[h], c[(j * per + h) * NR + r] = rc[h];
        }
        pf::transpose8x8(v);
        for (int k = 0; k < 8; ++k)
          _mm256_storeu_ps(reinterpret_cast<float*>(u.data() + ((j * 8 + k) * NR + r8) * 4), v[k]);
      }
    }
  }
};

// x's dx * sum(q) per run of R values, R = 16 or 32 (a scale run of the weights' format)
inline void offsets(const int8dot::Rows& x, int64_t M, int64_t K, int R, std::vector<float>& out) {
  if (R == QK) {
    out = x.s;
    return;
  }
  const int64_t n = M * K / R;
  out.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    int sum = 0;
    for (int v = 0; v < R; ++v) sum += x.q[i * R + v];
    out[i] = x.d[i * R / QK] * static_cast<float>(sum);
  }
}

inline int32_t dword(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// sum[m] + x's 4 bytes at xq[m * K] (broadcast) times the group's 4 values of each weight row, w: unsigned
// bytes, or signed ones (Signed) taken as |w| times x with w's signs
template <bool Signed, int MT>
inline void step(vi (&sum)[MT], vi w, const int8_t* xq, int64_t K) {
#ifndef PF_INT8_VNNI
  if constexpr (Signed) {
    const vi magnitude = _mm256_sign_epi8(w, w);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) sum[m] = dot4(sum[m], magnitude, _mm256_sign_epi8(set_i(dword(xq + m * K)), w));
    return;
  }
#endif
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) sum[m] = dot4(sum[m], w, set_i(dword(xq + m * K)));
}

#ifdef PF_INT8_PAIRS
// sum[m] + F steps (step's products, unsigned bytes w at `w`, NR * 4 bytes apart; x's 4 bytes a step): their
// vpmaddubsw pairs added in int16 (fold: they fit), then widened once by vpmaddwd
template <int F, int MT>
inline void steps16(vi (&sum)[MT], const uint8_t* w, const int8_t* xq, int64_t K) {
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    vi pairs = _mm256_maddubs_epi16(load_i(w), set_i(dword(xq + m * K)));
#pragma GCC unroll 8
    for (int f = 1; f < F; ++f)
      pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(load_i(w + f * NR * 4), set_i(dword(xq + m * K + f * 4))));
    sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
}
#endif

// out[m][0..NR) = rows m0 .. m0 + MT of x times the group's NR weight rows (float32, out NR apart)
template <int R, bool Signed, int F, int MT>
inline void tile(const Group& g, const int8dot::Rows& x, const std::vector<float>& xs, int64_t m0, int64_t K,
                 float* out) {
  constexpr int per = QK / R, steps = R / 4;
  const int64_t runs = K / QK;
  vf acc[MT];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) acc[m] = zero_f();
  const int8_t* xq = x.q.data() + m0 * K;
  for (int64_t j = 0; j < runs; ++j) {
#pragma GCC unroll 2
    for (int h = 0; h < per; ++h) {
      vi sum[MT];
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) sum[m] = zero_i();
#ifdef PF_INT8_PAIRS
      if constexpr (F > 1 && !Signed) {
#pragma GCC unroll 8
        for (int k = h * steps; k < (h + 1) * steps; k += F)
          steps16<F>(sum, g.u.data() + (j * 8 + k) * NR * 4, xq + j * QK + k * 4, K);
      } else
#endif
#pragma GCC unroll 8
      for (int k = h * steps; k < (h + 1) * steps; ++k)
        step<Signed>(sum, load_i(g.u.data() + (j * 8 + k) * NR * 4), xq + j * QK + k * 4, K);
      const int64_t r = j * per + h;
      const vf av = load_f(g.a.data() + r * NR), cv = load_f(g.c.data() + r * NR);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        acc[m] = fmadd(to_float(sum[m]), mul(av, set_f(x.d[(m0 + m) * runs + j])), acc[m]);
        acc[m] = fmadd(cv, set_f(xs[(m0 + m) * (K / R) + r]), acc[m]);
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) store_f(out + m * NR, acc[m]);
}

template <int R, bool Signed, int F>
inline void tile_rows(const Group& g, const int8dot::Rows& x, const std::vector<float>& xs, int64_t m0, int64_t mt,
                      int64_t K, float* out) {
  switch (mt) {
    case 1: return tile<R, Signed, F, 1>(g, x, xs, m0, K, out);
    case 2: return tile<R, Signed, F, 2>(g, x, xs, m0, K, out);
    case 3: return tile<R, Signed, F, 3>(g, x, xs, m0, K, out);
    case 4: return tile<R, Signed, F, 4>(g, x, xs, m0, K, out);
    case 5: return tile<R, Signed, F, 5>(g, x, xs, m0, K, out);
    case 6: return tile<R, Signed, F, 6>(g, x, xs, m0, K, out);
#ifdef PF_INT8_VNNI
    case 7: return tile<R, Signed, F, 7>(g, x, xs, m0, K, out);
    default: return tile<R, Signed, F, 8>(g, x, xs, m0, K, out);
#else
    default: return tile<R, Signed, F, 6>(g, x, xs, m0, K, out);
#endif
  }
}

}  // namespace int8wide
#endif
