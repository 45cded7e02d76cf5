// One layer's paged KV cache as the CPU attention kernels read it (decode.cpp: one query token a
// sequence; prefill.cpp: prompt chunks; layer.cpp: a whole one-token decoder layer), and what they share:
// a row's address, the K/V store, a step's metadata (Batch) and its checks, a row-wise softmax, and the
// kernels' entry points.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#include "simd.h"

namespace paged {

struct Cache {            // one layer's [num_blocks, 2 (k, v), block_size, Hkv, D] view, any strides
  char* base;
  int64_t num_blocks, block_size, sb, skv, so, sh;   // strides in elements
};

// The Cache of a layer's view kv [num_blocks, 2, block_size, Hkv, D]
inline Cache cache_of(const at::Tensor& kv) {
  return {static_cast<char*>(kv.data_ptr()), kv.size(0), kv.size(2), kv.stride(0), kv.stride(1), kv.stride(2),
          kv.stride(3)};
}

template <typename T>
inline T* row(const Cache& c, int64_t block, int64_t off, int64_t head, int kv) {
  return reinterpret_cast<T*>(c.base) + block * c.sb + kv * c.skv + off * c.so + head * c.sh;
}

// A token's K and V rows of kv head h (D values each) into the cache at its slot (block * block_size +
// offset; < 0: a padding token, stored nowhere), a slot check() has passed
template <typename T>
inline void store(const Cache& c, int64_t slot, int64_t h, const T* k, const T* v, int64_t d) {
  if (slot < 0) return;
  const int64_t block = slot / c.block_size, off = slot % c.block_size;
  std::copy_n(k, d, row<T>(c, block, off, h, 0));
  std::copy_n(v, d, row<T>(c, block, off, h, 1));
}

// A step's attention metadata as the kernels read it (kernels/attention.py's contract), built once per
// call by batch_of; `held` keeps the contiguous int64 tensors the pointers read alive
struct Batch {
  const int64_t* slots;    // [T] each token's cache slot (< 0: stored nowhere)
  const int64_t* tables;   // [S, width] each sequence's blocks
  const int64_t* lens;     // [S] each sequence's context after this step (<= 0: a padding sequence)
  const int64_t* starts;   // [S + 1] each sequence's first token; null: token s is sequence s's one
  int64_t tokens, seqs, width;
  float scale;
  int64_t window;          // a query at position p attends p - window < j <= p (0: every j <= p)
  float softcap;           // scores s (scaled) taken as softcap * tanh(s / softcap) before the softmax (0: as they are)
  at::Tensor held[4];
  const int64_t* table(int64_t s) const { return tables + s * width; }
  int64_t first(int64_t s) const { return starts ? starts[s] : s; }
  int64_t count(int64_t s) const { return starts ? starts[s + 1] - starts[s] : 1; }
  bool attends(int64_t s) const { return lens[s] > 0 && first(s) < tokens; }   // reads its context
  int64_t oldest(int64_t seen) const { return window > 0 ? std::max<int64_t>(0, seen - window) : 0; }   // of [0, seen)
};

// The Batch of an op's metadata tensors (query_start_loc undefined: one token a sequence), their dtype
// and shapes checked (a TORCH_CHECK naming op)
inline Batch batch_of(const char* op, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                      int64_t window = 0, double softcap = 0.0) {
  TORCH_CHECK(window >= 0, op, ": window ", window, " must be >= 0 (0: none)");
  TORCH_CHECK(softcap >= 0, op, ": softcap ", softcap, " must be >= 0 (0: none)");
  const bool one_each = !query_start_loc.defined();
  for (const at::Tensor* m : {&slot_mapping, &block_tables, &seq_lens, &query_start_loc})
    TORCH_CHECK(!m->defined() || (m->scalar_type() == at::kLong && !m->is_cuda()), op, ": int64 CPU metadata");
  const int64_t S = seq_lens.numel();
  TORCH_CHECK(slot_mapping.dim() == 1 && block_tables.dim() == 2 && block_tables.size(0) == S &&
                  (one_each ? slot_mapping.size(0) == S : query_start_loc.numel() == S + 1),
              op, ": metadata shapes disagree: slot_mapping ", slot_mapping.sizes(), ", block_tables ",
              block_tables.sizes(), ", seq_lens ", seq_lens.sizes(), ", query_start_loc ",
              one_each ? at::IntArrayRef() : query_start_loc.sizes());
  Batch b{};
  b.tokens = slot_mapping.size(0), b.seqs = S, b.width = block_tables.size(1), b.scale = static_cast<float>(scale);
  b.window = window, b.softcap = static_cast<float>(softcap);
  const auto read = [&b](int i, const at::Tensor& m) {
    b.held[i] = m.contiguous();
    return b.held[i].data_ptr<int64_t>();
  };
  b.slots = read(0, slot_mapping), b.tables = read(1, block_tables), b.lens = read(2, seq_lens);
  b.starts = one_each ? nullptr : read(3, query_start_loc);
  return b;
}

// Every slot within the cache, and every table a sequence attends through: its context's blocks, each
// one of the cache's (a TORCH_CHECK otherwise)
inline void check(const Batch& b, const Cache& c) {
  for (int64_t t = 0; t < b.tokens; ++t)
    TORCH_CHECK(b.slots[t] < c.num_blocks * c.block_size, "paged KV: slot ", b.slots[t], " is past the cache's ",
                c.num_blocks, " blocks of ", c.block_size);
  for (int64_t s = 0; s < b.seqs; ++s) {
    if (!b.attends(s)) continue;
    const int64_t L = b.lens[s];
    TORCH_CHECK((L + c.block_size - 1) / c.block_size <= b.width, "paged KV: ", L,
                " positions need more blocks than the table's ", b.width);
    for (int64_t i = 0; i * c.block_size < L; ++i)
      TORCH_CHECK(b.table(s)[i] >= 0 && b.table(s)[i] < c.num_blocks, "paged KV: block id ", b.table(s)[i],
                  " outside 0..", c.num_blocks - 1);
  }
}

// G rows of L scores, `stride` apart, each replaced by its softmax (of softcap * tanh(score / softcap) where
// softcap > 0: Gemma 2's soft-capping)
inline void softmax_rows(float* scores, int64_t G, int64_t L, int64_t stride, float softcap = 0.f) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * stride;
    if (softcap > 0.f)
      for (int64_t i = 0; i < L; ++i) sg[i] = softcap * std::tanh(sg[i] / softcap);
    float mx = -INFINITY, sum = 0.f;
    int64_t pos = 0;
#ifdef PF_LANES
    pf::vf top = pf::set1(-INFINITY);   // a vector max (std::max_element: one value at a time)
    for (; pos + pf::LANES <= L; pos += pf::LANES) top = pf::max(top, pf::load(sg + pos));
    mx = pf::max_lane(top);
#endif
    for (; pos < L; ++pos) mx = std::max(mx, sg[pos]);
    pos = 0;
#ifdef PF_LANES
    pf::vf acc = pf::zero();
    for (; pos + pf::LANES <= L; pos += pf::LANES) {   // the last L % LANES below, one at a time
      const pf::vf e = pf::exp_neg(pf::sub(pf::load(sg + pos), pf::set1(mx)));
      pf::store(sg + pos, e);
      acc = pf::add(acc, e);
    }
    sum = pf::sum(acc);
#endif
    for (; pos < L; ++pos) sum += (sg[pos] = std::exp(sg[pos] - mx));
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t i = 0; i < L; ++i) sg[i] *= inv;
  }
}

// One query token's G heads (those of kv head h) over cached positions [p0, L) of a sequence whose blocks
// are `table`, already stored (p0: the oldest its window keeps, else 0): scores, softmax, weighted V, sums
// in float32 (decode.cpp). buf: the caller's scratch.
template <typename T>
void attend_token(const T* q /* [G, D] */, T* out /* [G, D] */, const Cache& c, const int64_t* table, int64_t p0,
                  int64_t L, float scale, float softcap, int64_t h, int64_t G, int64_t d, std::vector<float>& buf);

struct Heads {   // a layer's attention heads: query heads, kv heads, head size
  int64_t hq, hkv, d;
};

// Sequence s's prompt chunk of n tokens, the last n of its L cached positions (already stored): token i
// attends positions 0 .. L - n + i (its window's: b.oldest(L - n + i + 1) ..). q and out: the step's [T, Hq, D] rows. Any head size.
template <typename T>
void attend_chunk(const T* q, T* out, const Cache& c, const Batch& b, int64_t s, const Heads& heads);

}  // namespace paged
