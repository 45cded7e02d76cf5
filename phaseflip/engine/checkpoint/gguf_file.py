"""GGUF's container read in one pass over its header: the metadata and the tensor index, the data
memory-mapped.

Owns: `GGUFFile` (`metadata`: key -> value, scalars and numeric arrays decoded, an array of strings as
its length only (a vocabulary's 49k strings are the tokenizer's business, not a boot's); `tensors`:
name -> `TensorInfo`, dims in the file's order, fastest-moving first; `mapped()`: the file mapped
copy-on-write, whose [offset, offset + num_bytes) is a tensor's data), `read_gguf` (one parse per
file and process while the file's size and mtime stay the same; the parse keeps no mapping open),
`type_name` and `write_gguf` (scalar metadata and tensors: the GPU check's files).

Why not gguf's own GGUFReader: it decodes every array element into Python objects, ~2 s for
SmolLM2's vocabulary, which the controller and every rank would each pay at boot. The format (magic,
version, counts, typed key/values, tensor infos, aligned data) is GGUF's published specification; the
tensor types' names and sizes are the engine's own tables (the float types here, the block formats in
kernels/cpu/quant.py), so that a machine without the `gguf` package reads a file the engine serves.
"""
from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from phaseflip.engine.checkpoint.loader import CheckpointError
from phaseflip.kernels.cpu.quant import format_of_type

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct format of a scalar
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
FLOAT_SIZES = {0: ("F32", 4), 1: ("F16", 2), 30: ("BF16", 2)}   # GGML's id -> (name, bytes a value)


@dataclass(frozen=True)
class StringArray:
    """An array of strings, not decoded: its length, and where its first string starts in the file
    (`GGUFFile.strings` decodes it)."""
    count: int
    offset: int = field(default=0, compare=False)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]    # the file's order: the fastest-moving dimension first
    type_id: int             # GGML's type
    offset: int              # bytes from the start of the file
    num_bytes: int


class GGUFFile:
    def __init__(self, path: Path):
        self.path = path
        self._map, self._pos = self.mapped(), 0
        try:
            self._parse()
        except (struct.error, IndexError, ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: damaged GGUF header at byte {self._pos} ({e})") from e
        finally:
            del self._map

    def strings(self, key: str) -> list[str]:
        """The array of strings under metadata `key`, decoded (a vocabulary, its merges)."""
        array = self.metadata.get(key)
        if not isinstance(array, StringArray):
            raise CheckpointError(f"{self.path}: metadata {key!r} is not an array of strings ({array!r})")
        pos, out = array.offset, []
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            for _ in range(array.count):
                n = struct.unpack_from("<Q", data, pos)[0]
                out.append(data[pos + 8:pos + 8 + n].decode("utf-8"))
                pos += 8 + n
        return out

    def mapped(self) -> np.memmap:
        """The whole file as uint8, mapped copy-on-write (arrays torch can wrap; the file is never written)."""
        return np.memmap(self.path, dtype=np.uint8, mode="c")

    # -- the header --------------------------------------------------------------------------------
    def _parse(self) -> None:
        if bytes(self._map[:4]) != MAGIC:
            raise CheckpointError(f"{self.path}: not a GGUF file (magic {bytes(self._map[:4])!r})")
        self._pos = 4
        version = self._scalar("<I")
        if version not in VERSIONS:
            raise CheckpointError(f"{self.path}: GGUF version {version} is not read (read: {VERSIONS}; a "
                                  "big-endian file reads as a huge version)")
        tensor_count, kv_count = self._scalar("<Q"), self._scalar("<Q")
        self.metadata = {}
        for _ in range(kv_count):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("<I"))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._pos // alignment) * alignment
        self.tensors = {}
        for name, dims, type_id, offset in infos:
            num_bytes = _num_bytes(dims, type_id)
            if start + offset + num_bytes > len(self._map):
                raise CheckpointError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
            self.tensors[name] = TensorInfo(name, dims, type_id, start + offset, num_bytes)

    def _scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        value = struct.unpack_from(fmt, self._map, self._pos)[0]
        self._pos += size
        return value

    def _string(self) -> str:
        n = self._scalar("<Q")
        text = bytes(self._map[self._pos:self._pos + n]).decode("utf-8")
        self._pos += n
        return text

    def _value(self, kind: int):
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown value type {kind}")
        item, count = self._scalar("<I"), self._scalar("<Q")
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item])
            values = np.frombuffer(self._map, dtype, count, self._pos).tolist()
            self._pos += dtype.itemsize * count
            return values
        if item == _STRING:
            offset = self._pos
            for _ in range(count):   # skipped: lengths only
                self._pos += 8 + struct.unpack_from("<Q", self._map, self._pos)[0]
            return StringArray(count, offset)
        return [self._value(item) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
        return name, dims, self._scalar("<I"), self._scalar("<Q")


def type_name(type_id: int) -> str:
    """GGML's name of a tensor type: the float types and block formats served by name from our own
    tables; another from the gguf package where it is installed, else by number."""
    if type_id in FLOAT_SIZES:
        return FLOAT_SIZES[type_id][0]
    fmt = format_of_type(type_id)
    if fmt is not None:
        return fmt.name
    try:
        from gguf import GGMLQuantizationType   # at the call: no import-time work
        return GGMLQuantizationType(type_id).name
    except (ImportError, ValueError):
        return f"type {type_id}"


def _num_bytes(dims: tuple[int, ...], type_id: int) -> int:
    values = int(np.prod(dims, dtype=np.int64))
    if type_id in FLOAT_SIZES:
        return values * FLOAT_SIZES[type_id][1]
    fmt = format_of_type(type_id)
    if fmt is not None:
        return values // fmt.block_values * fmt.block_bytes
    try:   # a type the engine does not serve: its size from gguf, where installed (the loader names it)
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ImportError, ValueError, KeyError) as e:
        raise ValueError(f"tensor type {type_name(type_id)} has no known size") from e
    return values // block_values * block_bytes


def write_gguf(path: str | Path, metadata: dict, tensors: dict[str, tuple[int, tuple[int, ...], bytes]]) -> None:
    """A GGUF file (version 3) at path: metadata values str, bool, int (uint32, int64 past it) or float
    (float32); tensors name -> (GGML type id, shape rows first as HF orders it, the data's bytes), each
    aligned to DEFAULT_ALIGNMENT. What the GPU check serves on a machine without the gguf package."""
    def string(text: str) -> bytes:
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw

    def value(v) -> bytes:
        if isinstance(v, str):
            return struct.pack("<I", _STRING) + string(v)
        if isinstance(v, bool):
            return struct.pack("<I?", 7, v)
        if isinstance(v, int):
            return struct.pack("<II", 4, v) if 0 <= v < 2 ** 32 else struct.pack("<Iq", 11, v)
        return struct.pack("<If", 6, float(v))

    head = [MAGIC, struct.pack("<IQQ", 3, len(tensors), len(metadata))]
    head += [string(k) + value(v) for k, v in metadata.items()]
    offset, datas = 0, []
    for name, (type_id, shape, data) in tensors.items():
        if len(data) != _num_bytes(tuple(reversed(shape)), type_id):
            raise ValueError(f"{name}: {len(data)} bytes for shape {shape} of {type_name(type_id)}")
        head.append(string(name) + struct.pack(f"<I{len(shape)}QIQ", len(shape), *reversed(shape), type_id, offset))
        datas.append(bytes(data))
        offset = -(-(offset + len(data)) // DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT
    header = b"".join(head)
    with open(path, "wb") as f:
        f.write(header + bytes(-len(header) % DEFAULT_ALIGNMENT))
        for data in datas:
            f.write(data + bytes(-len(data) % DEFAULT_ALIGNMENT))


@functools.lru_cache(maxsize=4)
def _cached(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def read_gguf(path: str | Path) -> GGUFFile:
    """The parsed GGUF file at path (one parse per process while the file is unchanged)."""
    path = Path(path).resolve()
    try:
        stat = path.stat()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read GGUF file ({e})") from e
    return _cached(path, stat.st_size, stat.st_mtime_ns)
