// Paged attention for a step on the CPU, read in place: every decode token (a sequence's one query
// token) reads its sequence's K and V rows straight from the paged cache (block table -> block ->
// row), one (sequence, kv head) per task over torch's threads, with no gathered copy of any context;
// a sequence that brings a prompt chunk (more than one token) goes to prefill.cpp's tiles. The
// contract is kernels/attention.py's (store this step's K/V at slot_mapping, then attend; padding
// tokens give zeros). A step with a chunk at a head size the tiles do not serve (paged::chunk_served)
// gets an empty tensor and nothing is touched (the caller runs its general path). Built and loaded by
// phaseflip/kernels/cpu/library.py with gemv.cpp and prefill.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <initializer_list>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <vector>
#include "paged.h"

namespace {

using paged::Cache;
using paged::row;

template <typename T>
void store(const at::Tensor& k, const at::Tensor& v, const Cache& c, const int64_t* slots, int64_t T_, int64_t hkv,
           int64_t d) {
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  for (int64_t t = 0; t < T_; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t block = slot / c.block_size, off = slot % c.block_size;
    TORCH_CHECK(block < c.num_blocks, "decode_attention: slot ", slot, " is past the cache's ", c.num_blocks,
                " blocks");
    for (int64_t h = 0; h < hkv; ++h) {
      std::copy_n(kp + (t * hkv + h) * d, d, row<T>(c, block, off, h, 0));
      std::copy_n(vp + (t * hkv + h) * d, d, row<T>(c, block, off, h, 1));
    }
  }
}

template <typename T>
inline float widen(T x) { return static_cast<float>(x); }

#ifdef PF_LANES
// fn(pos, k row, v row) for each of a sequence's L cached positions of kv head h, block by block (no
// division per position: a divide per row and per 16 lanes would cost ~10% of a 32-sequence step's
// attention). With Fetch, each position also asks for the same position's K and V rows one block on
// (the blocks lie anywhere in the cache, beyond the hardware's prefetch: without it the K pass waits
// on memory)
template <typename T, bool Fetch, typename Fn>
inline void for_rows(const Cache& c, const int64_t* table, int64_t L, int64_t h, int64_t d, Fn&& fn) {
  const int64_t blocks = (L + c.block_size - 1) / c.block_size;
  for (int64_t b = 0, pos = 0; pos < L; ++b) {
    const T* k = row<T>(c, table[b], 0, h, 0);
    const T* v = row<T>(c, table[b], 0, h, 1);
    const T* kn = b + 1 < blocks ? row<T>(c, table[b + 1], 0, h, 0) : nullptr;
    const T* vn = b + 1 < blocks ? row<T>(c, table[b + 1], 0, h, 1) : nullptr;
    const int64_t n = std::min(c.block_size, L - pos);
    for (int64_t off = 0; off < n; ++off, ++pos) {
      if (Fetch && kn != nullptr)
        for (int64_t byte = 0; byte < d * (int64_t)sizeof(T); byte += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(kn + off * c.so) + byte, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(vn + off * c.so) + byte, _MM_HINT_T1);
        }
      fn(pos, k + off * c.so, v + off * c.so);
    }
  }
}

// D a multiple of LANES * CH: the G heads' score sums in registers; the weighted V summed CH x LANES lanes
// at a time for all G heads (G * CH independent accumulators: one per head made a chain of dependent
// FMAs, one per position)
template <typename T, int G, int CH>
void attend_vec(const float* qf /* [G, D], scaled */, T* out, const Cache& c, const int64_t* table, int64_t L,
                int64_t h, int64_t d, float* scores /* [G, L] */) {
  for_rows<T, true>(c, table, L, h, d, [&](int64_t pos, const T* kr, const T*) {
    pf::vf acc[G];
    for (int g = 0; g < G; ++g) acc[g] = pf::zero();
    for (int64_t i = 0; i < d; i += pf::LANES) {
      const pf::vf kv = pf::load(kr + i);
      for (int g = 0; g < G; ++g) acc[g] = pf::fma(pf::load(qf + g * d + i), kv, acc[g]);
    }
    for (int g = 0; g < G; ++g) scores[g * L + pos] = pf::sum(acc[g]);
  });
  paged::softmax_rows(scores, G, L, L);
  for (int64_t i0 = 0; i0 < d; i0 += pf::LANES * CH) {
    pf::vf acc[G][CH];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < CH; ++j) acc[g][j] = pf::zero();
    for_rows<T, false>(c, table, L, h, d, [&](int64_t pos, const T*, const T* vr) {
      for (int j = 0; j < CH; ++j) {
        const pf::vf vv = pf::load(vr + i0 + pf::LANES * j);
        for (int g = 0; g < G; ++g) acc[g][j] = pf::fma(pf::set1(scores[g * L + pos]), vv, acc[g][j]);
      }
    });
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < CH; ++j) {
        float lane[pf::LANES];
        pf::store(lane, acc[g][j]);
        for (int e = 0; e < pf::LANES; ++e) out[g * d + i0 + pf::LANES * j + e] = static_cast<T>(lane[e]);
      }
  }
}

// The widest CH (vectors per pass over V) that divides D and keeps G * CH accumulators within 16 of
// AVX-512's 32 registers, 12 of AVX2's 16 (the V row and the broadcast score take two more; 12, not 8,
// gives SmolLM2's G = 3 two passes over V instead of four: a faster decode attention)
template <typename T, int G>
bool attend_vec_any(const float* qf, T* out, const Cache& c, const int64_t* table, int64_t L, int64_t h,
                    int64_t d, float* scores) {
  constexpr int accs = pf::LANES == 16 ? 16 : 12;
  if (d % (4 * pf::LANES) == 0 && G * 4 <= accs) return attend_vec<T, G, 4>(qf, out, c, table, L, h, d, scores), true;
  if (d % (2 * pf::LANES) == 0 && G * 2 <= accs) return attend_vec<T, G, 2>(qf, out, c, table, L, h, d, scores), true;
  if (d % pf::LANES == 0) return attend_vec<T, G, 1>(qf, out, c, table, L, h, d, scores), true;
  return false;
}
#endif

// Any D and G: plain loops
template <typename T>
void attend_loops(const float* qf, T* out, const Cache& c, const int64_t* table, int64_t L, int64_t h, int64_t G,
                  int64_t d, float* scores, float* acc /* [G, D] */) {
  for (int64_t pos = 0; pos < L; ++pos) {
    const T* kr = row<T>(c, table[pos / c.block_size], pos % c.block_size, h, 0);
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < d; ++i) s += qf[g * d + i] * widen(kr[i]);
      scores[g * L + pos] = s;
    }
  }
  paged::softmax_rows(scores, G, L, L);
  std::fill_n(acc, G * d, 0.f);
  for (int64_t pos = 0; pos < L; ++pos) {
    const T* vr = row<T>(c, table[pos / c.block_size], pos % c.block_size, h, 1);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * L + pos];
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) acc[g * d + i] += p * widen(vr[i]);
    }
  }
  for (int64_t i = 0; i < G * d; ++i) out[i] = static_cast<T>(acc[i]);
}

}  // namespace

namespace paged {

// The blocks holding a sequence's L positions, each one of the cache's
void check_table(const int64_t* table, int64_t L, int64_t width, const Cache& c) {
  TORCH_CHECK((L + c.block_size - 1) / c.block_size <= width, "paged KV: ", L,
              " positions need more blocks than the table's ", width);
  for (int64_t b = 0; b * c.block_size < L; ++b)
    TORCH_CHECK(table[b] >= 0 && table[b] < c.num_blocks, "paged KV: block id ", table[b], " outside 0..",
                c.num_blocks - 1);
}

// One sequence's G query heads of kv head h over its L cached positions: scores, softmax, weighted V.
// Two passes over the context, K then V, each row read once for all G heads; sums in float32.
template <typename T>
void attend_token(const T* q /* [G, D] */, T* out /* [G, D] */, const Cache& c, const int64_t* table, int64_t L,
                int64_t h, int64_t G, int64_t d, float scale, std::vector<float>& buf) {
  buf.resize(G * (L + 2 * d));
  float* scores = buf.data();                 // [G, L]
  float* qf = scores + G * L;                 // [G, D] the queries as float, scaled
  float* acc = qf + G * d;                    // [G, D]
  for (int64_t i = 0; i < G * d; ++i) qf[i] = widen(q[i]) * scale;
#ifdef PF_LANES
  switch (G) {
    case 1: if (attend_vec_any<T, 1>(qf, out, c, table, L, h, d, scores)) return; break;
    case 2: if (attend_vec_any<T, 2>(qf, out, c, table, L, h, d, scores)) return; break;
    case 3: if (attend_vec_any<T, 3>(qf, out, c, table, L, h, d, scores)) return; break;
    case 4: if (attend_vec_any<T, 4>(qf, out, c, table, L, h, d, scores)) return; break;
    case 5: if (attend_vec_any<T, 5>(qf, out, c, table, L, h, d, scores)) return; break;
    case 6: if (attend_vec_any<T, 6>(qf, out, c, table, L, h, d, scores)) return; break;
    case 7: if (attend_vec_any<T, 7>(qf, out, c, table, L, h, d, scores)) return; break;
    case 8: if (attend_vec_any<T, 8>(qf, out, c, table, L, h, d, scores)) return; break;
    default: break;
  }
#endif
  attend_loops<T>(qf, out, c, table, L, h, G, d, scores, acc);
}

template void attend_token<float>(const float*, float*, const Cache&, const int64_t*, int64_t, int64_t, int64_t,
                                  int64_t, float, std::vector<float>&);
template void attend_token<c10::BFloat16>(const c10::BFloat16*, c10::BFloat16*, const Cache&, const int64_t*, int64_t,
                                          int64_t, int64_t, int64_t, float, std::vector<float>&);

}  // namespace paged

namespace {

using paged::attend_token;
using paged::check_table;

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Cache& c, const at::Tensor& slots,
         const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& starts, double scale, at::Tensor& out) {
  const int64_t T_ = q.size(0), hq = q.size(1), d = q.size(2), hkv = k.size(1), G = hq / hkv;
  store<T>(k, v, c, slots.data_ptr<int64_t>(), T_, hkv, d);
  const int64_t S = lens.size(0), B = tables.size(1);
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  for (int64_t s = 0; s < S; ++s)
    if (lp[s] > 0 && sp[s] < T_) check_table(tp + s * B, lp[s], B, c);
  at::parallel_for(0, S * hkv, 1, [&](int64_t i0, int64_t i1) {   // one query token a sequence
    std::vector<float> buf;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / hkv, h = i % hkv, L = lp[s], t = sp[s];
      if (L <= 0 || sp[s + 1] - t != 1 || t >= T_) continue;   // a padding sequence: its rows stay zero
      attend_token<T>(qp + (t * hq + h * G) * d, op + (t * hq + h * G) * d, c, tp + s * B, L, h, G, d,
                    static_cast<float>(scale), buf);
    }
  });
  for (int64_t s = 0; s < S; ++s) {   // prompt chunks, one after another (each parallel inside)
    const int64_t L = lp[s], t = sp[s], n = sp[s + 1] - t;
    if (L > 0 && n > 1 && t < T_)
      paged::attend_chunk<T>(qp + t * hq * d, op + t * hq * d, c, tp + s * B, L, n, hq, hkv, d,
                             static_cast<float>(scale));
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv,
                            const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && kv.dim() == 5 &&
                  q.size(2) == k.size(2) && kv.size(4) == q.size(2) && kv.size(3) == k.size(1) &&
                  q.size(1) % k.size(1) == 0,
              "decode_attention: q [T, Hq, D], k and v [T, Hkv, D], the cache [blocks, 2, block_size, Hkv, D]; got ",
              q.sizes(), ", ", k.sizes(), ", ", kv.sizes());
  TORCH_CHECK(kv.stride(4) == 1, "decode_attention: the cache's rows of D must be contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type() &&
                  v.scalar_type() == kv.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "decode_attention: float32 or bfloat16 tensors of one dtype");
  for (const at::Tensor* m : {&slot_mapping, &block_tables, &seq_lens, &query_start_loc})
    TORCH_CHECK(m->scalar_type() == at::kLong, "decode_attention: int64 metadata");
  const int64_t S = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == S + 1 && block_tables.size(0) == S && slot_mapping.size(0) == q.size(0),
              "decode_attention: metadata shapes disagree");
  const at::Tensor starts = query_start_loc.contiguous(), lens = seq_lens.contiguous();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = sp[s + 1] - sp[s];
    if (n > 1 && !paged::chunk_served(q.size(2))) return at::empty({0}, q.options());   // not this build's
    TORCH_CHECK(n <= 1 || lp[s] <= 0 || (n <= lp[s] && sp[s + 1] <= q.size(0)), "decode_attention: sequence ", s,
                " brings ", n, " tokens (from ", sp[s], ") to a context of ", lp[s], " in a step of ", q.size(0));
  }
  const Cache c = paged::cache_of(kv);
  at::Tensor out = at::zeros(q.sizes(), q.options());
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), slots = slot_mapping.contiguous(),
                   tables = block_tables.contiguous();
  if (q.scalar_type() == at::kFloat)
    run<float>(qc, kc, vc, c, slots, tables, lens, starts, scale, out);
  else
    run<c10::BFloat16>(qc, kc, vc, c, slots, tables, lens, starts, scale, out);
  return out;
}

// The whole paged-attention op for the CPU with the kernel above in front: a step it serves costs one
// C++ call from a compiled graph; any other step (or dtype) goes on to phaseflip::paged_attention
// (kernels/attention.py, whose body is Python). Without it, every layer of a compiled decode step would
// go through that Python body to reach the kernel, a cost paid at every layer.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_cache,
                           int64_t layer, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale) {
  const bool served = q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16;
  if (served && kv_cache.dim() == 6 && q.size(0) > 0) {
    at::Tensor out = decode_attention(q, k, v, kv_cache.select(1, layer), slot_mapping, block_tables, seq_lens,
                                      query_start_loc, scale);
    if (out.numel()) return out;
  }
  static const c10::OperatorHandle general =
      c10::Dispatcher::singleton().findSchemaOrThrow("phaseflip::paged_attention", "");
  torch::jit::Stack stack{q, k, v, kv_cache, layer, slot_mapping, block_tables, seq_lens, query_start_loc, scale};
  general.callBoxed(&stack);
  return stack.back().toTensor();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(phaseflip, m) {
  m.def("cpu_decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_layer, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale) -> Tensor");
  m.impl("cpu_decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
  m.def("cpu_paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, SymInt layer, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale) -> Tensor");
  m.impl("cpu_paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
}
