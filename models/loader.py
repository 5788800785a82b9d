"""Checkpoint loading: safetensors shards -> canonical tensors, lazily and memory-mapped.

The adapter lists the canonical tensors it expects as `TensorRef`s (each with one or more HF layouts it may come
from). `WeightStore` checks the whole list against the checkpoint's headers before reading a byte (missing,
extra and mis-shaped tensors are reported by name with both shapes), then reads tensors on demand.

Reading goes through `TensorSource` (name -> shape/dtype/read). Quantized checkpoints plug in a source that
presents each quantized Linear as its logical `.weight` and dequantizes on read (quant/ provides it), so adapters
and the reference decoder never see a format.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import torch
from safetensors import safe_open

from .errors import CheckpointError, ConfigError


@dataclass(frozen=True)
class Layout:
    """One way an HF checkpoint stores a canonical tensor.

    The HF tensor `hf_name` (shape `hf_shape`) is indexed by `take` on its leading dims (an expert id of a fused
    expert tensor), then transposed if `transpose` ([in, out] -> [out, in]), then restricted to `rows`:
    None, "even"/"odd" (gpt-oss interleaved gate/up), or (start, stop).
    """
    hf_name: str
    hf_shape: tuple[int, ...]
    take: tuple[int, ...] = ()
    transpose: bool = False
    rows: object = None

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        for idx in self.take:
            t = t[idx]
        if self.transpose:
            t = t.transpose(-1, -2)
        if self.rows == "even":
            t = t[0::2]
        elif self.rows == "odd":
            t = t[1::2]
        elif isinstance(self.rows, tuple):
            t = t[self.rows[0]:self.rows[1]]
        return t

    def shape(self) -> tuple[int, ...]:
        """Shape of `apply(hf tensor)`, from `hf_shape` alone (no tensor needed: sizing, parameter counts)."""
        shape = list(self.hf_shape[len(self.take):])
        if self.transpose:
            shape[-2], shape[-1] = shape[-1], shape[-2]
        if self.rows == "even":
            shape[0] = (shape[0] + 1) // 2
        elif self.rows == "odd":
            shape[0] //= 2
        elif isinstance(self.rows, tuple):
            shape[0] = len(range(shape[0])[self.rows[0]:self.rows[1]])
        return tuple(shape)


@dataclass(frozen=True)
class TensorRef:
    name: str                          # canonical name (spec.canonical)
    layouts: tuple[Layout, ...]        # alternatives, first present wins
    optional: bool = False             # e.g. lm_head of a tied model


class TensorSource(Protocol):
    path: str

    def shapes(self) -> dict[str, tuple[int, ...]]: ...

    def read(self, name: str) -> torch.Tensor: ...


def _read_header(path: str) -> dict:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise CheckpointError(f"{path}: truncated safetensors file (header says {n} bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, tensors need {8 + n + end})")
    return header


class SafetensorsSource:
    """All shards of a checkpoint directory (model.safetensors.index.json or every *.safetensors file)."""

    def __init__(self, model_dir: str):
        self.path = model_dir
        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                weight_map = json.load(open(index))["weight_map"]
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"{index}: unreadable index ({e})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
            weight_map = None
        if not files:
            raise CheckpointError(f"{model_dir}: no *.safetensors files")
        self._where: dict[str, str] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        self._dtype: dict[str, str] = {}
        for fname in files:
            fpath = os.path.join(model_dir, fname)
            if not os.path.exists(fpath):
                raise CheckpointError(f"{fpath}: shard named in the index is missing")
            for name, info in _read_header(fpath).items():
                if weight_map is not None and weight_map.get(name, fname) != fname:
                    continue                  # the index says another shard holds it
                if name in self._where:
                    raise CheckpointError(f"{fpath}: tensor {name} is also in {self._where[name]} (two shards hold "
                                          "it and there is no model.safetensors.index.json to say which counts)")
                self._where[name] = fpath
                self._shape[name] = tuple(info["shape"])
                self._dtype[name] = info["dtype"]
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in self._where:
                    raise CheckpointError(f"{os.path.join(model_dir, fname)}: tensor {name} listed in the index is not in the file")
        self._handles: dict[str, object] = {}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shape)

    def dtype(self, name: str) -> str:
        return self._dtype[name]

    def file_of(self, name: str) -> str:
        return self._where[name]

    def read(self, name: str) -> torch.Tensor:
        fpath = self._where[name]
        try:
            h = self._handles.get(fpath)
            if h is None:
                h = self._handles[fpath] = safe_open(fpath, framework="pt", device="cpu")
            return h.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"{fpath}: cannot read tensor {name} ({e})") from None


class DictSource:
    """A TensorSource over tensors already in memory (synthetic weights built on a device)."""

    def __init__(self, tensors: dict[str, torch.Tensor], path: str):
        self.tensors, self.path = tensors, path

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(t.shape) for n, t in self.tensors.items()}

    def read(self, name: str) -> torch.Tensor:
        return self.tensors[name]


# safetensors dtypes a float (unquantized) checkpoint's weights may have
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
# Names a checkpoint may hold that no backend needs (buffers saved by old code).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightStore:
    """Canonical name -> tensor, validated up front, read lazily (one HF tensor cached for fused layouts)."""

    def __init__(self, source: TensorSource, refs: Iterable[TensorRef], ignore: Callable[[str], bool] = lambda n: False):
        self.source = source
        shapes = source.shapes()
        self._layout: dict[str, Layout] = {}
        used: set[str] = set()
        missing = []
        for ref in refs:
            for lay in ref.layouts:
                if lay.hf_name in shapes:
                    got = shapes[lay.hf_name]
                    if tuple(got) != tuple(lay.hf_shape):
                        where = getattr(source, "file_of", lambda n: source.path)(lay.hf_name)
                        raise CheckpointError(
                            f"{where}: tensor {lay.hf_name} has shape {list(got)}, config.json implies {list(lay.hf_shape)}")
                    if isinstance(source, SafetensorsSource) and source.dtype(lay.hf_name) not in FLOAT_DTYPES:
                        raise CheckpointError(
                            f"{source.file_of(lay.hf_name)}: tensor {lay.hf_name} is {source.dtype(lay.hf_name)}; a "
                            f"float checkpoint holds {'/'.join(FLOAT_DTYPES)} weights (quantized ones need a "
                            "quantization_config in config.json)")
                    self._layout[ref.name] = lay
                    used.add(lay.hf_name)
                    break
            else:
                if not ref.optional:
                    missing.append(ref.layouts[0].hf_name)
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise CheckpointError(f"{source.path}: missing tensor(s) {', '.join(missing[:3])}{more}")
        extra = sorted(n for n in shapes if n not in used and not n.endswith(IGNORED_SUFFIXES) and not ignore(n))
        if extra:
            more = f" (and {len(extra) - 3} more)" if len(extra) > 3 else ""
            raise CheckpointError(f"{source.path}: unexpected tensor(s) {', '.join(extra[:3])}{more} "
                                  f"(shape {list(shapes[extra[0]])}); config.json does not describe them")
        self._cache_name: str | None = None
        self._cache: torch.Tensor | None = None

    def __contains__(self, name: str) -> bool:
        return name in self._layout

    def names(self) -> list[str]:
        return list(self._layout)

    def hf_name(self, name: str) -> str:
        return self._layout[name].hf_name

    def get(self, name: str) -> torch.Tensor:
        lay = self._layout.get(name)
        if lay is None:
            raise KeyError(f"no tensor {name!r} in {self.source.path}")
        if self._cache_name != lay.hf_name:
            self._cache_name, self._cache = lay.hf_name, self.source.read(lay.hf_name)
        return lay.apply(self._cache)


def read_config(model_dir: str) -> dict:
    if not os.path.isdir(model_dir):
        raise ConfigError(f"{model_dir}: no such model directory")
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise ConfigError(f"{path}: missing (a model directory needs config.json and *.safetensors)")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected a JSON object of settings, got a {type(cfg).__name__}")
    return cfg
