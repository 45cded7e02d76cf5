"""The CPU kernels of our own (gemv.cpp, decode.cpp, prefill.cpp, layer.cpp, quant.cpp, moe.cpp): built for
this machine on first use, loaded as torch ops.

Owns: `few_rows_op` (`phaseflip::cpu_few_rows_linear`), `paged_attention_op`
(`phaseflip::cpu_paged_attention`: phaseflip::paged_attention in C++, every CPU step of float32 or
bfloat16, eager or compiled), `decode_layers_op` (`phaseflip::cpu_decode_layers`: a decode step's
tokens through the decoder layers, kernels/cpu/fused_layer.py), `quant_linear_op`
(`phaseflip::cpu_quant_linear`: products on weights in a GGUF block format, kernels/cpu/quant.py),
`moe_rows_op` (`phaseflip::cpu_moe_rows`: an MoE layer's experts for a few tokens in one parallel region,
kernels/cpu/moe.py), each None where the kernels cannot be built or give a wrong answer, and
`kernel_report` (whether they are there, why not, where they live, what the build cost).

Why a few-rows product of our own: a decode step's projections multiply one to four rows by every weight,
a pass over the whole model that should run at the memory's read speed. Neither the library's GEMM
(MKL's GEMV, oneDNN built per row count) nor inductor's reduction over a weight row gets there; this
kernel reads the arena as it lies (inductor's own C++ GEMM template needs frozen weights, repacked into a
copy that a flip would not refill). From 5 to MAX_ROWS rows it transposes x and broadcasts each weight
value over 16 rows of x (no horizontal sums), the next weight rows fetched ahead; past 16 rows (AVX2) x
is cut into panels that each group of weight rows meets in turn (wide.h `panel_mb`), so short prompt
chunks take it too where the boot measures it faster (forms.choose_wide_forms).
Both kernels are written once over simd.h's float32 vector: AVX-512 (16 lanes) or AVX2 + FMA (8
lanes), plain loops where the CPU has neither. The plain loops are the slowest product and the boot
never chooses them, so an AVX2-only CPU has the kernel only through its AVX2 form.
Why an attention of our own: it reads the paged cache in place, one call a layer, where torch's ops
would gather every context into a fresh tensor first; decodes read each K/V row once for a kv head's
query heads, prompt chunks run in register tiles (prefill.cpp). Without the kernels (no compiler), and
for float16, the torch reference (kernels/reference/attention.py) runs instead.
The measurements behind these choices are in docs/performance.md.

The build: one g++ call (-O3 -march=native -fopenmp, torch's headers and libraries), its output
renamed into place so that ranks building at once never load half a file, under the phaseflip cache
dir keyed by the sources, torch's version and this CPU's feature flags (a cache shared between
machines never hands one the other's code); once per machine and torch (its time is in kernel_report),
then a load. Nothing is built at import: the first call of an op getter does it.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

import torch

from phaseflip.cache import cache_dir, cpu_flags, prune, used

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("gemv.cpp", "decode.cpp", "prefill.cpp", "layer.cpp", "quant.cpp", "moe.cpp"))
HEADERS = tuple(Path(__file__).with_name(name)   # included by the sources (part of the build's key)
                for name in ("simd.h", "dtype.h", "parallel.h", "dot.h", "tile.h", "paged.h", "wide.h", "int8.h",
                                  "int8_x.h", "int8_k.h", "int8_groups.h", "blocks.h", "qrow.h", "layer_weights.h",
                                  "int8_wide.h", "few_rows.h"))
KEEP_BUILDS = 8   # the most recently used builds kept in the cache (each source edit makes a new one)
MAX_ROWS = 256    # the kernel's rows a pass (gemv.cpp's MAX_ROWS): more take equal passes
MOE_ROWS = 4      # the most tokens cpu_moe_rows takes (moe.cpp's MAX_TOKENS)
# the row counts the load-time check multiplies: every one to 64 (each one-pass form, each panel width,
# 1-4 panels), then partial and whole panels up to a pass, and two and three passes (every count to 256
# would cost ~0.2 s a boot)
CHECK_ROWS = (*range(1, 65), 65, 100, 128, 131, 200, MAX_ROWS, MAX_ROWS + 1, 3 * MAX_ROWS - 5)
DTYPES = (torch.float32, torch.bfloat16)

_report: dict = {}   # this process's build/load outcome (empty: not tried yet)
_faked = False       # the product's fake kernel (for tracing) is registered


def few_rows_op():
    """torch.ops.phaseflip.cpu_few_rows_linear; None where the kernels are not here (kernel_report)."""
    return torch.ops.phaseflip.cpu_few_rows_linear if _loaded() else None


def paged_attention_op(dtype: torch.dtype):
    """torch.ops.phaseflip.cpu_paged_attention (phaseflip::paged_attention's schema and contract) for q of
    this dtype; None where the kernels are not here or are not written for the dtype."""
    return torch.ops.phaseflip.cpu_paged_attention if dtype in DTYPES and _loaded() else None


def decode_layers_op():
    """torch.ops.phaseflip.cpu_decode_layers (layer.cpp: one token each of up to 8 sequences through a
    stack of decoder layers); None where the kernels are not here (kernel_report)."""
    return torch.ops.phaseflip.cpu_decode_layers if _loaded() else None


def quant_linear_op():
    """torch.ops.phaseflip.cpu_quant_linear (quant.cpp: x @ W^T, W in a GGUF block format); None where the
    kernels are not here (kernel_report)."""
    return torch.ops.phaseflip.cpu_quant_linear if _loaded() else None


def moe_rows_op():
    """torch.ops.phaseflip.cpu_moe_rows (moe.cpp: the chosen experts of up to MOE_ROWS tokens); None where the
    kernels are not here (kernel_report)."""
    return torch.ops.phaseflip.cpu_moe_rows if _loaded() else None


def _loaded() -> bool:
    """Build (once per machine) and load (once per process) the kernels; whether they are usable."""
    if not _report:
        _report.update(_load())
        if _report["available"]:
            log.info("CPU kernels: %s", _report["path"])
        else:
            log.warning("CPU kernels unavailable (%s): products and attention take the library's paths",
                        _report["reason"])
    return bool(_report["available"])


def kernel_report() -> dict:
    """What loading found: available, reason (when not), path and build_s (None: loaded, not built)."""
    return dict(_report) if _report else {"available": None, "reason": "not tried yet"}


def _load() -> dict:
    compiler = os.environ.get("CXX", "g++")
    if platform.system() != "Linux" or shutil.which(compiler) is None:
        return {"available": False, "reason": f"needs Linux and a C++ compiler ({compiler!r} not found)"}
    path = _library_path(compiler)
    build_s = None
    try:
        if not path.exists():
            t0 = time.perf_counter()
            _build(compiler, path)
            build_s = round(time.perf_counter() - t0, 2)
        torch.ops.load_library(str(path))
        used(path)
        prune(path.parent, KEEP_BUILDS, protect=path, suffix=".so")   # builds for older sources
        _register_fake()
        reason = _disagreement()
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        reason = f"{type(e).__name__}: {str(e).strip()[-400:]}"
    return {"available": reason is None, "reason": reason, "path": str(path), "build_s": build_s}


def _flags() -> list[str]:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]


def _library_path(compiler: str) -> Path:
    key = hashlib.sha256()
    sources = (src.read_bytes() for src in SOURCES + HEADERS)
    for part in (*sources, torch.__version__, compiler, " ".join(_flags()), cpu_flags()):
        key.update(part if isinstance(part, bytes) else part.encode())
    return cache_dir() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def _build(compiler: str, path: Path) -> None:
    from torch.utils.cpp_extension import include_paths, library_paths
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    cmd = [compiler, *_flags(), *(f"-I{p}" for p in include_paths()), *map(str, SOURCES), "-o", str(tmp),
           *(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu", "-lgomp"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{compiler} failed: {e.stderr.strip()[-400:]}") from None
    os.replace(tmp, path)   # atomic: a rank loading it sees the whole file or none


def _register_fake() -> None:
    """The shapes for tracing of what compiled steps call: the products, the paged attention (q's), the
    quantized rows' lookup."""
    global _faked
    if not _faked:   # once per process (a second registration is an error)
        torch.library.register_fake("phaseflip::cpu_few_rows_linear")(
            lambda x, weight: x.new_empty((x.shape[0], weight.shape[0])))
        torch.library.register_fake("phaseflip::cpu_paged_attention")(lambda q, *rest: torch.empty_like(q))
        torch.library.register_fake("phaseflip::cpu_quant_linear")(
            lambda x, blocks, type_id: x.new_empty((x.shape[0], blocks.shape[0])))
        torch.library.register_fake("phaseflip::cpu_quant_rows")(_quant_rows_shape)
        _faked = True


def _quant_rows_shape(blocks: torch.Tensor, ids: torch.Tensor, type_id: int) -> torch.Tensor:
    from phaseflip.kernels.cpu.quant import format_of_type   # quant.py calls this module: imported at the call
    fmt = format_of_type(type_id)
    return blocks.new_empty((ids.shape[0], blocks.shape[1] // fmt.block_bytes * fmt.block_values), dtype=torch.float32)


def _disagreement() -> str | None:
    """None when the kernel gives F.linear's answer on a few small products (every dtype, CHECK_ROWS
    rows, a K with a tail), else what differed."""
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        w = torch.randn(37, 83, generator=g).to(dtype)
        for m in CHECK_ROWS:
            x = torch.randn(m, 83, generator=g).to(dtype)
            got = torch.ops.phaseflip.cpu_few_rows_linear(x, w).float()
            want = x.float() @ w.float().t()
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            if got.shape != want.shape or not torch.allclose(got, want, rtol=tol, atol=tol * 4):
                return f"disagrees with F.linear ({dtype}, {m} rows): max error {(got - want).abs().max():.3g}"
    return None

