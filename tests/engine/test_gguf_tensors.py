"""engine/checkpoint/gguf_tensors.py: a GGUF file's tensors as stored (floats as floats, the served
block formats as their blocks, in HF's row order), against what gguf's own writer put there and its
decoder reads back; a type neither loaded nor served is refused by tensor and type before any data is
read; the shipped SmolLM2 Q4_1 file reads whole, and its blocks multiply as gguf decodes them."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf", reason="the gguf package (a dependency) is not installed")
from gguf import quants  # noqa: E402

from phaseflip.engine.checkpoint.default_model import find_default_gguf  # noqa: E402
from phaseflip.engine.checkpoint.gguf_tensors import read_tensors  # noqa: E402
from phaseflip.engine.checkpoint.loader import CheckpointError  # noqa: E402
from phaseflip.kernels.cpu import quant  # noqa: E402

T = gguf.GGMLQuantizationType


def _write(path, tensors: dict[str, tuple[np.ndarray, T]]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (values, kind) in tensors.items():
        stored = values if kind in (T.F32, T.F16) else quants.quantize(values, kind)
        writer.add_tensor(name, stored, raw_dtype=None if kind in (T.F32, T.F16) else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_floats_and_blocks_read_as_written(tmp_path):
    rng = np.random.default_rng(0)
    w = {"norm": (rng.standard_normal(64).astype(np.float32), T.F32),
         "half": (rng.standard_normal((3, 64)).astype(np.float16), T.F16),
         "bf": (rng.standard_normal((2, 64)).astype(np.float32), T.BF16),
         "q8": (rng.standard_normal((5, 64)).astype(np.float32), T.Q8_0),
         "q41": (rng.standard_normal((7, 96)).astype(np.float32), T.Q4_1)}
    _write(tmp_path / "t.gguf", w)
    got = {t.name: t for t in read_tensors(tmp_path / "t.gguf")}
    assert [got[n].shape for n in w] == [(64,), (3, 64), (2, 64), (5, 64), (7, 96)]
    assert torch.equal(got["norm"].data, torch.from_numpy(w["norm"][0])) and got["norm"].fmt is None
    assert torch.equal(got["half"].data, torch.from_numpy(w["half"][0]))
    assert got["bf"].data.dtype == torch.bfloat16 and got["bf"].stored == "BF16"
    torch.testing.assert_close(got["bf"].data.float(), torch.from_numpy(w["bf"][0]), rtol=1e-2, atol=1e-2)
    for name in ("q8", "q41"):
        t = got[name]
        assert t.fmt is quant.FORMATS[t.stored] and t.data.dtype == torch.uint8
        assert t.data.shape == (t.shape[0], t.fmt.row_bytes(t.shape[1]))
        decoded = quants.dequantize(t.data.numpy(), T[t.stored])
        np.testing.assert_array_equal(decoded, quants.dequantize(quants.quantize(w[name][0], w[name][1]), w[name][1]))


def test_a_type_not_served_is_named_before_any_data_is_read(tmp_path):
    _write(tmp_path / "t.gguf", {"fine": (np.ones((2, 32), np.float32), T.Q8_0),
                                 "blk.3.ffn_up.weight": (np.ones((2, 256), np.float32), T.TQ1_0)})
    named = (r"tensor 'blk.3.ffn_up.weight' is stored as TQ1_0, which is neither loaded \(F32, F16, BF16\) "
             r"nor served in its blocks \(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K\)")
    with pytest.raises(CheckpointError, match=named):
        read_tensors(tmp_path / "t.gguf")


def test_the_shipped_q4_1_file_reads_whole_and_its_blocks_multiply_as_gguf_decodes_them(cpu_kernels):
    tensors = read_tensors(find_default_gguf())
    kinds = {t.stored for t in tensors}
    assert kinds == {"F32", "Q4_1", "Q8_0"}, kinds
    down = next(t for t in tensors if t.name == "blk.0.ffn_down.weight")
    assert down.shape == (576, 1536) and down.stored == "Q4_1"
    x = torch.randn(3, 1536, generator=torch.Generator().manual_seed(0))
    seen = quant.quantize_rows_int8(x, down.fmt) if quant.int8_x() else x   # as the kernel sees x
    want = F.linear(seen, torch.from_numpy(quants.dequantize(down.data.numpy(), T.Q4_1)))
    torch.testing.assert_close(quant.quant_linear(x, down.data, down.fmt), want, rtol=1e-4, atol=1e-4)


def test_the_engines_own_writer_writes_what_gguf_reads(tmp_path):
    """engine/checkpoint/gguf_file.py's write_gguf (the GPU check's files, on machines without gguf):
    gguf's reader finds the same metadata, shapes, types and bytes, and so does ours."""
    from phaseflip.engine.checkpoint.gguf_file import read_gguf, write_gguf
    from phaseflip.kernels.reference.quant import random_blocks
    blocks = random_blocks(12, 3, 512, seed=1).numpy()
    norm = np.arange(7, dtype=np.float32)
    meta = {"general.architecture": "llama", "llama.block_count": 2, "llama.rope.freq_base": 500000.0,
            "llama.big": 2 ** 40, "flag": True}
    write_gguf(tmp_path / "w.gguf", meta, {"a.weight": (12, (3, 512), blocks.tobytes()),
                                            "n.weight": (0, (7,), norm.tobytes())})
    theirs = gguf.GGUFReader(str(tmp_path / "w.gguf"))
    for key, value in meta.items():
        assert theirs.fields[key].contents() == pytest.approx(value), key
    a, n = theirs.tensors
    assert (a.name, a.tensor_type, list(a.shape)) == ("a.weight", T.Q4_K, [512, 3])
    assert a.data.tobytes() == blocks.tobytes() and np.array_equal(n.data, norm)
    ours = read_gguf(tmp_path / "w.gguf")
    assert ours.metadata["llama.block_count"] == 2 and ours.tensors["a.weight"].dims == (512, 3)
    with pytest.raises(ValueError, match="a.weight: 10 bytes for shape"):
        write_gguf(tmp_path / "bad.gguf", {}, {"a.weight": (12, (3, 512), bytes(10))})
