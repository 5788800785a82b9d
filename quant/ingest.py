"""Reading quantized checkpoints: a TensorSource that presents every quantized weight as its logical float tensor.

`QuantizedSource(src, quantization_config)` wraps a models.loader.SafetensorsSource and has the same interface
(path, shapes(), dtype(name), read(name), file_of(name)), so adapters and WeightStore never see a format:
each quantized Linear appears as `<module>.weight` with its logical shape, read() dequantizes it to bf16, and
the scale tensors are hidden. `read_quantized(name)` hands GPU backends the raw codes instead, and
`quantized(store, canonical)` does the same for one canonical tensor of a WeightStore (applying its Layout).

What it reads (config.json's quantization_config, then tensor names and dtypes):

- compressed-tensors (`quant_method: compressed-tensors`), the four schemes of schemes.py: `<m>.weight`
  e4m3 + `<m>.weight_scale` (fp8 / fp8-block, told apart by the config), `<m>.weight_packed` +
  `<m>.weight_scale` (+ `<m>.weight_global_scale`: nvfp4, else mxfp4). Activation / KV-cache qparams
  (`input_scale`, `k_scale`, ...) are hidden: we run weights-only. llm-compressor's bf16 fp8 scales and
  nvfp4 scales stored as raw uint8 are upcast / viewed exactly before validation.
- native FP8 block (`quant_method: fp8`, DeepSeek-V3 / Qwen3-*-FP8): `<m>.weight` e4m3 + `<m>.weight_scale_inv`.
- gpt-oss MXFP4 (any quant_method, found by name): `P_blocks` u8 [E, out, in/32, 16] + `P_scales` u8
  [E, out, in/32] are presented as the bf16 parameter `P` in HF's [E, in, out] orientation, so the gpt-oss
  adapter's Layouts (take expert, transpose, even/odd rows) work unchanged.
- our stacked fused-expert form (what quant/convert.py writes for gpt-oss's [E, in, out] parameters in the
  schemes other than mxfp4; compressed-tensors has no way to express a 3-D parameter that is not a Linear's
  `.weight`): `P_weight` / `P_weight_packed`, `P_weight_scale`, `P_weight_global_scale`, i.e. the scheme's
  tensors named `P_<tensor>`, stored out-major [E, out, in] like gpt-oss's `_blocks`, and presented as P
  [E, in, out] like them.

Stacked `.weight`s (Laneformer lane tensors [L, out/L, in]) are read like 2-D ones: every per-row scale keeps
its lead axis ([L, out/L, 1], [L, 1] global), so each lane is its own compressed-tensors matrix.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from compressed_tensors.quantization import QuantizationMetadata

from kie_moe.models.errors import CheckpointError, ConfigError  # user-facing error classes (a leaf module)

from .ct_format import dequant_fp8_block_native, native_fp8_block_size, parse_quantization_config, read_quantized
from .schemes import QuantizedTensor

__all__ = ["QuantizedSource", "quantized", "GPTOSS_SUFFIXES", "STACKED_SUFFIXES"]

GPTOSS_SUFFIXES = ("_blocks", "_scales")
# local tensor names of every scheme, longest first so "_weight_global_scale" wins over "_weight_scale"
STACKED_SUFFIXES = ("_weight_global_scale", "_weight_packed", "_weight_scale", "_weight")
# per-module qparams we hide (activation / output scales of W8A8 / W4A4 checkpoints, and the weight ones)
_QPARAMS = tuple(QuantizationMetadata.all_qparam_names()) + ("weight_scale_inv", "weight_packed", "q_scale")
_KV_SCALES = ("k_scale", "v_scale", "q_scale")
_FP8 = "F8_E4M3"
_ST_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


@dataclass(frozen=True)
class _Entry:
    """One logical tensor. kind: raw (stored as is) | module (`<m>.<local>` tensors, logical `<m>.weight`) |
    stacked (`P_<local>`, logical P, transposed) | gptoss (`P_blocks` / `P_scales`, logical P, transposed)."""

    kind: str
    shape: tuple[int, ...]
    raw: Mapping[str, str]  # local tensor name -> stored tensor name ("" -> the raw tensor itself)
    prefix: str = ""  # the module / parameter name the scheme and config are looked up under

    @property
    def transposed(self) -> bool:
        """Stored out-major [E, out, in] while presented as [E, in, out]."""
        return self.kind in ("stacked", "gptoss")


class QuantizedSource:
    """A quantized checkpoint seen as logical float tensors; see the module docstring for the formats."""

    def __init__(self, src, quantization_config: Mapping[str, Any], dtype: torch.dtype = torch.bfloat16):
        self.src = src
        self.dtype_out = dtype  # what read() dequantizes to (bf16: what the checkpoints were made from)
        self.path = src.path
        self.quantization_config = dict(quantization_config)
        where = os.path.join(src.path, "config.json")
        method = self.quantization_config.get("quant_method")
        self.method = method
        self._ct = None
        self._block = None
        try:
            if method == "compressed-tensors":
                self._ct = parse_quantization_config(self.quantization_config)
                for key in ("sparsity_config", "transform_config"):  # 2:4 sparsity / rotated weights: not plain
                    extra = self.quantization_config.get(key) or {}
                    if extra and extra.get("format", "") != "dense":
                        raise ValueError(f"{key} is set ({json.dumps(extra)[:80]}); kie reads only dense, "
                                         "unrotated weights")
            elif method == "fp8":
                self._block = native_fp8_block_size(self.quantization_config)
            elif method != "mxfp4":
                raise ValueError(f"quant_method {method!r} is not supported (compressed-tensors, fp8, mxfp4)")
        except ValueError as e:  # includes pydantic's ValidationError
            raise ConfigError(f"{where}: quantization_config: {e}") from None
        self._entries = self._index()

    # ------------------------------------------------------------------------------------------ index
    def _index(self) -> dict[str, _Entry]:
        shapes = self.src.shapes()
        dtype = self.src.dtype
        hidden: set[str] = set()
        entries: dict[str, _Entry] = {}

        def hide(names):
            hidden.update(n for n in names if n in shapes)

        # gpt-oss MXFP4 experts, under any quant_method
        for n in shapes:
            if n.endswith("_blocks") and n[:-7] + "_scales" in shapes:
                p = n[:-7]
                b = shapes[n]
                if dtype(n) != "U8" or len(b) != 4 or b[-1] != 16:
                    raise CheckpointError(f"{self.src.file_of(n)}: {n} should be uint8 [E, out, in/32, 16], "
                                          f"got {dtype(n)} {list(b)}")
                entries[p] = _Entry("gptoss", (b[0], b[2] * 32, b[1]), {"blocks": n, "scales": p + "_scales"}, p)
                hide((n, p + "_scales"))
        if self._ct is not None:
            for n in shapes:
                if n in hidden:
                    continue
                mod, _, local = n.rpartition(".")
                if (local == "weight_packed" and dtype(n) == "U8") or (local == "weight" and dtype(n) == _FP8):
                    entries[f"{mod}.weight"] = self._module_entry(mod, shapes, sep=".")
                    hide(f"{mod}.{q}" for q in _QPARAMS + ("weight",))
                elif "." in n and not local.startswith("weight"):
                    for suf in ("_weight_packed", "_weight"):
                        if n.endswith(suf) and dtype(n) == ("U8" if suf == "_weight_packed" else _FP8):
                            p = n[: -len(suf)]
                            e = self._module_entry(p, shapes, sep="_")
                            entries[p] = _Entry("stacked", (*e.shape[:-2], e.shape[-1], e.shape[-2]), e.raw, p)
                            hide(f"{p}_{q}" for q in _QPARAMS + ("weight",))
            hide(n for n in shapes if n.rpartition(".")[2] in _KV_SCALES)
        elif self._block is not None:
            for n in shapes:
                mod, _, local = n.rpartition(".")
                if local == "weight" and dtype(n) == _FP8:
                    s = f"{mod}.weight_scale_inv"
                    if s not in shapes:
                        raise CheckpointError(f"{self.src.file_of(n)}: fp8 weight {n} has no {s}")
                    entries[n] = _Entry("module", shapes[n], {"weight": n, "weight_scale": s}, mod)
                    hide((n, s, f"{mod}.input_scale"))
        for n, shape in shapes.items():
            if n not in hidden and n not in entries:
                if dtype(n) == _FP8:
                    raise CheckpointError(f"{self.src.file_of(n)}: {n} is float8 but has no scale tensor next to it")
                entries[n] = _Entry("raw", tuple(shape), {"": n})
        return entries

    def _module_entry(self, prefix: str, shapes, sep: str) -> _Entry:
        """The tensors of one compressed-tensors module `prefix` (sep ".") or stacked parameter (sep "_")."""
        name = "weight_packed" if f"{prefix}{sep}weight_packed" in shapes else "weight"
        locals_ = ("weight_packed", "weight_scale", "weight_global_scale") if name == "weight_packed" else ("weight", "weight_scale")
        raw = {n: f"{prefix}{sep}{n}" for n in locals_ if f"{prefix}{sep}{n}" in shapes}
        if "weight_scale" not in raw:
            where = self.src.file_of(f"{prefix}{sep}{name}")
            raise CheckpointError(f"{where}: quantized {prefix}{sep}{name} has no {prefix}{sep}weight_scale")
        codes = shapes[raw[name]]
        logical = (*codes[:-1], codes[-1] * 2) if name == "weight_packed" else tuple(codes)
        return _Entry("module", tuple(logical), raw, prefix)

    # ------------------------------------------------------------------------------------- interface
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: e.shape for n, e in self._entries.items()}

    def dtype(self, name: str) -> str:
        e = self._entry(name)
        return self.src.dtype(e.raw[""]) if e.kind == "raw" else _ST_NAMES.get(self.dtype_out, "BF16")

    def file_of(self, name: str) -> str:
        e = self._entry(name)
        return self.src.file_of(next(iter(e.raw.values())))

    def is_quantized(self, name: str) -> bool:
        return self._entry(name).kind != "raw"

    def is_transposed(self, name: str) -> bool:
        """True for gpt-oss-style parameters: read_quantized gives [E, out, in], read() gives [E, in, out]."""
        return self._entry(name).transposed

    def read(self, name: str) -> torch.Tensor:
        """The logical tensor: raw ones exactly as stored, quantized ones dequantized (to bf16 by default)."""
        e = self._entry(name)
        if e.kind == "raw":
            return self.src.read(e.raw[""])
        if self._block is not None and self._block != (128, 128):  # no QuantizedTensor for odd block sizes
            t = {k: self.src.read(v) for k, v in e.raw.items()}
            return dequant_fp8_block_native(t["weight"], t["weight_scale"], self._block, self.dtype_out, name)
        w = self.read_quantized(name).dequantize(self.dtype_out)  # [.., out, in]
        return w.transpose(-1, -2).contiguous() if e.transposed else w

    def read_quantized(self, name: str) -> QuantizedTensor | None:
        """The stored codes + scales of logical tensor `name` (None if it is stored in float). Shape [.., out, in]:
        for the transposed kinds (is_transposed) that is the transpose of what read() returns."""
        e = self._entry(name)
        if e.kind == "raw":
            return None
        where = self.file_of(name)
        try:
            t = {k: self.src.read(v) for k, v in e.raw.items()}
            if e.kind == "gptoss":
                *lead, g, _ = t["blocks"].shape
                return QuantizedTensor("mxfp4", {"weight_packed": t["blocks"].reshape(*lead, g * 16),
                                                 "weight_scale": t["scales"]}, e.shape[:-2] + (e.shape[-1], e.shape[-2]),
                                       self.dtype_out)
            t = _normalize(t)
            if self._block is not None:
                if self._block != (128, 128):
                    return None
                return QuantizedTensor("fp8-block", t, e.shape, self.dtype_out)
            # compressed-tensors: ct_format.read_quantized checks names, dtypes and shapes against the config
            view = {f"{e.prefix}.{k}": v for k, v in t.items()}
            q = read_quantized(view, e.prefix, self._ct, self.dtype_out)
        except (ValueError, TypeError) as err:
            raise CheckpointError(f"{where}: {name}: {err}") from None
        if q is None:
            raise CheckpointError(f"{where}: {name}: stored quantized but read back as float")
        return q

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in {self.path}") from None


def _normalize(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Exact dtype fix-ups for what other writers store: e4m3 as uint8 bytes, fp8 / global scales in bf16 or
    f16 (llm-compressor keeps fp8 scales in the model dtype), a 0-d global scale."""
    t = dict(t)
    packed = "weight_packed" in t
    if not packed and t["weight"].dtype == torch.uint8:
        t["weight"] = t["weight"].view(torch.float8_e4m3fn)
    s = t.get("weight_scale")
    if s is not None:
        if packed and "weight_global_scale" in t and s.dtype == torch.uint8:
            t["weight_scale"] = s.view(torch.float8_e4m3fn)
        elif not packed and s.dtype in (torch.bfloat16, torch.float16):
            t["weight_scale"] = s.float()  # bf16 / f16 -> f32 is exact; any other dtype is refused by name later
    g = t.get("weight_global_scale")
    if g is not None:
        if g.dtype in (torch.bfloat16, torch.float16):
            g = g.float()
        t["weight_global_scale"] = g.reshape(1) if g.ndim == 0 else g
    return t


# ------------------------------------------------------------------------------------------ WeightStore level
def quantized(store, canonical: str) -> QuantizedTensor | None:
    """The quantized codes of one canonical tensor of a WeightStore (models/loader.py), with its Layout applied:
    `take` indexes the lead (expert) axis, `rows` selects rows of codes and row scales. Returns None when the
    tensor is stored in float, when the source has no quantized reader, or when the selection cannot be expressed
    in the format without requantizing (fp8-block rows that cut 128-row blocks, e.g. gpt-oss's even/odd rows,
    or a transposed view of a weight stored [out, in]); read the float tensor with store.get() then."""
    src = store.source
    if not hasattr(src, "read_quantized"):
        return None
    lay = store._layout.get(canonical)  # WeightStore keeps its resolved Layouts private; this is its one reader
    if lay is None:
        raise KeyError(f"no tensor {canonical!r} in {src.path}")
    q = src.read_quantized(lay.hf_name)
    if q is None:
        return None
    if bool(lay.transpose) != src.is_transposed(lay.hf_name):
        return None
    tensors, shape = dict(q.tensors), q.shape
    for idx in lay.take:
        tensors = {n: t[idx] for n, t in tensors.items()}
        shape = shape[1:]
    if lay.rows is not None:
        out = shape[-2]
        if lay.rows in ("even", "odd"):
            sl, n_out = slice(0 if lay.rows == "even" else 1, None, 2), (out + (lay.rows == "even")) // 2
        else:
            a, b = lay.rows
            sl, n_out = slice(a, b), b - a
        for n, t in tensors.items():
            if n == "weight_global_scale":
                continue
            if q.scheme == "fp8-block" and n == "weight_scale":
                if not isinstance(lay.rows, tuple) or a % 128 or (b % 128 and b != out):
                    return None
                tensors[n] = t[..., a // 128:-(-b // 128), :]
            else:
                tensors[n] = t[..., sl, :]
        shape = (*shape[:-2], n_out, shape[-1])
    return QuantizedTensor(q.scheme, tensors, shape, q.dtype)
