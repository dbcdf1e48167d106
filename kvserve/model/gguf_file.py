"""Reading the GGUF container: metadata key/values and tensor byte ranges.

The format (v2/v3): magic "GGUF", version u32, tensor count u64, metadata
count u64; then metadata entries (string key, u32 type, value); then tensor
infos (name, n_dims u32, dims u64[n], ggml type u32, offset u64); then, at the
next multiple of `general.alignment` (32 by default), the tensor data.

The `gguf` package's reader builds Python objects for every array element
(about 4 s for SmolLM2's 49k-token vocabulary); this one slices numeric arrays
straight out of a memory map and takes 0.1 s.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.arith import round_up
from kvserve.errors import ModelLoadError

_MAGIC = b"GGUF"
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_STRING, _ARRAY = 8, 9
# GGUF value type -> numpy dtype for the fixed-size scalar types.
_SCALARS: dict[int, np.dtype] = {
    0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"), 4: np.dtype("<u4"),
    5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("?"), 10: np.dtype("<u8"), 11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (outermost first); GGUF stores innermost first
    ggml_type: int
    offset: int  # absolute byte offset in the file


class _Cursor:
    def __init__(self, data: np.ndarray) -> None:
        self.data = data
        # Integers and strings are read from a memoryview of the map: a numpy slice per field cost ~2 us,
        # 0.7 s for the ~100k strings of a 49k-token vocabulary and its merges.
        self.buffer = memoryview(data)
        self.size = len(self.buffer)
        self.pos = 0

    def _end(self, size: int) -> int:
        end = self.pos + size
        if end > self.size:
            raise ModelLoadError("GGUF file is truncated")
        return end

    def take(self, size: int) -> np.ndarray:
        end = self._end(size)
        out = self.data[self.pos : end]
        self.pos = end
        return out

    def _unpack(self, fmt: struct.Struct) -> int:
        end = self._end(fmt.size)
        value = fmt.unpack_from(self.buffer, self.pos)[0]
        self.pos = end
        return value

    def u32(self) -> int:
        return self._unpack(_U32)

    def u64(self) -> int:
        return self._unpack(_U64)

    def string(self) -> str:
        end = self._end(self.u64())
        text = str(self.buffer[self.pos : end], "utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            dtype = _SCALARS[value_type]
            return self.take(dtype.itemsize).view(dtype)[0].item()
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.u32(), self.u64()
            if item_type in _SCALARS:
                dtype = _SCALARS[item_type]
                return self.take(dtype.itemsize * count).view(dtype).tolist()
            return [self.value(item_type) for _ in range(count)]
        raise ModelLoadError(f"GGUF metadata has an unknown value type {value_type}")


class GGUFFile:
    """A GGUF file opened read-only as a memory map."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {self.path}: {exc}") from exc
        cursor = _Cursor(self._data)
        if self._data.size < 24 or cursor.take(4).tobytes() != _MAGIC:
            raise ModelLoadError(f"{self.path} is not a readable GGUF file (bad magic)")
        self.version = cursor.u32()
        if self.version not in (2, 3):
            raise ModelLoadError(f"{self.path}: GGUF version {self.version} is not supported (2 or 3)")
        tensor_count, kv_count = cursor.u64(), cursor.u64()
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.u32())
        infos = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = [cursor.u64() for _ in range(cursor.u32())]
            infos.append((name, tuple(reversed(dims)), cursor.u32(), cursor.u64()))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = round_up(cursor.pos, alignment)
        self.tensors = [GGUFTensorInfo(n, s, t, data_start + o) for n, s, t, o in infos]

    def tensor_bytes(self, info: GGUFTensorInfo, num_bytes: int) -> np.ndarray:
        """The `num_bytes` raw bytes of one tensor (a view into the memory map)."""
        if info.offset + num_bytes > self._data.size:
            raise ModelLoadError(f"{self.path}: tensor {info.name} runs past the end of the file")
        return self._data[info.offset : info.offset + num_bytes]
