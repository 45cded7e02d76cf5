// A mixture-of-experts MLP for a few tokens (decode steps) on the CPU in ONE parallel region:
// kernels/reference/moe.py's expert sum, each chosen expert's weights streamed once for all the tokens that
// chose it. Phases: (1) every chosen expert's gate and up rows, each thread its share of the I rows of every
// expert, dotted with that expert's token rows (dot.h's row dot, up to MAX_TOKENS rows at a time), SiLU * up
// on the thread's own rows; (2) every expert's down rows, each thread its share of the H output columns of
// every expert, each token's output summed over its experts by routing weight in float32. A thread owns
// its rows in both phases, so no two threads write one value. Values are rounded to the weights' dtype
// where kernels/cpu/moe.py's operators round (each product's output, SiLU, the product with up), so
// bfloat16 follows that path. Why one region: at batch 1 a Qwen3-MoE layer is ~4 experts x 3 products of a
// few MB each; as operators, the gather, the products, the activation and the scatter of every expert
// each fork and join the threads with the main thread's dispatch alone between them.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <cmath>
#include <vector>
#include "dot.h"
#include "dtype.h"
#include "parallel.h"

namespace {

constexpr int64_t MAX_TOKENS = 4;   // tokens a call takes (kernels/cpu/moe.py sends more to the grouped path)

template <typename W>
inline float rnd(float v) { return static_cast<float>(static_cast<W>(v)); }

struct Expert {            // one chosen expert and the tokens that chose it
  int64_t id, m;           // expert id, how many of its tokens (<= MAX_TOKENS)
  int64_t token[MAX_TOKENS];
  float weight[MAX_TOKENS];
};

// out[j][n] = dot(w row n, x row j) for j < m: row_dot instantiated for each row count
template <typename W>
inline void dots(const W* w, const typename dot::Lanes<W>::X* x, int64_t K, int64_t m, float* out) {
  switch (m) {
    case 1: return dot::row_dot<W, 1>(w, x, K, out);
    case 2: return dot::row_dot<W, 2>(w, x, K, out);
    case 3: return dot::row_dot<W, 3>(w, x, K, out);
    default: return dot::row_dot<W, 4>(w, x, K, out);
  }
}

template <typename W>
void run(const at::Tensor& h, const at::Tensor& gate_up, const at::Tensor& down, const std::vector<Expert>& ex,
         at::Tensor& out) {
  using X = typename dot::Lanes<W>::X;
  const int64_t T = h.size(0), H = h.size(1), I = down.size(2), E = static_cast<int64_t>(ex.size());
  const W* hp = h.data_ptr<W>();
  const W* gu = gate_up.data_ptr<W>();
  const W* dn = down.data_ptr<W>();
  std::vector<X> x(E * MAX_TOKENS * H), act(E * MAX_TOKENS * I);   // each expert's token rows, activations
  for (int64_t e = 0; e < E; ++e)
    for (int64_t j = 0; j < ex[e].m; ++j)
      for (int64_t k = 0; k < H; ++k) x[(e * MAX_TOKENS + j) * H + k] = static_cast<X>(hp[ex[e].token[j] * H + k]);
  std::vector<float> sum(T * H, 0.f);
  par::region([&](const par::Team& team) {
    const par::Range rows = team.share(I);
    float g[MAX_TOKENS], u[MAX_TOKENS];
    for (int64_t e = 0; e < E; ++e) {
      const W* w = gu + ex[e].id * gate_up.stride(0);
      const X* xe = x.data() + e * MAX_TOKENS * H;
      for (int64_t r = rows.begin; r < rows.end; ++r) {
        dots<W>(w + r * H, xe, H, ex[e].m, g);
        dots<W>(w + (I + r) * H, xe, H, ex[e].m, u);
        for (int64_t j = 0; j < ex[e].m; ++j) {
          const float gj = rnd<W>(g[j]);
          act[(e * MAX_TOKENS + j) * I + r] = static_cast<X>(rnd<W>(rnd<W>(gj / (1.f + std::exp(-gj))) * rnd<W>(u[j])));
        }
      }
    }
    team.barrier();
    const par::Range cols = team.share(H);
    float y[MAX_TOKENS];
    for (int64_t e = 0; e < E; ++e) {
      const W* w = dn + ex[e].id * down.stride(0);
      for (int64_t n = cols.begin; n < cols.end; ++n) {
        dots<W>(w + n * I, act.data() + e * MAX_TOKENS * I, I, ex[e].m, y);
        for (int64_t j = 0; j < ex[e].m; ++j) sum[ex[e].token[j] * H + n] += ex[e].weight[j] * rnd<W>(y[j]);
      }
    }
  });
  W* op = out.data_ptr<W>();
  for (int64_t i = 0; i < T * H; ++i) op[i] = static_cast<W>(sum[i]);
}

// The chosen experts in order of id, each with its tokens (in token order) and their routing weights
std::vector<Expert> chosen(const at::Tensor& ids, const at::Tensor& weights, int64_t num_experts) {
  const int64_t T = ids.size(0), k = ids.size(1);
  const int64_t* ip = ids.data_ptr<int64_t>();
  const float* wp = weights.data_ptr<float>();
  std::vector<int64_t> slot(num_experts, -1);
  std::vector<Expert> ex;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < k; ++s) {
      const int64_t e = ip[t * k + s];
      TORCH_CHECK(e >= 0 && e < num_experts, "cpu_moe_rows: expert id ", e, " outside 0..", num_experts - 1);
      if (slot[e] < 0) slot[e] = static_cast<int64_t>(ex.size()), ex.push_back(Expert{e, 0, {}, {}});
      Expert& x = ex[slot[e]];
      x.token[x.m] = t, x.weight[x.m] = wp[t * k + s], ++x.m;
    }
  return ex;
}

at::Tensor moe_rows(const at::Tensor& h, const at::Tensor& gate_up, const at::Tensor& down, const at::Tensor& ids,
                    const at::Tensor& weights) {
  TORCH_CHECK(h.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3 && ids.dim() == 2 && weights.sizes() == ids.sizes(),
              "cpu_moe_rows: h [T, H], gate_up [E, 2I, H], down [E, H, I], ids and weights [T, k] expected");
  const int64_t T = h.size(0), H = h.size(1), E = gate_up.size(0), I = down.size(2);
  TORCH_CHECK(T >= 1 && T <= MAX_TOKENS, "cpu_moe_rows: 1 to ", MAX_TOKENS, " tokens, got ", T);
  TORCH_CHECK(gate_up.size(1) == 2 * I && gate_up.size(2) == H && down.size(0) == E && down.size(1) == H,
              "cpu_moe_rows: gate_up ", gate_up.sizes(), " and down ", down.sizes(), " do not fit h ", h.sizes());
  TORCH_CHECK(h.is_contiguous() && gate_up.stride(2) == 1 && gate_up.stride(1) == H && down.stride(2) == 1 &&
              down.stride(1) == I, "cpu_moe_rows: h and each expert's weight rows must be contiguous");
  TORCH_CHECK(ids.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat && ids.is_contiguous() &&
              weights.is_contiguous(), "cpu_moe_rows: ids int64 and weights float32, contiguous");
  TORCH_CHECK(h.scalar_type() == gate_up.scalar_type() && h.scalar_type() == down.scalar_type(),
              "cpu_moe_rows: h and the weights of one dtype");
  const std::vector<Expert> ex = chosen(ids, weights, E);
  at::Tensor out = at::empty({T, H}, h.options());
  dtype::dispatch("cpu_moe_rows", h.scalar_type(), [&](auto zero) { run<decltype(zero)>(h, gate_up, down, ex, out); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(phaseflip, m) {
  m.def("cpu_moe_rows(Tensor h, Tensor gate_up, Tensor down, Tensor ids, Tensor weights) -> Tensor");
  m.impl("cpu_moe_rows", c10::DispatchKey::CPU, TORCH_FN(moe_rows));
}
