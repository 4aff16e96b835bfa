"""Dequantized weights of a downloaded GGUF, kept as one safetensors file beside it.

Dequantizing a Q4_K_M file on CPU takes minutes; reading the safetensors back takes seconds.
The file is written tensor by tensor at offsets fixed by a header built from the shapes the
model expects, so the model is never held twice in memory, under a temporary name of the
writing process's own (two may load the model for the first time at once), renamed only once
every tensor is in.
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Iterable, Iterator

import torch

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def cache_path(gguf: Path, dtype: torch.dtype) -> Path:
    return gguf.with_name(f"{gguf.stem}.{str(dtype).removeprefix('torch.')}.safetensors")


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                      tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Write exactly the tensors named in `shapes` (in any order) as `dtype`."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    header, end = {}, 0
    for name, shape in shapes.items():
        size = math.prod(shape) * itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [end, end + size]}
        end += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data to 8 bytes
    base = 8 + len(blob)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    written = set()
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            f.truncate(base + end)
            for name, t in tensors:
                if name not in header:
                    raise ValueError(f"tensor {name!r} is not one the model expects")
                if tuple(t.shape) != tuple(header[name]["shape"]):
                    raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {header[name]['shape']}")
                f.seek(base + header[name]["data_offsets"][0])
                f.write(t.to("cpu", dtype).contiguous().reshape(-1).view(torch.uint8).numpy().data)
                written.add(name)
        missing = sorted(set(header) - written)
        if missing:
            raise ValueError(f"{len(missing)} tensors never came, e.g. {missing[:3]}")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def read_safetensors(path: Path, dtype: torch.dtype, device) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(path, framework="pt", device=str(device or "cpu")) as f:
        for name in f.keys():
            yield name, f.get_tensor(name).to(dtype)
