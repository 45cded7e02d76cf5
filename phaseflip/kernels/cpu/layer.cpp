// A decode step's forward through a stack of decoder layers on the CPU, one token each of up to
// dot::MAX_ROWS sequences, in ONE parallel region: forward.py's decoder_layer with T == S, layer after
// layer, written as phases with a barrier between them instead of an operator (and a fork and join of
// torch's threads) each. A layer's phases: residual add + RMSNorm (a token a thread); the qkv product
// (weight rows split over the threads, each row read once for every token); per token and kv head: k norm
// (Qwen3), rotary and the K/V store; per token and query head: q norm, rotary and the attention over its
// sequence's paged cache (decode.cpp's attend_token); the o product; residual add + RMSNorm; gate and up
// products with SiLU-and-mul on each thread's own rows; the down product; after the last layer, on the
// rank that holds the head, the final residual add + RMSNorm (forward's `_add_norm`). Each product streams
// its weight once: float rows through dot.h's row dots, a GGUF file's blocks (its parts in their formats,
// one token only) through qrow.h's, which quant.cpp's one-row product takes too (each thread prepares x
// for it once a phase). Values are rounded to the activations' dtype W where the reference's operators
// round (kernels/reference/norm.py, rotary.py, activation.py), so bfloat16 follows eager torch's roundings
// (a norm's sum of squares is added in another order than torch's, so a value can still land one rounding
// apart); float32 is unaffected.
// Why: a small decode step streams its weights at the memory's speed, but between ~8 operators a layer
// the threads meet at every join and the main thread's dispatch runs alone; even one call a layer leaves
// time outside the region at every layer (parallel.h: a region with phases). Built and loaded by
// phaseflip/kernels/cpu/library.py with the other kernels; kernels/cpu/fused_layer.py decides when it runs.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <tuple>
#include <vector>
#include "dot.h"
#include "dtype.h"
#include "paged.h"
#include "parallel.h"
#include "layer_weights.h"
#include "qrow.h"

namespace {

template <typename W>
inline float rnd(float v) { return static_cast<float>(static_cast<W>(v)); }   // a value as W holds it

using layer_weights::Dims;
using layer_weights::LayerLists;
using layer_weights::Part;
using layer_weights::Proj;
using layer_weights::Weights;

template <typename W>
struct Scratch {   // the tokens' vectors between phases, shared by the threads: M rows of each
  using X = typename dot::Lanes<W>::X;   // what a product reads x as
  std::vector<X> h, attn_x, act;         // [M, H] normed input, [M, hq * D] attention output, [M, I] SiLU * up
  std::vector<W> qkv, q, attn, o, gate;  // [M, nqkv], [M, hq * D] roped q, [M, hq * D], [M, H], [M, 2 I]
  std::atomic<int64_t> taken[4];         // the products' tails dealt (qkv, o, gate and up, down): deal()
  void fit(const Dims& n, int64_t M) {
    h.resize(M * n.H), attn_x.resize(M * n.hq * n.d), act.resize(M * n.I);
    qkv.resize(M * n.nqkv), q.resize(M * n.hq * n.d), attn.resize(M * n.hq * n.d), o.resize(M * n.H);
    gate.resize(M * 2 * n.I);
  }
};

// res = resid (+ delta), rounded as W; h = w * round(res * rsqrt(mean(res^2) + eps)) (norm.add_rms_norm)
template <typename W, typename X>
void add_norm(const W* delta, const W* resid, const W* w, int64_t n, float eps, W* res, X* h) {
  float sq = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float r = delta ? rnd<W>(static_cast<float>(resid[i]) + static_cast<float>(delta[i]))
                          : static_cast<float>(resid[i]);
    res[i] = static_cast<W>(r);
    sq += r * r;
  }
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i)
    h[i] = static_cast<X>(rnd<W>(static_cast<float>(w[i]) * rnd<W>(static_cast<float>(res[i]) * inv)));
}

// x [D] in place: rms_norm with weight w [D] (Qwen3's per-head q/k norm): add_norm with nothing added
template <typename W>
void head_norm(W* x, const W* w, int64_t d, float eps) {
  add_norm<W, W>(nullptr, x, w, d, eps, x, x);
}

// out [D] = x [D] rotated (rotate_half; cos_sin [D]: cos in the first half, sin in the second); out may be x
template <typename W>
void rotate(const W* x, W* out, const float* cos_sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float c = rnd<W>(cos_sin[i]), s = rnd<W>(cos_sin[half + i]);
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[half + i]);
    out[i] = static_cast<W>(rnd<W>(x1 * c) - rnd<W>(x2 * s));
    out[half + i] = static_cast<W>(rnd<W>(x2 * c) + rnd<W>(x1 * s));
  }
}

// `in` = x (K values of the layers' dtype W) as the blocks' dot reads it, where w has blocks: each thread
// its own, before its products
template <typename W>
void prepare(const Proj& w, const typename Scratch<W>::X* x, int64_t K, qrow::Input& in) {
  if (w.blocks()) in.set(x, K, w.blocks32, w.blocks256);
}

// Columns [r.begin, r.end) of y's M rows (ldy apart) = w's rows . x's M rows (K values each), each part's
// rows by its own dot; `in`: x prepared (blocks: one row of x)
template <typename W>
void product(const Proj& w, const typename Scratch<W>::X* x, int64_t K, int64_t M, W* y, int64_t ldy, par::Range r,
             const qrow::Input& in) {
  int64_t first = 0;   // the part's first row among w's
  for (const Part& p : w.parts) {
    const int64_t n0 = std::max(r.begin, first) - first, n1 = std::min(r.end, first + p.rows) - first;
    W* out = y + first;
    if (n0 < n1 && p.type == 0)
      dot::gemv_rows<W>(static_cast<int>(M), static_cast<const W*>(p.p), p.ld, x, K, out, ldy, n0, n1);
    else if (n0 < n1)
      blocks::with_format(p.type, [&](auto b) {
        qrow::dots<decltype(b)>(static_cast<const uint8_t*>(p.p) + n0 * p.ld, p.ld, n1 - n0, in, out + n0);
      });
    first += p.rows;
  }
}

// fn(range) over [0, n) split between the threads: each its equal share of the first ~7/8 (one long run of
// rows, which its dot streams in parts), then the rest in chunks of ~n / 64 taken by whichever thread is
// free (`taken`: this phase's counter, zero before it), so that a thread slowed in its share leaves the
// others the tail instead of waiting at the barrier. Shares and chunks are whole multiples of 4 rows, what
// the dots read in step (dot.h, int8.h), so that few rows fall to their one-row form (whose float32 sums
// add in another order), and the rows each form takes do not depend on which thread takes them
template <typename Fn>
void deal(const par::Team& team, std::atomic<int64_t>& taken, int64_t n, const Fn& fn) {
  const int64_t unit = 4 * team.size, fixed = (n - n / 8) / unit * unit, chunk = std::max<int64_t>(4, n / 64 / 4 * 4);
  const par::Range mine = team.share(fixed);
  if (mine.begin < mine.end) fn(mine);
  for (int64_t c = taken.fetch_add(chunk); fixed + c < n; c = taken.fetch_add(chunk))
    fn(par::Range{fixed + c, std::min(n, fixed + c + chunk)});
}

struct Step {   // what the phases read besides the weights and the scratch
  Dims n;
  int64_t M;               // tokens, one a sequence: token m is sequence m's
  const paged::Batch& b;   // their slots, contexts and block tables
  const float* cos_sin;    // [M, D] the tokens' rotary
  float eps;
};

// Kv head h of token m: k norm (Qwen3), rotary, and the K/V store at the token's slot
template <typename W>
void store_head(const Weights<W>& w, const Step& st, const paged::Cache& c, Scratch<W>& s, int64_t m, int64_t h) {
  const int64_t d = st.n.d;
  W* k = s.qkv.data() + m * st.n.nqkv + (st.n.hq + h) * d;
  const W* v = s.qkv.data() + m * st.n.nqkv + (st.n.hq + st.n.hkv + h) * d;
  if (w.k_norm) head_norm(k, w.k_norm, d, st.eps);
  if (st.b.slots[m] < 0) return;
  rotate(k, k, st.cos_sin + m * d, d);
  paged::store(c, st.b.slots[m], h, k, v, d);
}

// Query heads `items` of the tokens (item i: token i / hq's head i % hq; their K/V stored): q norm
// (Qwen3), rotary, then each run of a token's heads that shares a kv head attends its sequence's cached
// positions in one pass over its K and V (zeros where its context is empty, as decode.cpp gives a padding
// token). Split by query heads, not kv heads: SmolLM2's 3 kv heads on 2 threads would leave one thread
// twice the other's attention. Item i's q, attention and output are at i * D of their [M, hq * D] rows
template <typename W>
void attend_heads(const Weights<W>& w, const Step& st, const paged::Cache& c, Scratch<W>& s, par::Range items,
                  std::vector<float>& buf) {
  const int64_t d = st.n.d, hq = st.n.hq, G = hq / st.n.hkv;
  for (int64_t i = items.begin; i < items.end; ++i) {
    const int64_t m = i / hq;
    W* qg = s.qkv.data() + m * st.n.nqkv + (i % hq) * d;
    if (w.q_norm) head_norm(qg, w.q_norm, d, st.eps);
    rotate(qg, s.q.data() + i * d, st.cos_sin + m * d, d);
  }
  for (int64_t i = items.begin; i < items.end;) {
    const int64_t m = i / hq, h = (i % hq) / G, end = std::min(items.end, m * hq + (h + 1) * G);
    W* out = s.attn.data() + i * d;
    if (st.b.lens[m] > 0)
      paged::attend_token<W>(s.q.data() + i * d, out, c, st.b.table(m), 0, st.b.lens[m], st.b.scale, 0.f, h, end - i,
                             d, buf);
    else
      std::fill_n(out, (end - i) * d, static_cast<W>(0.f));
    for (int64_t j = 0; j < (end - i) * d; ++j) s.attn_x[i * d + j] = static_cast<typename Scratch<W>::X>(out[j]);
    i = end;
  }
}

// A layer's attention, as phases of the region: the qkv product (+ bias), the K/V store, the attention,
// the o product (into s.o)
template <typename W>
void attention_phases(const par::Team& team, const Weights<W>& w, const Step& st, const paged::Cache& c,
                      Scratch<W>& s, std::vector<float>& buf, qrow::Input& in) {
  const Dims& n = st.n;
  const int64_t M = st.M;
  prepare<W>(w.qkv, s.h.data(), n.H, in);
  deal(team, s.taken[0], n.nqkv, [&](par::Range qkv) {
    product(w.qkv, s.h.data(), n.H, M, s.qkv.data(), n.nqkv, qkv, in);
    if (w.qkv_b)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t i = qkv.begin; i < qkv.end; ++i) {
          W& y = s.qkv[m * n.nqkv + i];
          y = static_cast<W>(static_cast<float>(y) + static_cast<float>(w.qkv_b[i]));
        }
  });
  team.barrier();
  if (team.id == 0) s.taken[0] = 0;   // for the next layer's (every thread is past this phase)
  for (int64_t j = team.id; j < M * n.hkv; j += team.size) store_head(w, st, c, s, j / n.hkv, j % n.hkv);
  team.barrier();
  attend_heads(w, st, c, s, team.share(M * n.hq), buf);
  team.barrier();
  prepare<W>(w.o, s.attn_x.data(), n.hq * n.d, in);
  deal(team, s.taken[1], n.H,
       [&](par::Range r) { product(w.o, s.attn_x.data(), n.hq * n.d, M, s.o.data(), n.H, r, in); });
  team.barrier();
  if (team.id == 0) s.taken[1] = 0;
}

// A layer's MLP, as phases of the region: gate and up products with SiLU * up on each thread's own rows,
// then the down product (into delta_out)
template <typename W>
void mlp_phases(const par::Team& team, const Weights<W>& w, const Dims& n, int64_t M, Scratch<W>& s, W* delta_out,
                qrow::Input& in) {
  prepare<W>(w.gate_up, s.h.data(), n.H, in);
  deal(team, s.taken[2], n.I, [&](par::Range i) {   // gate rows [begin, end) and the same up rows
    product(w.gate_up, s.h.data(), n.H, M, s.gate.data(), 2 * n.I, i, in);
    product(w.gate_up, s.h.data(), n.H, M, s.gate.data(), 2 * n.I, {n.I + i.begin, n.I + i.end}, in);
    for (int64_t m = 0; m < M; ++m) {
      const W* gate = s.gate.data() + m * 2 * n.I;   // token m's gate, then its up
      for (int64_t r = i.begin; r < i.end; ++r) {
        const float g = static_cast<float>(gate[r]), u = static_cast<float>(gate[n.I + r]);
        s.act[m * n.I + r] = static_cast<typename Scratch<W>::X>(rnd<W>(rnd<W>(g / (1.f + std::exp(-g))) * u));
      }
    }
  });
  team.barrier();
  if (team.id == 0) s.taken[2] = 0;
  prepare<W>(w.down, s.act.data(), n.I, in);
  deal(team, s.taken[3], n.H, [&](par::Range r) { product(w.down, s.act.data(), n.I, M, delta_out, n.H, r, in); });
  team.barrier();
  if (team.id == 0) s.taken[3] = 0;
}

// Each token's residual add + RMSNorm (add_norm's rows, H values each), a token a thread, then a barrier
template <typename W, typename X>
void norm_rows(const par::Team& team, int64_t M, int64_t H, const W* delta, const W* resid, const W* w, float eps,
               W* res, X* h) {
  for (int64_t m = team.id; m < M; m += team.size)
    add_norm(delta ? delta + m * H : nullptr, resid + m * H, w, H, eps, res + m * H, h + m * H);
  team.barrier();
}

// The layers in order: the residual stream resid [M, H] in; delta_out (the last MLP's output) and res_out
// (the residual stream before it) out, and each layer's K/V of the tokens stored. The outputs carry the stream
// from layer to layer; a barrier closes each layer (the next one's norm reads all of it). With a final
// norm (the rank holds the head): the last MLP's output added to res_out, and delta_out its norm instead
template <typename W>
void layers(const std::vector<Weights<W>>& ws, const Step& st, const W* resid, W* delta_out, W* res_out,
            const std::vector<paged::Cache>& caches, const W* final_norm) {
  static thread_local Scratch<W> mine;   // the calling thread's
  Scratch<W>& s = mine;                  // named in the region: the region's threads share it (mine
  s.fit(st.n, st.M);                     // there would be each thread's own)
  for (std::atomic<int64_t>& t : s.taken) t = 0;
  const int64_t H = st.n.H, M = st.M;
  par::region([&](const par::Team& team) {
    static thread_local std::vector<float> buf;   // each thread's attention scratch
    static thread_local qrow::Input in;           // and its x for the products on blocks
    for (size_t l = 0; l < ws.size(); ++l) {
      const Weights<W>& w = ws[l];
      const W* delta = l ? delta_out : nullptr;   // the last layer's MLP output, not yet added
      norm_rows(team, M, H, delta, l ? res_out : resid, w.ln1, st.eps, res_out, s.h.data());
      attention_phases(team, w, st, caches[l], s, buf, in);
      norm_rows(team, M, H, s.o.data(), res_out, w.ln2, st.eps, res_out, s.h.data());
      mlp_phases(team, w, st.n, M, s, delta_out, in);
    }
    if (final_norm) norm_rows<W, W>(team, M, H, delta_out, res_out, final_norm, st.eps, res_out, delta_out);
  });
}


template <typename W>
std::tuple<at::Tensor, at::Tensor> decode_layers_as(const at::Tensor& residual, const LayerLists& lists,
                                                    const at::Tensor& kv_cache, const paged::Batch& b,
                                                    const at::Tensor& cos_sin, double eps,
                                                    const c10::optional<at::Tensor>& final_norm) {
  const at::ScalarType dt = residual.scalar_type();
  const Dims n = layer_weights::dims_of(residual, lists, kv_cache, dt);
  const int64_t M = residual.size(0);
  TORCH_CHECK(b.tokens == M && b.seqs == M && b.starts == nullptr, "decode_layers: the metadata of one token a "
              "sequence for the residual's ", M, ", got ", b.tokens, " tokens and ", b.seqs, " sequences");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.numel() == M * n.d && cos_sin.is_contiguous(),
              "decode_layers: cos_sin [", M, ", D] float32, got ", cos_sin.sizes());
  std::vector<paged::Cache> caches;
  for (size_t l = 0; l < lists.o.size(); ++l)
    caches.push_back(paged::cache_of(kv_cache.select(1, static_cast<int64_t>(l))));
  paged::check(b, caches[0]);   // every layer's cache has the first's blocks
  const std::vector<Weights<W>> ws = layer_weights::checked<W>(lists, n, dt);
  for (const Weights<W>& w : ws)
    TORCH_CHECK(M == 1 || !(w.qkv.blocks() || w.o.blocks() || w.gate_up.blocks() || w.down.blocks()),
                "decode_layers: weights in GGUF blocks take one token, got ", M);
  const W* norm = nullptr;
  if (final_norm.has_value()) {
    layer_weights::check_vector(*final_norm, n.H, "final_norm", dt);
    norm = final_norm->data_ptr<W>();
  }
  at::Tensor delta_out = at::empty({M, n.H}, residual.options()), res_out = at::empty({M, n.H}, residual.options());
  const Step st{n, M, b, cos_sin.data_ptr<float>(), static_cast<float>(eps)};
  layers<W>(ws, st, residual.data_ptr<W>(), delta_out.data_ptr<W>(), res_out.data_ptr<W>(), caches, norm);
  return {delta_out, res_out};
}

std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& residual, at::TensorList input_norm,
    at::TensorList qkv, at::TensorList qkv_bias, at::TensorList q_norm, at::TensorList k_norm, at::TensorList o,
    at::TensorList post_norm, at::TensorList gate_up, at::TensorList down, at::IntArrayRef qkv_parts,
    at::IntArrayRef gate_up_parts, const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cos_sin, double eps, double scale,
    const c10::optional<at::Tensor>& final_norm) {
  const LayerLists lists{input_norm, qkv, qkv_bias, q_norm, k_norm, o, post_norm, gate_up, down, qkv_parts,
                         gate_up_parts};
  return dtype::dispatch("decode_layers", residual.scalar_type(), [&](auto zero) {
    const paged::Batch b = paged::batch_of("decode_layers", slot_mapping, block_tables, seq_lens, at::Tensor(), scale);
    return decode_layers_as<decltype(zero)>(residual, lists, kv_cache, b, cos_sin, eps, final_norm);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(phaseflip, m) {
  m.def("cpu_decode_layers(Tensor residual, Tensor[] input_norm, Tensor[] qkv, Tensor[] qkv_bias, "
        "Tensor[] q_norm, Tensor[] k_norm, Tensor[] o, Tensor[] post_norm, Tensor[] gate_up, Tensor[] down, "
        "int[] qkv_parts, int[] gate_up_parts, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor block_tables, "
        "Tensor seq_lens, Tensor cos_sin, float eps, float scale, Tensor? final_norm=None) -> (Tensor, Tensor)");
  m.impl("cpu_decode_layers", c10::DispatchKey::CPU, TORCH_FN(decode_layers));
}
