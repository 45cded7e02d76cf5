// The fused decoder layers' weights (layer.cpp) as its op receives them, checked: the layers' shapes
// (`Dims`, from the residual, the cache and the first layer), and each layer's `Weights`: norms of the
// activations' dtype W, and projections (`Proj`) of one part or several, each part dense rows of W or a
// GGUF file's blocks in a served format (blocks.h). A weight that is not so is an error naming it and
// what it must be, before any work.
#pragma once
#include <ATen/core/Tensor.h>
#include <algorithm>
#include <cstdint>
#include <vector>
#include "blocks.h"
#include "dot.h"

namespace layer_weights {

struct Dims {
  int64_t H, hq, hkv, d, I, nqkv;
};

// A projection's weight as the arena holds it: one part, or the parts a GGUF file stores in different
// formats (q and k in one, v in another), their rows one after the other. A part is rows of the layers'
// dtype or of GGUF blocks (`type`: GGML's id; 0: dense), `ld` elements or bytes apart
struct Part {
  const void* p;
  int64_t ld, rows, type;
};
struct Proj {
  std::vector<Part> parts;
  bool blocks32 = false, blocks256 = false;   // a part is GGUF blocks of 32 / 256 values: x is prepared for
  bool blocks() const { return blocks32 || blocks256; }   // their dot (qrow::Input)
};

template <typename W>
struct Weights {   // one layer's
  const W *ln1, *qkv_b, *q_norm, *k_norm, *ln2;
  Proj qkv, o, gate_up, down;
};

// GGML's type id of the served block format whose block takes `bytes` bytes (each has its own size); 0: none
inline int64_t block_type(int64_t bytes) {
  for (int64_t type : {2, 3, 6, 7, 8, 12, 14})
    if (blocks::with_format(type, [](auto b) { return decltype(b)::bytes; }) == bytes) return type;
  return 0;
}

// the values a row of t holds: a dense [rows, cols] weight's cols, a blocked one's blocks times their values
inline int64_t values_a_row(const at::Tensor& t) {
  const int64_t type = t.scalar_type() == at::kByte && t.dim() == 3 ? block_type(t.size(2)) : 0;
  return type ? t.size(1) * blocks::with_format(type, [](auto b) { return decltype(b)::values_per; }) : t.size(1);
}

// A part of `rows` rows of `cols` values: dense rows of the layers' dtype [rows, cols], or GGUF blocks
// uint8 [rows, blocks, block bytes] of a served format; rows contiguous
inline Part part_of(const at::Tensor& t, int64_t rows, int64_t cols, const char* name, at::ScalarType dtype) {
  const bool blocked = t.scalar_type() == at::kByte && t.dim() == 3 && block_type(t.size(2)) != 0;
  const bool shaped = blocked ? t.size(0) == rows && values_a_row(t) == cols && t.stride(2) == 1 &&
                                    t.stride(1) == t.size(2)
                              : t.dim() == 2 && t.size(0) == rows && t.size(1) == cols && t.stride(1) == 1;
  TORCH_CHECK(shaped && !t.is_cuda(), "decode_layers: ", name, " must be a CPU [", rows, ", ", cols,
              "] weight with contiguous rows (or its GGUF blocks), got ", t.sizes(), " strides ", t.strides());
  TORCH_CHECK(blocked || t.scalar_type() == dtype, "decode_layers: ", name, " is ", t.scalar_type(), ", the layers' ",
              dtype);
  return {t.data_ptr(), t.stride(0), rows, blocked ? block_type(t.size(2)) : 0};
}

// The projection of `rows` rows of `cols` values held by the next `count` tensors of `list` from `*next`
// (moved past them): parts whose rows add up to `rows`
inline Proj proj_of(at::TensorList list, size_t* next, int64_t count, int64_t rows, int64_t cols, const char* name,
             at::ScalarType dtype) {
  TORCH_CHECK(count >= 1 && *next + count <= list.size(), "decode_layers: ", name, " lists ", list.size(),
              " tensors, fewer than its part counts add up to");
  Proj w;
  int64_t left = rows;
  for (int64_t j = 0; j < count; ++j) {
    const at::Tensor& t = list[(*next)++];
    const int64_t here = j + 1 < count ? std::min<int64_t>(t.dim() ? t.size(0) : 0, left) : left;
    w.parts.push_back(part_of(t, here, cols, name, dtype));
    if (const int64_t type = w.parts.back().type) {
      const int64_t values = blocks::with_format(type, [](auto b) { return decltype(b)::values_per; });
      (values == blocks::QK ? w.blocks32 : w.blocks256) = true;
    }
    left -= here;
  }
  TORCH_CHECK(left == 0, "decode_layers: the parts of ", name, " hold fewer than its ", rows, " rows");
  return w;
}

inline void check_vector(const at::Tensor& t, int64_t n, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.numel() == n && t.is_contiguous() && t.scalar_type() == dtype && !t.is_cuda(),
              "decode_layers: ", name, " must be a contiguous CPU vector of ", n, " ", dtype, ", got ", t.sizes(),
              " ", t.scalar_type());
}

// One list per weight kind, a layer's entries in layer order: qkv and gate_up their parts (qkv_parts[l]
// and gate_up_parts[l] of them for layer l), every other kind one a layer; qkv_bias, q_norm and k_norm
// empty where the model has none
struct LayerLists {
  at::TensorList ln1, qkv, qkv_b, q_norm, k_norm, o, ln2, gate_up, down;
  at::IntArrayRef qkv_parts, gate_up_parts;
};

template <typename W>
std::vector<Weights<W>> checked(const LayerLists& L, const Dims& n, at::ScalarType dt) {
  const size_t count = L.o.size();
  for (const at::TensorList* list : {&L.ln1, &L.ln2, &L.down})
    TORCH_CHECK(list->size() == count, "decode_layers: every weight list holds one tensor a layer (", count, ")");
  TORCH_CHECK(L.qkv_parts.size() == count && L.gate_up_parts.size() == count,
              "decode_layers: one part count a layer for qkv_proj and gate_up_proj (", count, "), got ",
              L.qkv_parts.size(), " and ", L.gate_up_parts.size());
  for (const at::TensorList* list : {&L.qkv_b, &L.q_norm, &L.k_norm})
    TORCH_CHECK(list->empty() || list->size() == count, "decode_layers: qkv_bias, q_norm and k_norm hold one "
                "tensor a layer or none");
  std::vector<Weights<W>> ws;
  size_t next_qkv = 0, next_gate_up = 0;
  for (size_t l = 0; l < count; ++l) {
    Weights<W> w;
    w.qkv = proj_of(L.qkv, &next_qkv, L.qkv_parts[l], n.nqkv, n.H, "qkv_proj", dt);
    size_t o_at = l, down_at = l;   // one tensor a layer
    w.o = proj_of(L.o, &o_at, 1, n.H, n.hq * n.d, "o_proj", dt);
    w.gate_up = proj_of(L.gate_up, &next_gate_up, L.gate_up_parts[l], 2 * n.I, n.H, "gate_up_proj", dt);
    w.down = proj_of(L.down, &down_at, 1, n.H, n.I, "down_proj", dt);
    check_vector(L.ln1[l], n.H, "input_layernorm", dt);
    check_vector(L.ln2[l], n.H, "post_attention_layernorm", dt);
    if (!L.qkv_b.empty()) check_vector(L.qkv_b[l], n.nqkv, "qkv_bias", dt);
    if (!L.q_norm.empty()) check_vector(L.q_norm[l], n.d, "q_norm", dt);
    if (!L.k_norm.empty()) check_vector(L.k_norm[l], n.d, "k_norm", dt);
    const auto opt = [l](at::TensorList list) { return list.empty() ? nullptr : list[l].data_ptr<W>(); };
    w.ln1 = L.ln1[l].data_ptr<W>(), w.ln2 = L.ln2[l].data_ptr<W>();
    w.qkv_b = opt(L.qkv_b), w.q_norm = opt(L.q_norm), w.k_norm = opt(L.k_norm);
    ws.push_back(std::move(w));
  }
  TORCH_CHECK(next_qkv == L.qkv.size() && next_gate_up == L.gate_up.size(), "decode_layers: qkv_proj and "
              "gate_up_proj list more tensors than their part counts add up to");
  return ws;
}

// The layers' shapes, from the residual [M, H], the cache [blocks, layers, 2, block_size, Hkv, D] and the
// first layer's o and gate_up (each layer's weights are checked against them, `checked`)
inline Dims dims_of(const at::Tensor& residual, const LayerLists& L, const at::Tensor& kv_cache, at::ScalarType dt) {
  TORCH_CHECK(residual.dim() == 2 && residual.size(0) >= 1 && residual.size(0) <= dot::MAX_ROWS &&
                  residual.is_contiguous() && !residual.is_cuda(),
              "decode_layers: the tokens' contiguous CPU residual [M, H], 1 <= M <= ", dot::MAX_ROWS, ", got ",
              residual.sizes());
  TORCH_CHECK(!L.qkv.empty() && !L.o.empty() && !L.gate_up.empty() && !L.down.empty() && !L.gate_up_parts.empty(),
              "decode_layers: at least one layer");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.stride(5) == 1 && kv_cache.scalar_type() == dt &&
                  kv_cache.size(1) >= static_cast<int64_t>(L.o.size()),
              "decode_layers: the cache [blocks, layers, 2, block_size, Hkv, D] of the layers' dtype, a layer each of ",
              L.o.size(), ", got ", kv_cache.sizes(), " ", kv_cache.scalar_type());
  const int64_t H = residual.size(1), d = kv_cache.size(5), hkv = kv_cache.size(4);
  TORCH_CHECK(d > 0 && d % 2 == 0 && hkv > 0, "decode_layers: an even head size and kv heads, got D ", d, ", Hkv ",
              hkv);
  const at::Tensor& o = L.o[0];
  const int64_t o_cols = o.dim() >= 2 ? values_a_row(o) : 0;
  TORCH_CHECK(o_cols > 0 && o_cols % d == 0 && (o_cols / d) % hkv == 0,
              "decode_layers: o_proj [H, hq * D] with hq a multiple of ", hkv, " kv heads, got ", o.sizes());
  int64_t gate_up = 0;   // the first layer's rows
  for (int64_t j = 0; j < L.gate_up_parts[0] && j < static_cast<int64_t>(L.gate_up.size()); ++j)
    gate_up += L.gate_up[j].dim() ? L.gate_up[j].size(0) : 0;
  TORCH_CHECK(gate_up > 0 && gate_up % 2 == 0, "decode_layers: gate_up_proj [2 I, H], got ", gate_up, " rows");
  return {H, o_cols / d, hkv, d, gate_up / 2, (o_cols / d + 2 * hkv) * d};
}

}  // namespace layer_weights
