"""GGUF's container read in one pass over its header: the metadata and the tensor index, the data
memory-mapped.

Owns: `GGUFFile` (`metadata`: key -> value, scalars and numeric arrays decoded, an array of strings as
its length only (a vocabulary's 49k strings are the tokenizer's business, not a boot's); `tensors`:
name -> `TensorInfo`, dims in the file's order, fastest-moving first; `mapped()`: the file mapped
copy-on-write, whose [offset, offset + num_bytes) is a tensor's data) and `read_gguf` (one parse per
file and process while the file's size and mtime stay the same; the parse keeps no mapping open).

Why not gguf's own GGUFReader: it decodes every array element into Python objects, ~2 s for
SmolLM2's vocabulary, which the controller and every rank would each pay at boot. The format (magic,
version, counts, typed key/values, tensor infos, aligned data) is GGUF's published specification; the
`gguf` package still supplies its constants (value types, block sizes) and writes the test files.
"""
from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from phaseflip.engine.checkpoint.loader import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct format of a scalar
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class StringArray:
    """An array of strings, not decoded: its length."""
    count: int


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
            for _ in range(count):   # skipped: lengths only
                self._pos += 8 + struct.unpack_from("<Q", self._map, self._pos)[0]
            return StringArray(count)
        return [self._value(item) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
        return name, dims, self._scalar("<I"), self._scalar("<Q")


def _num_bytes(dims: tuple[int, ...], type_id: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType   # at the call: no import-time work
    try:
        block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError) as e:
        raise ValueError(f"unknown tensor type {type_id}") from e
    values = int(np.prod(dims, dtype=np.int64))
    return values // block_values * block_bytes


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
