// Paged attention for a step on the CPU, read in place: every decode token (a sequence's one query
// token) reads its sequence's K and V rows straight from the paged cache (block table -> block ->
// row), one (sequence, kv head) per task over torch's threads, with no gathered copy of any context;
// a sequence that brings a prompt chunk (more than one token) goes to prefill.cpp. The contract is
// kernels/attention.py's (store this step's K/V at slot_mapping, then attend; padding tokens give
// zeros), as the op `phaseflip::cpu_paged_attention` (phaseflip::paged_attention's schema): every step
// of float32 or bfloat16, any head size, eager or compiled. With a sliding window a decode token reads
// only its window's rows. Built and loaded by
// phaseflip/kernels/cpu/library.py with the other kernels.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <vector>
#include "dtype.h"
#include "paged.h"
#include "parallel.h"

namespace {

using paged::Batch;
using paged::Cache;
using paged::row;

template <typename T>
inline float widen(T x) { return static_cast<float>(x); }

#ifdef PF_LANES
// fn(pos - p0, k row, v row) for each of a sequence's cached positions [p0, L) of kv head h, block by block (no
// division per position: a divide a row costs as much as a few vectors of scores). With Fetch, each
// position also asks for the same position's K and V rows one block on (the blocks lie anywhere in the
// cache, beyond the hardware's prefetch: without it the K pass waits on memory)
template <typename T, bool Fetch, typename Fn>
inline void for_rows(const Cache& c, const int64_t* table, int64_t p0, int64_t L, int64_t h, int64_t d, Fn&& fn) {
  const int64_t blocks = (L + c.block_size - 1) / c.block_size;
  for (int64_t b = p0 / c.block_size, pos = p0; pos < L; ++b) {
    const T* k = row<T>(c, table[b], 0, h, 0);
    const T* v = row<T>(c, table[b], 0, h, 1);
    const T* kn = b + 1 < blocks ? row<T>(c, table[b + 1], 0, h, 0) : nullptr;
    const T* vn = b + 1 < blocks ? row<T>(c, table[b + 1], 0, h, 1) : nullptr;
    const int64_t n = std::min(c.block_size, L - b * c.block_size);
    for (int64_t off = pos - b * c.block_size; off < n; ++off, ++pos) {
      if (Fetch && kn != nullptr)
        for (int64_t byte = 0; byte < d * (int64_t)sizeof(T); byte += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(kn + off * c.so) + byte, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(vn + off * c.so) + byte, _MM_HINT_T1);
        }
      fn(pos - p0, k + off * c.so, v + off * c.so);
    }
  }
}

// D a multiple of LANES * CH: the G heads' score sums in registers; the weighted V summed CH x LANES lanes
// at a time for all G heads (G * CH independent accumulators: one per head would make a chain of
// dependent FMAs, one per position)
template <typename T, int G, int CH>
void attend_vec(const float* qf /* [G, D], scaled */, T* out, const Cache& c, const int64_t* table, int64_t p0,
                int64_t end, float softcap, int64_t h, int64_t d, float* scores /* [G, L] */) {
  const int64_t L = end - p0;   // positions read
  for_rows<T, true>(c, table, p0, end, h, d, [&](int64_t pos, const T* kr, const T*) {
    pf::vf acc[G];
    for (int g = 0; g < G; ++g) acc[g] = pf::zero();
    for (int64_t i = 0; i < d; i += pf::LANES) {
      const pf::vf kv = pf::load(kr + i);
      for (int g = 0; g < G; ++g) acc[g] = pf::fma(pf::load(qf + g * d + i), kv, acc[g]);
    }
    for (int g = 0; g < G; ++g) scores[g * L + pos] = pf::sum(acc[g]);
  });
  paged::softmax_rows(scores, G, L, L, softcap);
  for (int64_t i0 = 0; i0 < d; i0 += pf::LANES * CH) {
    pf::vf acc[G][CH];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < CH; ++j) acc[g][j] = pf::zero();
    for_rows<T, false>(c, table, p0, end, h, d, [&](int64_t pos, const T*, const T* vr) {
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
bool attend_vec_any(const float* qf, T* out, const Cache& c, const int64_t* table, int64_t p0, int64_t L,
                    float softcap, int64_t h, int64_t d, float* scores) {
  constexpr int accs = pf::LANES == 16 ? 16 : 12;
  if (d % (4 * pf::LANES) == 0 && G * 4 <= accs)
    return attend_vec<T, G, 4>(qf, out, c, table, p0, L, softcap, h, d, scores), true;
  if (d % (2 * pf::LANES) == 0 && G * 2 <= accs)
    return attend_vec<T, G, 2>(qf, out, c, table, p0, L, softcap, h, d, scores), true;
  if (d % pf::LANES == 0) return attend_vec<T, G, 1>(qf, out, c, table, p0, L, softcap, h, d, scores), true;
  return false;
}
#endif

// Any D and G: plain loops
template <typename T>
void attend_loops(const float* qf, T* out, const Cache& c, const int64_t* table, int64_t p0, int64_t end,
                  float softcap, int64_t h, int64_t G, int64_t d, float* scores, float* acc /* [G, D] */) {
  const int64_t L = end - p0;   // positions read: p0 + pos
  for (int64_t pos = 0; pos < L; ++pos) {
    const T* kr = row<T>(c, table[(p0 + pos) / c.block_size], (p0 + pos) % c.block_size, h, 0);
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < d; ++i) s += qf[g * d + i] * widen(kr[i]);
      scores[g * L + pos] = s;
    }
  }
  paged::softmax_rows(scores, G, L, L, softcap);
  std::fill_n(acc, G * d, 0.f);
  for (int64_t pos = 0; pos < L; ++pos) {
    const T* vr = row<T>(c, table[(p0 + pos) / c.block_size], (p0 + pos) % c.block_size, h, 1);
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

// One sequence's G query heads of kv head h over its cached positions: scores, softmax, weighted V.
// Two passes over the context, K then V, each row read once for all G heads; sums in float32.
template <typename T>
void attend_token(const T* q /* [G, D] */, T* out /* [G, D] */, const Cache& c, const int64_t* table, int64_t p0,
                  int64_t L, float scale, float softcap, int64_t h, int64_t G, int64_t d, std::vector<float>& buf) {
  buf.resize(G * (L - p0 + 2 * d));
  float* scores = buf.data();                 // [G, L - p0]
  float* qf = scores + G * (L - p0);          // [G, D] the queries as float, scaled
  float* acc = qf + G * d;                    // [G, D]
  for (int64_t i = 0; i < G * d; ++i) qf[i] = widen(q[i]) * scale;
#ifdef PF_LANES
  switch (G) {
    case 1: if (attend_vec_any<T, 1>(qf, out, c, table, p0, L, softcap, h, d, scores)) return; break;
    case 2: if (attend_vec_any<T, 2>(qf, out, c, table, p0, L, softcap, h, d, scores)) return; break;
    case 3: if (attend_vec_any<T, 3>(qf, out, c, table, p0, L, softcap, h, d, scores)) return; break;
    case 4: if (attend_vec_any<T, 4>(qf, out, c, table, p0, L, softcap, h, d, scores)) return; break;
    case 5: if (attend_vec_any<T, 5>(qf, out, c, table, p0, L, softcap, h, d, scores)) return; break;
    case 6: if (attend_vec_any<T, 6>(qf, out, c, table, p0, L, softcap, h, d, scores)) return; break;
    case 7: if (attend_vec_any<T, 7>(qf, out, c, table, p0, L, softcap, h, d, scores)) return; break;
    case 8: if (attend_vec_any<T, 8>(qf, out, c, table, p0, L, softcap, h, d, scores)) return; break;
    default: break;
  }
#endif
  attend_loops<T>(qf, out, c, table, p0, L, softcap, h, G, d, scores, acc);
}

template void attend_token<float>(const float*, float*, const Cache&, const int64_t*, int64_t, int64_t, float, float,
                                  int64_t, int64_t, int64_t, std::vector<float>&);
template void attend_token<c10::BFloat16>(const c10::BFloat16*, c10::BFloat16*, const Cache&, const int64_t*, int64_t,
                                          int64_t, float, float, int64_t, int64_t, int64_t, std::vector<float>&);

}  // namespace paged

namespace {

// Every token's K and V rows at its slot, before any token attends (its own position included)
template <typename T>
void store_step(const at::Tensor& k, const at::Tensor& v, const Cache& c, const Batch& b, int64_t hkv, int64_t d) {
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  for (int64_t t = 0; t < b.tokens; ++t)
    for (int64_t h = 0; h < hkv; ++h) paged::store(c, b.slots[t], h, kp + (t * hkv + h) * d, vp + (t * hkv + h) * d, d);
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Cache& c, const Batch& b,
         at::Tensor& out) {
  const paged::Heads heads{q.size(1), k.size(1), q.size(2)};
  const int64_t hq = heads.hq, hkv = heads.hkv, d = heads.d, G = hq / hkv;
  store_step<T>(k, v, c, b, hkv, d);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  par::ranges(b.seqs * hkv, 1, [&](int64_t i0, int64_t i1) {   // one query token a sequence
    std::vector<float> buf;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / hkv, h = i % hkv, t = b.first(s);
      if (!b.attends(s) || b.count(s) != 1) continue;   // a padding sequence: its rows stay zero
      paged::attend_token<T>(qp + (t * hq + h * G) * d, op + (t * hq + h * G) * d, c, b.table(s), b.oldest(b.lens[s]),
                             b.lens[s], b.scale, b.softcap, h, G, d, buf);
    }
  });
  for (int64_t s = 0; s < b.seqs; ++s)   // prompt chunks, one after another (each parallel inside)
    if (b.attends(s) && b.count(s) > 1) paged::attend_chunk<T>(qp, op, c, b, s, heads);
}

// What both ops check, and the step's Batch: q [T, Hq, D], k and v [T, Hkv, D] and one layer's cache kv
// [blocks, 2, block_size, Hkv, D], of one dtype; each chunk within its context and the step; every slot
// and attended block within the cache
Batch checked(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv,
              const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
              const at::Tensor& query_start_loc, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && kv.dim() == 5 &&
                  q.size(2) == k.size(2) && kv.size(4) == q.size(2) && kv.size(3) == k.size(1) &&
                  q.size(1) % k.size(1) == 0,
              op, ": q [T, Hq, D], k and v [T, Hkv, D], the cache [blocks, 2, block_size, Hkv, D]; got ",
              q.sizes(), ", ", k.sizes(), ", ", kv.sizes());
  TORCH_CHECK(kv.stride(4) == 1, op, ": the cache's rows of D must be contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type() &&
                  v.scalar_type() == kv.scalar_type(),
              op, ": q, k, v and the cache of one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type(), ", ", kv.scalar_type());
  Batch b = paged::batch_of(op, slot_mapping, block_tables, seq_lens, query_start_loc, scale, window, softcap);
  TORCH_CHECK(b.tokens == q.size(0), op, ": slot_mapping ", slot_mapping.sizes(), " for ", q.size(0), " tokens");
  for (int64_t s = 0; s < b.seqs; ++s) {
    const int64_t n = b.count(s), L = b.lens[s];
    TORCH_CHECK(n <= 1 || L <= 0 || (n <= L && b.first(s) + n <= b.tokens), op, ": sequence ", s, " brings ", n,
                " tokens (from ", b.first(s), ") to a context of ", L, " in a step of ", b.tokens);
  }
  paged::check(b, paged::cache_of(kv));
  return b;
}

at::Tensor attention(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& kv, const Batch& b) {
  at::Tensor out = at::zeros(q.sizes(), q.options());
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  dtype::dispatch(op, q.scalar_type(), [&](auto zero) {
    run<decltype(zero)>(qc, kc, vc, paged::cache_of(kv), b, out);
  });
  return out;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_cache,
                           int64_t layer, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                           int64_t window, double softcap) {
  const char* op = "cpu_paged_attention";
  TORCH_CHECK(kv_cache.dim() == 6 && layer >= 0 && layer < kv_cache.size(1), op,
              ": the cache [blocks, layers, 2, block_size, Hkv, D] and a layer of it, got ", kv_cache.sizes(),
              " and layer ", layer);
  const at::Tensor kv = kv_cache.select(1, layer);
  return attention(op, q, k, v, kv, checked(op, q, k, v, kv, slot_mapping, block_tables, seq_lens, query_start_loc,
                                            scale, window, softcap));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(phaseflip, m) {
  m.def("cpu_paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, SymInt layer, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, int window=0, float softcap=0.0) -> Tensor");
  m.impl("cpu_paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
}
