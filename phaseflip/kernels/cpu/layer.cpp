// A one-token forward through a stack of decoder layers on the CPU (a batch-1 decode step's layers) in
// ONE parallel region: forward.py's decoder_layer at T == 1, layer after layer, written as phases with a
// barrier between them instead of an operator (and a fork and join of torch's threads) each. A layer's
// phases: residual add + RMSNorm; the qkv product (rows split over the threads); per kv head: k norm
// (Qwen3), rotary and the K/V store; per query head: q norm, rotary and the attention over the paged
// cache (decode.cpp's attend_token); the o product; residual add + RMSNorm; gate and up products
// with SiLU-and-mul on each thread's own rows; the down product. Each product streams its weight once
// through dot.h's row dot. Values are rounded to the weights' dtype where the reference's operators
// round (kernels/reference/norm.py, rotary.py, activation.py), so bfloat16 follows eager torch's roundings (a norm's
// sum of squares is added in another order than torch's, so a value can still land one rounding apart);
// float32 is unaffected.
// Why: at batch 1 the weights stream at the memory's speed, but between ~8 operators a layer the threads
// meet at every join and the main thread's dispatch runs alone; even one call a layer leaves time outside
// the region at every layer. Built and loaded by
// phaseflip/kernels/cpu/library.py with the other kernels; kernels/cpu/fused_layer.py decides when it runs.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <omp.h>
#include <torch/library.h>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>
#include "dot.h"
#include "paged.h"

namespace {

template <typename W>
inline float rnd(float v) { return static_cast<float>(static_cast<W>(v)); }   // a value as W holds it

struct Dims {
  int64_t H, hq, hkv, d, I, nqkv;
};

template <typename W>
struct Weights {   // one layer's, as the arena holds them (rows contiguous, `ld` apart)
  const W *ln1, *qkv, *qkv_b, *q_norm, *k_norm, *o, *ln2, *gate_up, *down;
  int64_t ld_qkv, ld_o, ld_gate_up, ld_down;
};

template <typename W>
struct Scratch {   // the token's vectors between phases, shared by the threads
  using X = typename dot::Lanes<W>::X;   // what a product reads x as
  std::vector<X> h, attn_x, act;         // [H] normed input, [hq * D] attention output, [I] SiLU * up
  std::vector<W> qkv, q, attn, o, gate;  // [nqkv], [hq * D] roped q, [hq * D], [H], [2 I]
  void fit(const Dims& n) {
    h.resize(n.H), attn_x.resize(n.hq * n.d), act.resize(n.I);
    qkv.resize(n.nqkv), q.resize(n.hq * n.d), attn.resize(n.hq * n.d), o.resize(n.H), gate.resize(2 * n.I);
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

// x [D] in place: rms_norm with weight w [D] (Qwen3's per-head q/k norm), rounded as the reference
template <typename W>
void head_norm(W* x, const W* w, int64_t d, float eps) {
  float sq = 0.f;
  for (int64_t i = 0; i < d; ++i) sq += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i)
    x[i] = static_cast<W>(static_cast<float>(w[i]) * rnd<W>(static_cast<float>(x[i]) * inv));
}

// out [D] = x [D] rotated (rotate_half; cos_sin [D]: cos in the first half, sin in the second)
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

// This thread's share [n0, n1) of N rows: equal parts in thread order
inline void share(int64_t N, int t, int nt, int64_t& n0, int64_t& n1) {
  n0 = N * t / nt;
  n1 = N * (t + 1) / nt;
}

struct Token {   // where the token's K/V go and what it attends
  int64_t slot, ctx, width;   // cache slot (< 0: none), positions attended (this one included), table width
  const int64_t* table;
  const float* cos_sin;       // [D]
};

// Kv head h of the token: k norm (Qwen3), rotary, and the K/V store at the token's slot
template <typename W>
void store_head(const Weights<W>& w, const Dims& n, const paged::Cache& c, const Token& tok, float eps,
                Scratch<W>& s, int64_t h) {
  const int64_t d = n.d;
  W* k = s.qkv.data() + (n.hq + h) * d;
  const W* v = s.qkv.data() + (n.hq + n.hkv + h) * d;
  if (w.k_norm) head_norm(k, w.k_norm, d, eps);
  if (tok.slot < 0) return;
  const int64_t block = tok.slot / c.block_size, off = tok.slot % c.block_size;
  rotate(k, paged::row<W>(c, block, off, h, 0), tok.cos_sin, d);
  std::copy_n(v, d, paged::row<W>(c, block, off, h, 1));
}

// Query heads [g0, g1) of the token (stored K/V): q norm (Qwen3), rotary, then each run of them that
// shares a kv head attends the ctx cached positions in one pass over its K and V (zeros where ctx <= 0,
// as decode.cpp gives a padding token). Split by query heads, not kv heads: SmolLM2's 3 kv heads on
// 2 threads left one thread with twice the other's attention
template <typename W>
void attend_heads(const Weights<W>& w, const Dims& n, const paged::Cache& c, const Token& tok, float eps,
                  float scale, Scratch<W>& s, int64_t g0, int64_t g1, std::vector<float>& buf) {
  const int64_t d = n.d, G = n.hq / n.hkv;
  for (int64_t g = g0; g < g1; ++g) {
    W* qg = s.qkv.data() + g * d;
    if (w.q_norm) head_norm(qg, w.q_norm, d, eps);
    rotate(qg, s.q.data() + g * d, tok.cos_sin, d);
  }
  for (int64_t g = g0; g < g1;) {
    const int64_t h = g / G, end = std::min(g1, (h + 1) * G);
    W* out = s.attn.data() + g * d;
    if (tok.ctx > 0)
      paged::attend_token<W>(s.q.data() + g * d, out, c, tok.table, tok.ctx, h, end - g, d, scale, buf);
    else
      std::fill_n(out, (end - g) * d, static_cast<W>(0.f));
    for (int64_t i = 0; i < (end - g) * d; ++i) s.attn_x[g * d + i] = static_cast<typename Scratch<W>::X>(out[i]);
    g = end;
  }
}

// The layers in order: the residual stream resid in; delta_out (the last MLP's output) and res_out (the
// residual stream before it) out, and each layer's K/V of the token stored. The outputs carry the stream
// from layer to layer; a barrier closes each layer (the next one's norm reads all of it)
template <typename W>
void layers(const std::vector<Weights<W>>& ws, const Dims& n, const W* resid, W* delta_out,
            W* res_out, const std::vector<paged::Cache>& caches, const Token& tok, float eps, float scale) {
  static thread_local Scratch<W> mine;   // the calling thread's
  Scratch<W>& s = mine;                  // named in the region: the region's threads share it (mine
  s.fit(n);                              // there would be each thread's own)
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    static thread_local std::vector<float> buf;   // each thread's attention scratch
    int64_t n0, n1;
    for (size_t l = 0; l < ws.size(); ++l) {
      const Weights<W>& w = ws[l];
#pragma omp single
      add_norm(l ? delta_out : nullptr, l ? res_out : resid, w.ln1, n.H, eps, res_out, s.h.data());
      share(n.nqkv, t, nt, n0, n1);
      dot::gemv_range<W, 1>(w.qkv, w.ld_qkv, s.h.data(), n.H, s.qkv.data(), n.nqkv, n0, n1);
      if (w.qkv_b)
        for (int64_t i = n0; i < n1; ++i)
          s.qkv[i] = static_cast<W>(static_cast<float>(s.qkv[i]) + static_cast<float>(w.qkv_b[i]));
#pragma omp barrier
      for (int64_t h = t; h < n.hkv; h += nt) store_head(w, n, caches[l], tok, eps, s, h);
#pragma omp barrier
      share(n.hq, t, nt, n0, n1);
      attend_heads(w, n, caches[l], tok, eps, scale, s, n0, n1, buf);
#pragma omp barrier
      share(n.H, t, nt, n0, n1);
      dot::gemv_range<W, 1>(w.o, w.ld_o, s.attn_x.data(), n.hq * n.d, s.o.data(), n.H, n0, n1);
#pragma omp barrier
#pragma omp single
      add_norm(s.o.data(), res_out, w.ln2, n.H, eps, res_out, s.h.data());
      share(n.I, t, nt, n0, n1);   // gate rows [n0, n1) and the same up rows: SiLU * up on this thread's own
      dot::gemv_range<W, 1>(w.gate_up, w.ld_gate_up, s.h.data(), n.H, s.gate.data(), 2 * n.I, n0, n1);
      dot::gemv_range<W, 1>(w.gate_up, w.ld_gate_up, s.h.data(), n.H, s.gate.data(), 2 * n.I, n.I + n0, n.I + n1);
      for (int64_t i = n0; i < n1; ++i) {
        const float g = static_cast<float>(s.gate[i]), u = static_cast<float>(s.gate[n.I + i]);
        s.act[i] = static_cast<typename Scratch<W>::X>(rnd<W>(rnd<W>(g / (1.f + std::exp(-g))) * u));
      }
#pragma omp barrier
      share(n.H, t, nt, n0, n1);
      dot::gemv_range<W, 1>(w.down, w.ld_down, s.act.data(), n.I, delta_out, n.H, n0, n1);
#pragma omp barrier
    }
  }
}

void check_weight(const at::Tensor& t, int64_t rows, int64_t cols, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols && t.stride(1) == 1 && !t.is_cuda(),
              "decode_layers: ", name, " must be a CPU [", rows, ", ", cols, "] weight with contiguous rows, got ",
              t.sizes(), " strides ", t.strides());
  TORCH_CHECK(t.scalar_type() == dtype, "decode_layers: ", name, " is ", t.scalar_type(), ", the layers' ", dtype);
}

void check_vector(const at::Tensor& t, int64_t n, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.numel() == n && t.is_contiguous() && t.scalar_type() == dtype && !t.is_cuda(),
              "decode_layers: ", name, " must be a contiguous CPU vector of ", n, " ", dtype, ", got ", t.sizes(),
              " ", t.scalar_type());
}

// One list per weight kind, a layer's entry at its index; qkv_bias, q_norm and k_norm empty where the
// model has none
struct LayerLists {
  at::TensorList ln1, qkv, qkv_b, q_norm, k_norm, o, ln2, gate_up, down;
};

template <typename W>
std::vector<Weights<W>> checked(const LayerLists& L, const Dims& n, at::ScalarType dt) {
  const size_t count = L.qkv.size();
  for (const at::TensorList* list : {&L.ln1, &L.o, &L.ln2, &L.gate_up, &L.down})
    TORCH_CHECK(list->size() == count, "decode_layers: every weight list holds one tensor a layer (", count, ")");
  for (const at::TensorList* list : {&L.qkv_b, &L.q_norm, &L.k_norm})
    TORCH_CHECK(list->empty() || list->size() == count, "decode_layers: qkv_bias, q_norm and k_norm hold one "
                "tensor a layer or none");
  std::vector<Weights<W>> ws;
  for (size_t l = 0; l < count; ++l) {
    check_weight(L.qkv[l], n.nqkv, n.H, "qkv_proj", dt);
    check_weight(L.o[l], n.H, n.hq * n.d, "o_proj", dt);
    check_weight(L.gate_up[l], 2 * n.I, n.H, "gate_up_proj", dt);
    check_weight(L.down[l], n.H, n.I, "down_proj", dt);
    check_vector(L.ln1[l], n.H, "input_layernorm", dt);
    check_vector(L.ln2[l], n.H, "post_attention_layernorm", dt);
    if (!L.qkv_b.empty()) check_vector(L.qkv_b[l], n.nqkv, "qkv_bias", dt);
    if (!L.q_norm.empty()) check_vector(L.q_norm[l], n.d, "q_norm", dt);
    if (!L.k_norm.empty()) check_vector(L.k_norm[l], n.d, "k_norm", dt);
    const auto opt = [l](at::TensorList list) { return list.empty() ? nullptr : list[l].data_ptr<W>(); };
    ws.push_back({L.ln1[l].data_ptr<W>(), L.qkv[l].data_ptr<W>(), opt(L.qkv_b), opt(L.q_norm), opt(L.k_norm),
                  L.o[l].data_ptr<W>(), L.ln2[l].data_ptr<W>(), L.gate_up[l].data_ptr<W>(), L.down[l].data_ptr<W>(),
                  L.qkv[l].stride(0), L.o[l].stride(0), L.gate_up[l].stride(0), L.down[l].stride(0)});
  }
  return ws;
}

std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& residual, at::TensorList input_norm,
    at::TensorList qkv, at::TensorList qkv_bias, at::TensorList q_norm, at::TensorList k_norm, at::TensorList o,
    at::TensorList post_norm, at::TensorList gate_up, at::TensorList down, const at::Tensor& kv_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& cos_sin, double eps, double scale) {
  const at::ScalarType dt = residual.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "decode_layers: float32 or bfloat16, got ", dt);
  TORCH_CHECK(residual.dim() == 2 && residual.size(0) == 1 && residual.is_contiguous() && !residual.is_cuda(),
              "decode_layers: one token's contiguous CPU residual [1, H], got ", residual.sizes());
  TORCH_CHECK(!qkv.empty() && !o.empty() && !gate_up.empty() && !down.empty(), "decode_layers: at least one layer");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.stride(5) == 1 && kv_cache.scalar_type() == dt &&
                  kv_cache.size(1) >= static_cast<int64_t>(qkv.size()),
              "decode_layers: the cache [blocks, layers, 2, block_size, Hkv, D] of the layers' dtype, a layer each of ",
              qkv.size(), ", got ", kv_cache.sizes(), " ", kv_cache.scalar_type());
  const int64_t H = residual.size(1), d = kv_cache.size(5), hkv = kv_cache.size(4);
  TORCH_CHECK(d > 0 && d % 2 == 0 && hkv > 0, "decode_layers: an even head size and kv heads, got D ", d, ", Hkv ",
              hkv);
  TORCH_CHECK(o[0].dim() == 2 && o[0].size(1) % d == 0 && (o[0].size(1) / d) % hkv == 0,
              "decode_layers: o_proj [H, hq * D] with hq a multiple of ", hkv, " kv heads, got ", o[0].sizes());
  TORCH_CHECK(gate_up[0].dim() == 2 && gate_up[0].size(0) % 2 == 0,
              "decode_layers: gate_up_proj [2 I, H], got ", gate_up[0].sizes());
  const Dims n{H, o[0].size(1) / d, hkv, d, gate_up[0].size(0) / 2, (o[0].size(1) / d + 2 * hkv) * d};
  for (const at::Tensor* m : {&slot_mapping, &block_tables, &seq_lens})
    TORCH_CHECK(m->scalar_type() == at::kLong && m->is_contiguous() && m->size(0) == 1,
                "decode_layers: int64 metadata of one token and one sequence, got ", m->sizes());
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.numel() == d && cos_sin.is_contiguous(),
              "decode_layers: cos_sin [1, D] float32, got ", cos_sin.sizes());
  std::vector<paged::Cache> caches;
  for (size_t l = 0; l < qkv.size(); ++l)
    caches.push_back(paged::cache_of(kv_cache.select(1, static_cast<int64_t>(l))));
  const paged::Cache& c = caches[0];
  const Token tok{slot_mapping.data_ptr<int64_t>()[0], seq_lens.data_ptr<int64_t>()[0], block_tables.size(1),
                  block_tables.data_ptr<int64_t>(), cos_sin.data_ptr<float>()};
  TORCH_CHECK(tok.slot < c.num_blocks * c.block_size, "decode_layers: slot ", tok.slot, " is past the cache's ",
              c.num_blocks, " blocks of ", c.block_size);
  if (tok.ctx > 0) paged::check_table(tok.table, tok.ctx, tok.width, c);
  at::Tensor delta_out = at::empty({1, H}, residual.options()), res_out = at::empty({1, H}, residual.options());
  const LayerLists lists{input_norm, qkv, qkv_bias, q_norm, k_norm, o, post_norm, gate_up, down};
  const auto run = [&](auto zero) {
    using W = decltype(zero);
    layers<W>(checked<W>(lists, n, dt), n, residual.data_ptr<W>(),
              delta_out.data_ptr<W>(), res_out.data_ptr<W>(), caches, tok, static_cast<float>(eps),
              static_cast<float>(scale));
  };
  if (dt == at::kFloat) run(0.f);
  else run(c10::BFloat16(0.f));
  return {delta_out, res_out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(phaseflip, m) {
  m.def("cpu_decode_layers(Tensor residual, Tensor[] input_norm, Tensor[] qkv, Tensor[] qkv_bias, "
        "Tensor[] q_norm, Tensor[] k_norm, Tensor[] o, Tensor[] post_norm, Tensor[] gate_up, Tensor[] down, "
        "Tensor(a!) kv_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor cos_sin, "
        "float eps, float scale) -> (Tensor, Tensor)");
  m.impl("cpu_decode_layers", c10::DispatchKey::CPU, TORCH_FN(decode_layers));
}
