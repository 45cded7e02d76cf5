// One layer's paged KV cache as the CPU attention kernels read it (decode.cpp: one query token a
// sequence; prefill.cpp: prompt chunks; layer.cpp: a whole one-token decoder layer), and what
// they share: a row's address, a row-wise softmax, the table check and the kernels' entry points.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
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

// G rows of L scores, `stride` apart, each replaced by its softmax
inline void softmax_rows(float* scores, int64_t G, int64_t L, int64_t stride) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * stride;
    float mx = -INFINITY, sum = 0.f;
    int64_t pos = 0;
#ifdef PF_LANES
    pf::vf top = pf::set1(-INFINITY);   // a vector max: std::max_element would take ~9% of the attention's cycles
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

// The blocks holding a sequence's L positions, each one of the cache's (a TORCH_CHECK otherwise)
void check_table(const int64_t* table, int64_t L, int64_t width, const Cache& c);

// One query token's G heads (those of kv head h) over a sequence's L cached positions, already stored:
// scores, softmax, weighted V, sums in float32 (decode.cpp). buf: the caller's scratch.
template <typename T>
void attend_token(const T* q /* [G, D] */, T* out /* [G, D] */, const Cache& c, const int64_t* table, int64_t L,
                  int64_t h, int64_t G, int64_t d, float scale, std::vector<float>& buf);

// Whether attend_chunk serves head size d on this build (its vector tiles need d a multiple of them)
bool chunk_served(int64_t d);

// A prompt chunk of n tokens, the last n of a sequence's L cached positions (already stored): token i
// attends positions 0 .. L - n + i. q and out: the chunk's [n, Hq, D] rows; table: its block table.
template <typename T>
void attend_chunk(const T* q, T* out, const Cache& c, const int64_t* table, int64_t L, int64_t n, int64_t hq,
                  int64_t hkv, int64_t d, float scale);

}  // namespace paged
