"""Which implementation a kernel call runs: the Triton kernels on CUDA tensors, the torch references
everywhere else (the CPU path, and the oracle the kernels are tested against); for products, the
library's on CUDA and the CPU's measured forms (kernels/cpu/linear.py) elsewhere.

Owns: the entry points the model maths calls for the projections (`linear`), the embedding's lookup
(`embedding`: a quantized table's rows decoded), an MoE layer's routing and expert products (`route`,
`moe_experts`) and the pointwise kernels (`rms_norm`, `add_rms_norm`, `apply_rotary`, `silu_and_mul`,
`gelu_tanh_and_mul`), and the ops (`phaseflip::<name>`, defined
with kernels/op_registry.py like every Python-bodied op of ours) that wrap the Triton launches (pointwise,
and the products and lookups on GGUF blocks) so
torch.compile treats each as one opaque call and a CUDA graph captures it. Attention and the KV store
dispatch inside `phaseflip::paged_attention` itself (kernels/attention.py).

The branch is on `x.is_cuda` only, a static property torch.compile specialises on. Triton is imported
at the first CUDA call, never at import; without triton a CUDA call falls back to the reference (eager
only: the attention reference synchronises with the host, so it cannot be captured).
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from phaseflip.kernels.cpu import linear as cpu_linear
from phaseflip.kernels.cpu import moe as cpu_moe
from phaseflip.kernels.cpu import quant
from phaseflip.kernels.op_registry import define_op
from phaseflip.kernels.reference import activation, moe, norm, rotary

_triton_available: bool | None = None


def triton_available() -> bool:
    """Whether triton can be imported (looked up once, without importing it)."""
    global _triton_available
    if _triton_available is None:
        _triton_available = importlib.util.find_spec("triton") is not None
    return _triton_available


# -- entry points the model calls ------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:
        return torch.ops.phaseflip.rms_norm(x, weight, eps)
    return norm.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual + x -> (rms_norm(sum), sum): the residual add fused into the next norm."""
    if x.is_cuda:
        return torch.ops.phaseflip.add_rms_norm(x, residual, weight, eps)
    return norm.add_rms_norm(x, residual, weight, eps)


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return torch.ops.phaseflip.apply_rotary(x, cos_sin)
    return rotary.apply_rotary(x, cos_sin)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias): the library's product on CUDA (Triton's on a weight in a GGUF
    block format), the CPU's forms elsewhere."""
    if not x.is_cuda:
        return cpu_linear.linear(x, weight, bias)
    fmt = quant.weight_format(weight)
    if fmt is None:
        return F.linear(x, weight, bias)
    y = torch.ops.phaseflip.quant_linear(x, weight.flatten(1), fmt.type_id)
    return y if bias is None else y + bias


def embedding(ids: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of an embedding weight, in dtype: a weight in a GGUF block format has its rows decoded
    (by Triton on CUDA, by the CPU's quantized kernels elsewhere: kernels/cpu/quant.py)."""
    fmt = quant.weight_format(weight)
    if fmt is None:
        return F.embedding(ids, weight)
    if weight.is_cuda:
        return torch.ops.phaseflip.quant_rows(weight.flatten(1), ids, fmt.type_id).to(dtype)
    return quant.quant_rows(weight.flatten(1), ids, fmt).to(dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.is_cuda:
        return torch.ops.phaseflip.silu_and_mul(gate_up)
    return activation.silu_and_mul(gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma's GeGLU: torch's own ops everywhere (a compiled step fuses them; a CUDA graph captures them)."""
    return activation.gelu_tanh_and_mul(gate_up)


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights float32 [T, k], expert ids [T, k]); plain torch ops everywhere
    (a compiled step fuses them)."""
    return moe.route(logits, top_k, normalize)


def moe_experts(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """The routed experts' SwiGLU FFNs, summed per token by routing weight (kernels/reference/moe.py's
    contract): grouped by expert, on the CPU's product forms or Triton's on CUDA."""
    if h.is_cuda:
        return torch.ops.phaseflip.moe_experts(h, gate_up, down, ids, weights)
    return cpu_moe.experts(h, gate_up, down, ids, weights)


# -- the ops (CUDA bodies), defined like every op of ours (kernels/op_registry.py) -----------------------
def _rms_norm_body(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not triton_available():
        return norm.rms_norm(x, weight, eps)
    from phaseflip.kernels.triton.norm import rms_norm_triton
    return rms_norm_triton(x, weight, eps)


def _add_rms_norm_body(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not triton_available():
        return norm.add_rms_norm(x, residual, weight, eps)
    from phaseflip.kernels.triton.norm import add_rms_norm_triton
    return add_rms_norm_triton(x, residual, weight, eps)


def _apply_rotary_body(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    if not triton_available():
        return rotary.apply_rotary(x, cos_sin)
    from phaseflip.kernels.triton.rotary import apply_rotary_triton
    return apply_rotary_triton(x, cos_sin)


def _silu_and_mul_body(gate_up: torch.Tensor) -> torch.Tensor:
    if not triton_available():
        return activation.silu_and_mul(gate_up)
    from phaseflip.kernels.triton.activation import silu_and_mul_triton
    return silu_and_mul_triton(gate_up)


def _quant_linear_body(x: torch.Tensor, blocks: torch.Tensor, type_id: int) -> torch.Tensor:
    if not triton_available():
        raise RuntimeError("weights in a GGUF block format on CUDA need triton, which is not installed")
    from phaseflip.kernels.triton.quant import quant_linear_triton
    return quant_linear_triton(x, blocks, type_id)


def _quant_rows_body(blocks: torch.Tensor, ids: torch.Tensor, type_id: int) -> torch.Tensor:
    if not triton_available():
        raise RuntimeError("weights in a GGUF block format on CUDA need triton, which is not installed")
    from phaseflip.kernels.triton.quant import quant_rows_triton
    return quant_rows_triton(blocks, ids, type_id)


def _moe_experts_body(h, gate_up, down, ids, weights):
    """The grouped Triton products; without triton every expert over every token, masked by its routing
    weight (E / k times the work, no data-dependent shape either: a CUDA graph captures both)."""
    if not triton_available():
        return moe.experts(h, gate_up, down, ids, weights)
    from phaseflip.kernels.triton.moe import moe_experts_triton
    return moe_experts_triton(h, gate_up, down, ids, weights)


def _quant_rows_fake(blocks, ids, type_id):
    fmt = quant.format_of_type(type_id)
    return blocks.new_empty((ids.shape[0], blocks.shape[1] // fmt.block_bytes * fmt.block_values),
                            dtype=torch.float32)


def _add_rms_norm_fake(x, residual, weight, eps):
    res_dtype = torch.promote_types(x.dtype, residual.dtype)
    return (torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, res_dtype), device=x.device),
            torch.empty(x.shape, dtype=res_dtype, device=x.device))


define_op("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", _rms_norm_body,
          lambda x, weight, eps: torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype),
                                             device=x.device))
define_op("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
          _add_rms_norm_body, _add_rms_norm_fake)
define_op("apply_rotary(Tensor x, Tensor cos_sin) -> Tensor", _apply_rotary_body,
          lambda x, cos_sin: torch.empty(x.shape, dtype=x.dtype, device=x.device))
define_op("silu_and_mul(Tensor gate_up) -> Tensor", _silu_and_mul_body,
          lambda gate_up: gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2)))
define_op("quant_linear(Tensor x, Tensor blocks, int type_id) -> Tensor", _quant_linear_body,
          lambda x, blocks, type_id: x.new_empty((x.shape[0], blocks.shape[0])))
define_op("quant_rows(Tensor blocks, Tensor ids, int type_id) -> Tensor", _quant_rows_body, _quant_rows_fake)
define_op("moe_experts(Tensor h, Tensor gate_up, Tensor down, Tensor ids, Tensor weights) -> Tensor",
          _moe_experts_body, lambda h, gate_up, down, ids, weights: torch.empty_like(h))
