"""Weight quantization schemes (fp8, fp8-block, nvfp4, mxfp4) and the QuantizedTensor they produce.

Each scheme is a frozen dataclass that knows its compressed-tensors preset and format, the tensors it
writes per Linear (names, shapes, dtypes: a loader can allocate before it reads), how to compute scales
and codes, and how to dequantize. Scales follow compressed-tensors' ``calculate_qparams`` /
``generate_gparam`` and codes its ``quantize``, computed in float32 (the weight is upcast first), so that
compressed-tensors' compressors decompress what we write to the same values we do (tests/quant).

Weights are [out, in] or stacked experts [E, out, in]; a stacked weight is quantized slice by slice
(every per-tensor quantity, e.g. the nvfp4 global scale, becomes per expert: [E, 1]), and
``QuantizedTensor.unstack()`` gives the 2-D per-expert tensors compressed-tensors and vLLM expect.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from .codecs import (
    E2M1_MAX,
    E4M3_MAX,
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    e8m0_from_amax,
    encode_e2m1,
    encode_e4m3,
    pack_nibbles,
    unpack_nibbles,
)

__all__ = [
    "NotQuantizable",
    "Scheme",
    "Fp8ChannelScheme",
    "Fp8BlockScheme",
    "NvFp4Scheme",
    "MxFp4Scheme",
    "SCHEMES",
    "get_scheme",
    "with_observer",
    "takes_observer",
    "OBSERVERS",
    "QuantizedTensor",
    "quantize",
    "nvfp4_global_scale",
    "shared_global_scale",
]

# compressed-tensors replaces a zero scale by the "eps" of the scale dtype (``_get_dtype_eps``): f32 eps
# for fp8 (no scale_dtype set, scales are f32 here), 0.125 for e4m3 scales (nvfp4). MX scales are never 0.
_F32_EPS = torch.finfo(torch.float32).eps
_E4M3_SCALE_EPS = 0.125
_NVFP4_GLOBAL_NUMERATOR = E4M3_MAX * E2M1_MAX  # 2688: maps the tensor amax to e4m3 max x e2m1 max
# observer "mse": the nvfp4 group scale candidates below the minmax one (factors before e4m3 rounding)
_MSE_SHRINK = (0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)
OBSERVERS = ("minmax", "mse")


class NotQuantizable(ValueError):
    """A weight this scheme cannot represent (shape, not values): the converter keeps it in bf16 and warns.

    Values that are wrong (NaN / Inf) raise a plain ValueError instead: that is a broken checkpoint.
    """

    def __init__(self, name: str, scheme: str, reason: str):
        self.name, self.scheme, self.reason = name, scheme, reason
        super().__init__(f"{name}: cannot quantize to {scheme}: {reason}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Scheme:
    """A weight format. ``name`` is what users type (kie convert --scheme); ``preset`` and ``format`` are
    compressed-tensors' preset scheme name and CompressionFormat value written to config.json."""

    name: str
    preset: str
    format: str
    tensor_names: tuple[str, ...]

    @property
    def weight_name(self) -> str:
        """The tensor holding the codes ("weight" or "weight_packed"); compressed-tensors keys on it."""
        return self.tensor_names[0]

    def check(self, shape: Sequence[int], name: str = "weight") -> None:
        """Raise NotQuantizable if a weight of this shape cannot be written in this format."""
        if len(shape) not in (2, 3):
            raise NotQuantizable(name, self.name, f"needs a 2-D [out, in] or 3-D [E, out, in] weight, got shape {tuple(shape)}")
        if any(d == 0 for d in shape):
            raise NotQuantizable(name, self.name, f"empty weight, shape {tuple(shape)}")

    def tensor_specs(self, shape: Sequence[int]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of every tensor written for a weight of ``shape``."""
        raise NotImplementedError

    def _quantize(self, w: torch.Tensor, global_scale: torch.Tensor | None, name: str) -> dict[str, torch.Tensor]:
        """w: float32 [..., out, in], finite, shape already checked."""
        raise NotImplementedError

    def _dequantize(self, t: Mapping[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """-> float32 [..., out, in]."""
        raise NotImplementedError

    # element grid, for solvers that choose codes themselves under fixed scales (quant/gptq.py)
    def _round(self, x: torch.Tensor) -> torch.Tensor:
        """float32 values already divided by their scale -> the nearest element of the format's grid (float32)."""
        raise NotImplementedError

    def _store(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [.., out, in] values on the grid -> the code tensor as written (``weight_name``'s)."""
        raise NotImplementedError


def _div(x: torch.Tensor, c: float) -> torch.Tensor:
    """x / c correctly rounded on every device. PyTorch's CUDA kernel turns division by a Python (CPU) scalar into
    multiplication by its reciprocal (1/448 is inexact), so `amax / 448` differed from the CPU's in the last bit for
    about half of the rows and the fp8 codes / scales written on a GPU were not the CPU's (test_quant_schemes
    test_cuda_gives_the_same_bits_as_cpu, failing since 2026-12-02); a tensor divisor gets a true division."""
    return x / torch.full_like(x, c)


@dataclass(frozen=True)
class _E4M3Scheme(Scheme):
    def _round(self, x):
        return decode_e4m3(encode_e4m3(x))

    def _store(self, x):
        return encode_e4m3(x)


@dataclass(frozen=True)
class Fp8ChannelScheme(_E4M3Scheme):
    """FP8_DYNAMIC weights: e4m3 [.., out, in], float32 weight_scale [.., out, 1] = row amax / 448.

    llm-compressor stores this scale in the weight's dtype (bf16 for bf16 models); we keep float32, which
    vLLM loads into its float32 parameter either way and which saturates fewer rows.
    """

    def tensor_specs(self, shape):
        *lead, out, _ = shape
        return {"weight": (tuple(shape), torch.float8_e4m3fn), "weight_scale": ((*lead, out, 1), torch.float32)}

    def _quantize(self, w, global_scale, name):
        amax = w.abs().amax(dim=-1, keepdim=True)  # [.., out, 1]
        scale = _div(amax, E4M3_MAX)
        scale = torch.where(scale == 0, _F32_EPS, scale)
        return {"weight": encode_e4m3(w / scale), "weight_scale": scale}

    def _dequantize(self, t, shape):
        return decode_e4m3(t["weight"]) * t["weight_scale"].float()


@dataclass(frozen=True)
class Fp8BlockScheme(_E4M3Scheme):
    """FP8_BLOCK weights: e4m3 [.., out, in] (unpadded), float32 weight_scale [.., ceil(out/bo), ceil(in/bi)].

    Ragged edges: compressed-tensors zero-pads to whole blocks to compute amax and quantize, then crops the
    codes back; the edge blocks' scales cover only the real elements. compressed-tensors itself notes that
    vLLM's block kernels want ``in`` to be a multiple of 128 (``initialize_qparams``): the converter should
    prefer leaving such a layer unquantized or check its target engine.
    """

    block: tuple[int, int] = (128, 128)

    def tensor_specs(self, shape):
        *lead, out, inp = shape
        bo, bi = self.block
        return {
            "weight": (tuple(shape), torch.float8_e4m3fn),
            "weight_scale": ((*lead, _cdiv(out, bo), _cdiv(inp, bi)), torch.float32),
        }

    def _quantize(self, w, global_scale, name):
        *lead, out, inp = w.shape
        bo, bi = self.block
        po, pi = _cdiv(out, bo) * bo, _cdiv(inp, bi) * bi
        wp = F.pad(w, (0, pi - inp, 0, po - out))  # zeros never raise a block's amax
        blocks = wp.reshape(*lead, po // bo, bo, pi // bi, bi)  # [.., ob, bo, ib, bi]
        amax = blocks.abs().amax(dim=(-3, -1))  # [.., ob, ib]
        scale = _div(amax, E4M3_MAX)
        scale = torch.where(scale == 0, _F32_EPS, scale)
        q = (blocks / scale[..., :, None, :, None]).reshape(*lead, po, pi)[..., :out, :inp]
        return {"weight": encode_e4m3(q).contiguous(), "weight_scale": scale}

    def _dequantize(self, t, shape):
        *_, out, inp = shape
        bo, bi = self.block
        s = t["weight_scale"].float()
        s = s.repeat_interleave(bo, dim=-2)[..., :out, :].repeat_interleave(bi, dim=-1)[..., :inp]  # [.., out, in]
        return decode_e4m3(t["weight"]) * s


@dataclass(frozen=True)
class _Fp4Scheme(Scheme):
    """Shared by nvfp4 / mxfp4: e2m1 codes packed two per byte along ``in`` (element 2k low nibble).

    observer "minmax" (compressed-tensors' default): each group's scale maps its amax to e2m1's 6. "mse" (as
    llm-compressor's MSE observer): each group takes, of a few candidate scales at and below that one, the one
    whose codes reconstruct the group with the least squared error (a smaller scale clips the group's largest
    value to gain resolution for the rest; e2m1 has 8 magnitudes, so that trade often pays). Only the scale
    values differ: the layout, and every reader, stay the same."""

    group_size: int = 16
    observer: str = "minmax"

    def check(self, shape, name="weight"):
        super().check(shape, name)
        if shape[-1] % self.group_size:
            # compressed-tensors' group quantization raises on a ragged last group (``_process_group``) and
            # its decompress would too, so there is no layout vLLM could read: leave the tensor unquantized.
            raise NotQuantizable(
                name, self.name, f"in={shape[-1]} is not a multiple of the group size {self.group_size}"
            )

    def _round(self, x):
        return decode_e2m1(encode_e2m1(x))

    def _store(self, x):
        return pack_nibbles(encode_e2m1(x))

    def _groups(self, w: torch.Tensor) -> torch.Tensor:
        return w.reshape(*w.shape[:-1], w.shape[-1] // self.group_size, self.group_size)  # [.., out, G, g]

    def _codes(self, t: Mapping[str, torch.Tensor], shape) -> torch.Tensor:
        return self._groups(decode_e2m1(unpack_nibbles(t["weight_packed"])))  # [.., out, G, g] float32

    @staticmethod
    def _pick(wg: torch.Tensor, candidates) -> torch.Tensor:
        """Index (int64 [.., out, G]) of the candidate effective scale (each float32 [.., out, G]) with the least
        squared reconstruction error of the group wg [.., out, G, g]; ties keep the earlier candidate."""
        best_err = best = None
        for i, eff in enumerate(candidates):
            e = eff[..., None]
            err = (decode_e2m1(encode_e2m1(wg / e)) * e - wg).square().sum(-1)
            if best is None:
                best_err, best = err, torch.zeros_like(err, dtype=torch.int64)
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best = torch.where(better, i, best)
        return best


@dataclass(frozen=True)
class NvFp4Scheme(_Fp4Scheme):
    """NVFP4A16: weight_packed u8 [.., out, in/2], weight_scale e4m3 [.., out, in/16], weight_global_scale
    f32 [1] ([E, 1] stacked). global = 448*6 / amax(tensor); scale = e4m3(global * amax(group) / 6);
    w = e2m1 * scale / global."""

    group_size: int = 16

    def tensor_specs(self, shape):
        *lead, out, inp = shape
        return {
            "weight_packed": ((*lead, out, inp // 2), torch.uint8),
            "weight_scale": ((*lead, out, inp // self.group_size), torch.float8_e4m3fn),
            "weight_global_scale": ((*lead, 1), torch.float32),
        }

    def _quantize(self, w, global_scale, name):
        if global_scale is None:
            global_scale = nvfp4_global_scale(w)
        g = global_scale.reshape(*global_scale.shape[:-1], 1, 1)  # [.., 1, 1] against [.., out, G]
        wg = self._groups(w)
        amax = wg.abs().amax(dim=-1)  # [.., out, G]
        # Same operation order as calculate_qparams: global * (amax / 6), clamp + round to e4m3, 0 -> eps.
        s = encode_e4m3(g * _div(amax, E2M1_MAX)).float()
        s = torch.where(s == 0, _E4M3_SCALE_EPS, s)
        if self.observer == "mse":  # candidates: the minmax scale (first: it wins ties), then shrunk ones
            cands = [s] + [torch.where(c == 0, _E4M3_SCALE_EPS, c) for c in
                           (encode_e4m3(s * f).float() for f in _MSE_SHRINK)]
            pick = self._pick(wg, [c / g for c in cands])
            s = torch.gather(torch.stack(cands, -1), -1, pick[..., None]).squeeze(-1)
        eff = s / g  # compressed-tensors divides by (scale / global), not multiplies by global / scale
        codes = encode_e2m1(wg / eff[..., None]).reshape(w.shape)
        return {
            "weight_packed": pack_nibbles(codes),
            "weight_scale": s.to(torch.float8_e4m3fn),
            "weight_global_scale": global_scale,
        }

    def _dequantize(self, t, shape):
        g = t["weight_global_scale"].float()
        eff = t["weight_scale"].float() / g.reshape(*g.shape[:-1], 1, 1)  # [.., out, G]
        return (self._codes(t, shape) * eff[..., None]).reshape(shape)


@dataclass(frozen=True)
class MxFp4Scheme(_Fp4Scheme):
    """MXFP4A16: weight_packed u8 [.., out, in/2], weight_scale u8 E8M0 [.., out, in/32]; w = e2m1 * 2^(e-127).

    The shared exponent is compressed-tensors' (codecs.e8m0_from_amax), not the OCP spec's plain
    floor(log2(amax)) - 2: it rounds amax up to the next power of two when amax >= 1.75 * 2^k, so fewer
    group maxima saturate at 6.
    """

    group_size: int = 32

    def tensor_specs(self, shape):
        *lead, out, inp = shape
        return {
            "weight_packed": ((*lead, out, inp // 2), torch.uint8),
            "weight_scale": ((*lead, out, inp // self.group_size), torch.uint8),
        }

    def _quantize(self, w, global_scale, name):
        wg = self._groups(w)
        e = e8m0_from_amax(wg.abs().amax(dim=-1))  # [.., out, G] int32
        if bool((e == 255).any()):
            raise NotQuantizable(name, self.name, "a group amax >= 1.75 * 2^127 has no finite E8M0 scale")
        if self.observer == "mse":  # the minmax exponent (first: it wins ties) or one below it
            lower = torch.clamp(e - 1, min=0)
            pick = self._pick(wg, [decode_e8m0(e.to(torch.uint8)), decode_e8m0(lower.to(torch.uint8))])
            e = torch.where(pick == 1, lower, e)
        e = e.to(torch.uint8)
        codes = encode_e2m1(wg / decode_e8m0(e)[..., None]).reshape(w.shape)
        return {"weight_packed": pack_nibbles(codes), "weight_scale": e}

    def _dequantize(self, t, shape):
        return (self._codes(t, shape) * decode_e8m0(t["weight_scale"])[..., None]).reshape(shape)


FP8 = Fp8ChannelScheme("fp8", "FP8_DYNAMIC", "float-quantized", ("weight", "weight_scale"))
FP8_BLOCK = Fp8BlockScheme("fp8-block", "FP8_BLOCK", "float-quantized", ("weight", "weight_scale"))
NVFP4 = NvFp4Scheme(
    "nvfp4", "NVFP4A16", "nvfp4-pack-quantized", ("weight_packed", "weight_scale", "weight_global_scale")
)
MXFP4 = MxFp4Scheme("mxfp4", "MXFP4A16", "mxfp4-pack-quantized", ("weight_packed", "weight_scale"))

SCHEMES: dict[str, Scheme] = {s.name: s for s in (FP8, FP8_BLOCK, NVFP4, MXFP4)}


def takes_observer(scheme: "str | Scheme") -> bool:
    """Whether `scheme` chooses its scales by an observer (the fp4 schemes); the others are minmax only."""
    return isinstance(get_scheme(scheme), _Fp4Scheme)


def with_observer(scheme: "str | Scheme", observer: str) -> Scheme:
    """The scheme with its scales chosen by `observer` ("minmax" | "mse"; mse: fp4 schemes only)."""
    sch = get_scheme(scheme)
    if observer not in OBSERVERS:
        raise ValueError(f"unknown observer {observer!r}; expected one of {', '.join(OBSERVERS)}")
    if not takes_observer(sch):
        if observer != "minmax":
            raise ValueError(f"observer {observer!r} applies to the fp4 schemes (nvfp4, mxfp4), not {sch.name}: "
                             "an fp8 row or block scale already keeps every value's relative precision")
        return sch
    return dataclasses.replace(sch, observer=observer)


def get_scheme(name: "str | Scheme") -> Scheme:
    if isinstance(name, Scheme):
        return name
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown quantization scheme {name!r}; known schemes: {', '.join(SCHEMES)}") from None


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """One quantized weight. ``tensors`` maps local names (weight / weight_packed / weight_scale /
    weight_global_scale) to exactly what is written to safetensors under ``<module>.<name>``; ``shape``
    and ``dtype`` are the original weight's ([out, in] or [E, out, in])."""

    scheme: str
    tensors: Mapping[str, torch.Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self):
        # Validate against the scheme's declared layout so a bad checkpoint fails here, naming the field.
        sch = get_scheme(self.scheme)
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        specs = sch.tensor_specs(self.shape)
        missing = [n for n in specs if n not in self.tensors]
        extra = [n for n in self.tensors if n not in specs]
        if missing or extra:
            raise ValueError(f"{self.scheme} tensor set mismatch: missing {missing}, unexpected {extra}")
        for n, (shape, dt) in specs.items():
            t = self.tensors[n]
            if tuple(t.shape) != shape or t.dtype != dt:
                raise ValueError(
                    f"{self.scheme} tensor {n!r}: expected {tuple(shape)} {dt}, got {tuple(t.shape)} {t.dtype}"
                )

    @property
    def num_experts(self) -> int | None:
        return self.shape[0] if len(self.shape) == 3 else None

    @property
    def nbytes(self) -> int:
        """Bytes streamed per full read: codes + scales (what a bandwidth number must count)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """-> [out, in] / [E, out, in] in dtype; computed in float32 and rounded once at the end, which is
        also what compressed-tensors' decompress does (its bf16 nvfp4/mxfp4 outputs match ours bit for bit)."""
        return get_scheme(self.scheme)._dequantize(self.tensors, self.shape).to(dtype)

    def narrow(self, dim: int, start: int, length: int, what: str = "weight") -> "QuantizedTensor":
        """The codes of weight[..., start:start + length, ...] along `dim` (0 = out rows, 1 = in columns of an
        [out, in] weight; negative counts from the end), without dequantizing: codes, packed nibbles and scales
        are cut at their own granularity (2 codes per byte, a scale per 16 / 32 columns or per 128 x 128 block).
        A cut inside a scale group cannot be expressed: ConfigError naming `what` (tensor parallelism asks)."""
        from kie_moe.models.errors import ConfigError
        dim = dim % len(self.shape)
        n = self.shape[dim]
        if not (0 <= start and length > 0 and start + length <= n):
            raise ConfigError(f"{what}: slice [{start}, {start + length}) outside its {n} along dim {dim}")
        new_shape = tuple(length if i == dim else d for i, d in enumerate(self.shape))
        sch = get_scheme(self.scheme)
        old_specs, new_specs = sch.tensor_specs(self.shape), sch.tensor_specs(new_shape)
        out = {}
        for name, t in self.tensors.items():
            so, sn = old_specs[name][0], new_specs[name][0]
            axes = [k for k in range(len(so)) if so[k] != sn[k]]
            if not axes:                      # not laid out along dim (per-row scale when cutting columns, ...)
                out[name] = t
                continue
            k = axes[0]
            unit = next((u for u in (1, 2, 16, 32, 64, 128) if -(-n // u) == so[k] and -(-length // u) == sn[k]), None)
            if unit is None or start % unit or (length % unit and start + length != n):
                raise ConfigError(f"{what}: a {self.scheme} weight of shape {self.shape} cannot be cut at "
                                  f"[{start}, {start + length}) along dim {dim}: its {name!r} holds one entry per "
                                  f"{unit or '?'} of them")
            out[name] = t.narrow(k, start // unit, sn[k])
        return QuantizedTensor(self.scheme, out, new_shape, self.dtype)

    def unstack(self) -> list["QuantizedTensor"]:
        """Stacked [E, out, in] -> E QuantizedTensors of [out, in] (views, no copy)."""
        if len(self.shape) != 3:
            raise ValueError(f"unstack needs a 3-D [E, out, in] QuantizedTensor, this one is {self.shape}")
        return [
            QuantizedTensor(self.scheme, {n: t[e] for n, t in self.tensors.items()}, self.shape[1:], self.dtype)
            for e in range(self.shape[0])
        ]

    def named(self, prefix: str) -> dict[str, torch.Tensor]:
        """{"<prefix>.<local name>": tensor}, ready for safetensors (contiguous)."""
        return {f"{prefix}.{n}": t.contiguous() for n, t in self.tensors.items()}

    def to(self, device: "torch.device | str") -> "QuantizedTensor":
        return QuantizedTensor(self.scheme, {n: t.to(device) for n, t in self.tensors.items()}, self.shape, self.dtype)


def _check_values(w: torch.Tensor, name: str) -> None:
    if not torch.is_floating_point(w):
        raise ValueError(f"{name}: expected a floating-point weight, got {w.dtype}")
    if not bool(torch.isfinite(w).all()):
        n_nan = int(torch.isnan(w).sum())
        n_inf = int(torch.isinf(w).sum())
        raise ValueError(f"{name}: weight has {n_nan} NaN and {n_inf} Inf values; refusing to quantize")


def _amax_per_slice(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [1]; [E, out, in] -> [E, 1] (float32)."""
    w = w.float()
    if w.ndim == 2:
        return w.abs().amax().reshape(1)
    return w.abs().amax(dim=(-2, -1)).reshape(w.shape[0], 1)


def _global_from_amax(amax: torch.Tensor) -> torch.Tensor:
    # generate_gparam: clamp amax to the smallest normal so an all-zero tensor gives inf -> 1.0.
    amax = torch.clamp(amax, min=torch.finfo(torch.float32).tiny)
    g = _NVFP4_GLOBAL_NUMERATOR / amax
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32)


def nvfp4_global_scale(weight: torch.Tensor) -> torch.Tensor:
    """448*6 / amax: f32 [1] for [out, in], [E, 1] for [E, out, in] (one per expert)."""
    return _global_from_amax(_amax_per_slice(weight))


def shared_global_scale(weights: Sequence[torch.Tensor], names: Sequence[str] | None = None) -> torch.Tensor:
    """One nvfp4 global scale for fused partners (gate/up, q/k/v): 448*6 / max of their amaxes.

    vLLM fuses partners into one tensor and keeps only one global scale (its MoE loader takes w1's), so
    partners quantized with different globals would be dequantized wrongly. 2-D inputs -> [1]; stacked
    [E, out, in] inputs (same E) -> [E, 1], shared across partners per expert.
    """
    if not weights:
        raise ValueError("shared_global_scale needs at least one weight")
    names = list(names) if names is not None else [f"weights[{i}]" for i in range(len(weights))]
    ndims = {w.ndim for w in weights}
    if len(ndims) != 1 or next(iter(ndims)) not in (2, 3):
        raise ValueError(f"fused partners must all be 2-D or all be 3-D: {[tuple(w.shape) for w in weights]}")
    if ndims == {3} and len({w.shape[0] for w in weights}) != 1:
        raise ValueError(f"fused 3-D partners must have the same number of experts: {[tuple(w.shape) for w in weights]}")
    for w, n in zip(weights, names):
        _check_values(w, n)
    amax = torch.stack([_amax_per_slice(w) for w in weights]).amax(dim=0)
    return _global_from_amax(amax)


def _as_global(global_scale, shape: tuple[int, ...], device, name: str) -> torch.Tensor:
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=device)
    want = (1,) if len(shape) == 2 else (shape[0], 1)
    if g.numel() == 1:
        g = g.reshape(1).expand(want[0]).reshape(want).contiguous()
    elif g.numel() == want[0] and len(shape) == 3:
        g = g.reshape(want)
    else:
        raise ValueError(f"{name}: global_scale of shape {tuple(g.shape)} does not fit weight shape {shape}")
    if not bool((torch.isfinite(g) & (g > 0)).all()):
        raise ValueError(f"{name}: global_scale must be finite and > 0, got {g.flatten().tolist()[:8]}")
    return g


def quantize(
    weight: torch.Tensor,
    scheme: "str | Scheme",
    global_scale: "torch.Tensor | float | None" = None,
    *,
    name: str = "weight",
) -> QuantizedTensor:
    """Quantize a [out, in] or stacked [E, out, in] weight.

    global_scale (nvfp4 only): from shared_global_scale() for fused partners; a scalar / [1] is used for
    every expert of a stacked weight, [E] / [E, 1] per expert; None computes the weight's own.
    Raises NotQuantizable for shapes the format cannot hold, ValueError for NaN/Inf or a bad global scale.
    """
    sch = get_scheme(scheme)
    shape = tuple(weight.shape)
    sch.check(shape, name)
    _check_values(weight, name)
    if global_scale is not None:
        if not isinstance(sch, NvFp4Scheme):
            raise ValueError(f"{name}: global_scale only applies to nvfp4, not {sch.name}")
        global_scale = _as_global(global_scale, shape, weight.device, name)
    # contiguous: a transposed view (gpt-oss experts are stored [in, out]) would give codes with its strides
    tensors = sch._quantize(weight.to(torch.float32).contiguous(), global_scale, name)
    return QuantizedTensor(sch.name, tensors, shape, weight.dtype)
