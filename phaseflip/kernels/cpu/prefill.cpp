// Causal attention for prompt chunks on the CPU, read from the paged cache (paged.h's attend_chunk;
// decode.cpp calls it for every sequence of a step that brings more than one token). A chunk's scores and
// weighted sums are small matrix products, computed in tile.h's register tiles: MR rows of queries (or
// probabilities) against NC of K's positions (or V's columns), no horizontal sums.
// First each kv head's context is laid out once as float32: K in tiles of NC positions ([tile][D][NC],
// a tile's values contiguous), V as [L][Dp] (D rounded up to whole tiles of columns, zero past D, so any
// head size runs in the same tiles); then tasks of QB query tokens (x the kv head's G query
// heads) each run scores -> softmax -> weighted V for their rows, every group of MR rows only over the
// positions its last token sees (with a sliding window the context is laid out from the oldest position the
// chunk's first token sees, and the positions before a later row's window weigh 0). A build without vectors attends each token of the chunk as decode.cpp
// attends a decode token, over the positions it sees.
#include <c10/util/Exception.h>
#include <vector>
#include "paged.h"
#include "parallel.h"
#include "tile.h"

namespace paged {

#ifdef PF_LANES
namespace {

constexpr int64_t MR = 6;                  // rows of a tile: 12 accumulators of AVX2's 16 registers
constexpr int NV = 2;                      // vectors of columns in a tile
constexpr int64_t NC = NV * pf::LANES;     // columns in a tile
constexpr int64_t QB = 16;                 // query tokens a task

// Each kv head's cached positions [first, first + L) as float32 (first: the oldest the chunk's window keeps,
// else 0): K as [tile][D][NC] (zero past L), V as [L][dp] (zero past D); column / row i is position first + i
struct Context {
  int64_t first, L, d, dp, tiles;
  std::vector<float> k, v;
  const float* k_of(int64_t h) const { return k.data() + h * tiles * d * NC; }
  const float* v_of(int64_t h) const { return v.data() + h * L * dp; }
};

template <typename T>
Context lay_out(const Cache& c, const int64_t* table, int64_t first, int64_t end, int64_t hkv, int64_t d) {
  const int64_t L = end - first;
  Context ctx{first, L, d, (d + NC - 1) / NC * NC, (L + NC - 1) / NC, {}, {}};
  ctx.k.resize(hkv * ctx.tiles * d * NC);
  ctx.v.resize(hkv * L * ctx.dp);   // zeros: the columns past D stay so
  par::ranges(hkv * ctx.tiles, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / ctx.tiles, j = i % ctx.tiles;
      float* kt = ctx.k.data() + i * d * NC;
      for (int64_t col = 0; col < NC; ++col) {
        const int64_t pos = j * NC + col;
        if (pos >= L) {
          for (int64_t e = 0; e < d; ++e) kt[e * NC + col] = 0.f;
          continue;
        }
        const int64_t at = first + pos;
        const T* kr = row<T>(c, table[at / c.block_size], at % c.block_size, h, 0);
        const T* vr = row<T>(c, table[at / c.block_size], at % c.block_size, h, 1);
        float* vd = ctx.v.data() + (h * L + pos) * ctx.dp;
        for (int64_t e = 0; e < d; ++e) {
          kt[e * NC + col] = static_cast<float>(kr[e]);
          vd[e] = static_cast<float>(vr[e]);
        }
      }
    }
  });
  return ctx;
}

struct Rows {   // one task's query rows: tokens i0 .. i1 - 1 of the chunk, G heads each, row = token * G + g
  int64_t i0, i1, G, p0;   // p0: the chunk's first position (L - n)
  int64_t count() const { return (i1 - i0) * G; }
  int64_t sees(int64_t r) const { return p0 + i0 + r / G + 1; }   // positions row r attends
  // where row r (kv head h's query head r % G of token i0 + r / G) lies in the chunk's [n, Hq, D] rows
  int64_t at(int64_t r, int64_t h, int64_t hq, int64_t d) const { return ((i0 + r / G) * hq + h * G + r % G) * d; }
};

// One task: kv head h's G query heads of tokens rows.i0 .. i1 - 1; buf holds its float32 rows
template <typename T, typename Oldest>
void attend_rows(const T* q, T* out, const Context& ctx, int64_t h, const Rows& rows, int64_t hq, float scale,
                 float softcap, const Oldest& oldest, std::vector<float>& buf) {
  const int64_t d = ctx.d, R = rows.count(), Rp = (R + MR - 1) / MR * MR, first = ctx.first;
  const int64_t width = (rows.sees(R - 1) - first + NC - 1) / NC * NC;   // the last row's positions, whole tiles
  buf.assign(Rp * d + MR * width + MR * NC, 0.f);
  float* qf = buf.data();             // [Rp, D] scaled queries, zero rows past R
  float* s = qf + Rp * d;             // [MR, width] one group's scores, then probabilities
  float* o = s + MR * width;          // [MR, NC] one tile of the output
  for (int64_t r = 0; r < R; ++r) {
    const T* qr = q + rows.at(r, h, hq, d);
    for (int64_t e = 0; e < d; ++e) qf[r * d + e] = static_cast<float>(qr[e]) * scale;
  }
  for (int64_t g0 = 0; g0 < R; g0 += MR) {
    const int64_t last = std::min(R, g0 + MR) - 1, seen = rows.sees(last) - first;   // the group's widest row
    for (int64_t j = 0; j * NC < seen; ++j)
      tile::rows<float, MR, NV>(qf + g0 * d, d, ctx.k_of(h) + j * d * NC, NC, d, s + j * NC, width);
    for (int64_t r = 0; g0 + r <= last; ++r) {   // rows past the last are never written out
      float* sr = s + r * width;
      const int64_t n = rows.sees(g0 + r) - first, lo = oldest(n + first) - first;
      softmax_rows(sr + lo, 1, n - lo, width, softcap);
      std::fill(sr, sr + lo, 0.f);         // positions before the row's window: weigh 0
      std::fill(sr + n, sr + seen, 0.f);   // positions after the row's token: weigh 0
    }
    for (int64_t e0 = 0; e0 < d; e0 += NC) {
      tile::rows<float, MR, NV>(s, width, ctx.v_of(h) + e0, ctx.dp, seen, o, NC);
      const int64_t cols = std::min(NC, d - e0);
      for (int64_t r = g0; r <= last; ++r) {
        T* dst = out + rows.at(r, h, hq, d) + e0;
        for (int64_t e = 0; e < cols; ++e) dst[e] = static_cast<T>(o[(r - g0) * NC + e]);
      }
    }
  }
}

}  // namespace

template <typename T>
void attend_chunk(const T* q, T* out, const Cache& c, const Batch& b, int64_t s, const Heads& heads) {
  const int64_t L = b.lens[s], n = b.count(s), t = b.first(s), d = heads.d, hkv = heads.hkv;
  TORCH_CHECK(n <= L, "attend_chunk: ", n, " tokens, at most the context's ", L);
  const Context ctx = lay_out<T>(c, b.table(s), b.oldest(L - n + 1), L, hkv, d);   // from the first token's window
  const int64_t G = heads.hq / hkv, blocks = (n + QB - 1) / QB;
  // tasks block-major, blocks in the order 0, last, 1, last - 1, ...: a late block sees more positions,
  // and torch's threads each take a contiguous range of tasks, which this keeps about equally costly
  par::ranges(blocks * hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t z = task / hkv, blk = z % 2 ? blocks - 1 - z / 2 : z / 2;
      const Rows rows{blk * QB, std::min(n, (blk + 1) * QB), G, L - n};
      attend_rows<T>(q + t * heads.hq * d, out + t * heads.hq * d, ctx, task % hkv, rows, heads.hq, b.scale,
                     b.softcap, [&b](int64_t seen) { return b.oldest(seen); }, buf);
    }
  });
}
#else
template <typename T>
void attend_chunk(const T* q, T* out, const Cache& c, const Batch& b, int64_t s, const Heads& heads) {
  const int64_t L = b.lens[s], n = b.count(s), t = b.first(s), d = heads.d, hkv = heads.hkv, G = heads.hq / hkv;
  TORCH_CHECK(n <= L, "attend_chunk: ", n, " tokens, at most the context's ", L);
  par::ranges(n * hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf;
    for (int64_t i = i0; i < i1; ++i) {   // token i / hkv of the chunk sees L - n + i / hkv + 1 positions
      const int64_t at = ((t + i / hkv) * heads.hq + (i % hkv) * G) * d;
      const int64_t seen = L - n + i / hkv + 1;
      attend_token<T>(q + at, out + at, c, b.table(s), b.oldest(seen), seen, b.scale, b.softcap, i % hkv, G, d, buf);
    }
  });
}
#endif

template void attend_chunk<float>(const float*, float*, const Cache&, const Batch&, int64_t, const Heads&);
template void attend_chunk<c10::BFloat16>(const c10::BFloat16*, c10::BFloat16*, const Cache&, const Batch&, int64_t,
                                          const Heads&);

}  // namespace paged
