"""Weight handles for the decode kernels: one Linear (or a stack of experts) in any format of DESIGN.md §4.

A handle names its format and holds the tensors exactly as compressed-tensors lays them out, so kernels read the
checkpoint bytes as loaded (no repacking):

| fmt       | weight                        | scale                                    | global_scale |
| --------- | ----------------------------- | ---------------------------------------- | ------------ |
| bf16/fp16 | [.., out, in] float           | -                                        | -            |
| fp8       | [.., out, in] e4m3            | [.., out, 1] (per row; stride 0 = tensor) | -            |
| fp8_block | [.., out, in] e4m3            | [.., ceil(out/128), ceil(in/128)]        | -            |
| nvfp4     | [.., out, in/2] u8 (2 x e2m1) | [.., out, in/16] e4m3                    | [..] f32     |
| mxfp4     | [.., out, in/2] u8 (2 x e2m1) | [.., out, in/32] u8 E8M0                 | -            |

".." is an optional leading expert axis E (stacked experts). Element 2k of a row sits in the LOW nibble of byte k;
nibble = sign << 3 | index into E2M1_VALUES. The one exception to "as loaded": `packing="mma"`, an nvfp4 / mxfp4
Linear or expert stack re-laid once for the tensor-core kernels' cheaper decode (kernels/fp4_mma.pack_for_mma: byte k
holds element 2k as s 0 0 0 e1 e0 m 0 and element 2k+1's e1 e0 m at bits 6..4, its sign at bit 0); only those
kernels (the tensor-core GEMV, the tensor-core routed experts) and `dequantize` read it.
nvfp4: w = e2m1 * scale / global; mxfp4: w = e2m1 * 2^(e - 127);
fp8-block (and native `weight_scale_inv`): w = e4m3 * scale of its 128x128 block.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

import torch

__all__ = ["WeightHandle", "FORMATS", "E2M1_VALUES", "FP8_BLOCK", "dequantize", "random_weight", "mma_bytes",
           "checkpoint_bytes"]

FORMATS = ("bf16", "fp16", "fp32", "fp8", "fp8_block", "nvfp4", "mxfp4")
FP8_BLOCK = 128  # block_structure [128, 128] of compressed-tensors FP8_BLOCK
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FLOAT_FMT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_GROUP = {"nvfp4": 16, "mxfp4": 32}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class WeightHandle:
    """One Linear's weight [out, in] (or a stack [E, out, in]) in one format, tensors as compressed-tensors stores
    them (views allowed: rows need stride 1 along in)."""

    fmt: str
    weight: torch.Tensor
    scale: torch.Tensor | None
    global_scale: torch.Tensor | None
    out_features: int
    in_features: int
    packing: str = "checkpoint"  # or "mma" (module docstring)

    # ---- construction -------------------------------------------------------------------------------------------
    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"WeightHandle: unknown format {self.fmt!r}; expected one of {FORMATS}")
        self._check()

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> "WeightHandle":
        """A bf16 / fp16 / fp32 weight [out, in] or expert stack [E, out, in]."""
        if weight.dtype not in _FLOAT_FMT:
            raise TypeError(f"WeightHandle.from_dense: weight dtype {weight.dtype} is not bf16/fp16/fp32")
        return cls(_FLOAT_FMT[weight.dtype], weight, None, None, weight.shape[-2], weight.shape[-1])

    @classmethod
    def from_compressed(cls, tensors: Mapping[str, torch.Tensor], in_features: int | None = None) -> "WeightHandle":
        """From a Linear's compressed-tensors dict: {weight | weight_packed, weight_scale | weight_scale_inv,
        weight_global_scale}. The format is read off the names and dtypes (native FP8-block checkpoints name their
        scale `weight_scale_inv`; it multiplies like weight_scale)."""
        if "weight_packed" in tensors:
            packed = tensors["weight_packed"]
            scale = tensors.get("weight_scale")
            if scale is None:
                raise KeyError("WeightHandle.from_compressed: 'weight_packed' without 'weight_scale'")
            if packed.dtype != torch.uint8:
                raise TypeError(f"WeightHandle.from_compressed: weight_packed dtype {packed.dtype}, expected uint8")
            out, in_ = packed.shape[-2], in_features or 2 * packed.shape[-1]
            if "weight_global_scale" in tensors:
                if scale.dtype == torch.uint8:  # raw e4m3 bits, as some writers store them
                    scale = scale.view(torch.float8_e4m3fn)
                gs = tensors["weight_global_scale"]
                return cls("nvfp4", packed, scale, gs, out, in_)
            if scale.dtype != torch.uint8:
                raise TypeError(
                    f"WeightHandle.from_compressed: weight_scale dtype {scale.dtype} without weight_global_scale: "
                    "expected uint8 E8M0 (mxfp4) or a weight_global_scale (nvfp4)")
            return cls("mxfp4", packed, scale, None, out, in_)
        if "weight" not in tensors:
            raise KeyError(f"WeightHandle.from_compressed: no 'weight' or 'weight_packed' among {sorted(tensors)}")
        w = tensors["weight"]
        if w.dtype in _FLOAT_FMT:
            return cls.from_dense(w)
        if w.dtype != torch.float8_e4m3fn:
            raise TypeError(f"WeightHandle.from_compressed: weight dtype {w.dtype} is not float or float8_e4m3fn")
        scale = tensors.get("weight_scale", tensors.get("weight_scale_inv"))
        if scale is None:
            raise KeyError("WeightHandle.from_compressed: fp8 'weight' without 'weight_scale'/'weight_scale_inv'")
        out, in_ = w.shape[-2], w.shape[-1]
        lead = tuple(w.shape[:-2])
        if scale.numel() == 1 * max(1, _prod(lead)):  # per-tensor: a per-row view with row stride 0
            scale = scale.reshape(*lead, 1, 1).expand(*lead, out, 1)
        if tuple(scale.shape[-2:]) == (out, 1):
            return cls("fp8", w, scale, None, out, in_)
        if tuple(scale.shape[-2:]) == (_cdiv(out, FP8_BLOCK), _cdiv(in_, FP8_BLOCK)):
            return cls("fp8_block", w, scale, None, out, in_)
        raise ValueError(f"WeightHandle.from_compressed: fp8 weight_scale shape {tuple(scale.shape)} is neither "
                         f"per-row [{out}, 1] nor 128x128-block [{_cdiv(out, FP8_BLOCK)}, {_cdiv(in_, FP8_BLOCK)}]")

    @classmethod
    def from_gpt_oss_mxfp4(cls, blocks: torch.Tensor, scales: torch.Tensor) -> "WeightHandle":
        """gpt-oss native experts: `*_blocks` u8 [E, out, in/32, 16] and `*_scales` u8 [E, out, in/32] (same nibble
        order and E8M0 bias as mxfp4-pack-quantized, so this is a free reshape)."""
        if blocks.dim() < 3 or blocks.shape[-1] != 16:
            raise ValueError(f"from_gpt_oss_mxfp4: blocks shape {tuple(blocks.shape)}, expected [.., out, in/32, 16]")
        packed = blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * 16)
        return cls("mxfp4", packed, scales, None, packed.shape[-2], 2 * packed.shape[-1])

    @classmethod
    def stack(cls, handles: list["WeightHandle"]) -> "WeightHandle":
        """Stack per-expert handles (same format and shape) into one [E, out, in] handle."""
        h0 = handles[0]
        for i, h in enumerate(handles):
            if h.packing != "checkpoint":
                raise ValueError(f"WeightHandle.stack: expert {i} is in packing {h.packing!r}; stack checkpoint "
                                 f"bytes, then pack the stack (fp4_mma.pack_for_mma)")
            if (h.fmt, h.out_features, h.in_features) != (h0.fmt, h0.out_features, h0.in_features):
                raise ValueError(f"WeightHandle.stack: expert {i} is {h.fmt} [{h.out_features}, {h.in_features}], "
                                 f"expert 0 is {h0.fmt} [{h0.out_features}, {h0.in_features}]")

        def st(ts):
            return None if ts[0] is None else torch.stack([t.contiguous() for t in ts])

        gs = st([h.global_scale.reshape(()) if h.global_scale is not None else None for h in handles])
        return cls(h0.fmt, st([h.weight for h in handles]), st([h.scale for h in handles]), gs,
                   h0.out_features, h0.in_features)

    # ---- views --------------------------------------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        """E for a stacked handle, 0 for a plain Linear."""
        return self.weight.shape[0] if self.weight.dim() == 3 else 0

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def nbytes(self) -> int:
        """Bytes one full read of this weight costs in HBM: weight + scales (what bandwidth numbers count)."""
        n = self.weight.numel() * self.weight.element_size()
        if self.scale is not None:
            n += _prod(self.scale.shape) * self.scale.element_size() if self.scale.stride(-2) != 0 else 0
        if self.global_scale is not None:
            n += self.global_scale.numel() * self.global_scale.element_size()
        return n

    def expert(self, e: int) -> "WeightHandle":
        """Expert e of a stacked handle, as a plain handle (views, no copy)."""
        if not self.num_experts:
            raise ValueError("WeightHandle.expert: handle is not stacked")
        return dataclasses.replace(self, weight=self.weight[e], scale=None if self.scale is None else self.scale[e],
                                   global_scale=None if self.global_scale is None else self.global_scale[e])

    def rows(self, start: int, stop: int | None = None, step: int = 1) -> "WeightHandle":
        """Output rows start:stop:step as a view: e.g. gpt-oss interleaved gate_up -> gate = rows(0, None, 2),
        up = rows(1, None, 2); a fused [2I, H] gate_up -> rows(0, I) and rows(I). Kernels take row strides, so a
        strided view costs nothing. fp8_block views must start on a 128-row block and keep step 1."""
        stop = self.out_features if stop is None else stop
        n = len(range(start, stop, step))
        if n <= 0:
            raise ValueError(f"WeightHandle.rows: empty range {start}:{stop}:{step} of {self.out_features} rows")
        w = self.weight[..., start:stop:step, :]
        if self.fmt == "fp8_block":
            if step != 1 or start % FP8_BLOCK:
                raise ValueError(f"WeightHandle.rows: fp8_block view {start}:{stop}:{step} does not start on a "
                                 f"{FP8_BLOCK}-row block with step 1 (its scales could not follow)")
            s = self.scale[..., start // FP8_BLOCK: _cdiv(stop, FP8_BLOCK), :]
        else:
            s = None if self.scale is None else self.scale[..., start:stop:step, :]
        return dataclasses.replace(self, weight=w, scale=s, out_features=n)

    # ---- validation ---------------------------------------------------------------------------------------------
    def _check(self):
        w, s, out, in_ = self.weight, self.scale, self.out_features, self.in_features
        name = f"WeightHandle[{self.fmt}]"
        if w.dim() not in (2, 3):
            raise ValueError(f"{name}: weight must be [out, in] or [E, out, in], got {tuple(w.shape)}")
        if w.stride(-1) != 1:
            raise ValueError(f"{name}: weight rows must be contiguous (stride(-1) == 1), got strides {w.stride()}")
        lead = tuple(w.shape[:-2])
        if self.fmt not in _GROUP and self.packing != "checkpoint":
            raise ValueError(f"{name}: packing {self.packing!r} applies to nvfp4 / mxfp4 only")
        if self.fmt in ("bf16", "fp16", "fp32"):
            want = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.fmt]
            _expect(name, "weight", w, want, (*lead, out, in_))
            return
        if self.fmt in ("fp8", "fp8_block"):
            _expect(name, "weight", w, torch.float8_e4m3fn, (*lead, out, in_))
            if s is None or s.dim() != w.dim():
                raise ValueError(f"{name}: weight_scale missing or of another rank than the weight "
                                 f"({None if s is None else s.dim()})")
            want_s = (*lead, out, 1) if self.fmt == "fp8" else (*lead, _cdiv(out, FP8_BLOCK), _cdiv(in_, FP8_BLOCK))
            _expect(name, "weight_scale", s, None, want_s)
            return
        g = _GROUP[self.fmt]
        if self.packing not in ("checkpoint", "mma") or (self.packing == "mma" and len(lead) > 1):
            raise ValueError(f"{name}: packing {self.packing!r}: 'checkpoint', or 'mma' for a plain Linear or one "
                             f"expert stack")
        if in_ % g:
            raise ValueError(f"{name}: in_features {in_} is not a multiple of the group size {g}")
        _expect(name, "weight_packed", w, torch.uint8, (*lead, out, in_ // 2))
        if w.stride(-2) % 4 or w.data_ptr() % 4:
            raise ValueError(f"{name}: weight_packed rows must start on 4-byte words (the kernels read u32 words), "
                             f"got row stride {w.stride(-2)} B at offset {w.data_ptr() % 4}")
        sdt = torch.float8_e4m3fn if self.fmt == "nvfp4" else torch.uint8
        if s is None:
            raise ValueError(f"{name}: weight_scale missing")
        _expect(name, "weight_scale", s, sdt, (*lead, out, in_ // g))
        if self.fmt == "nvfp4":
            gs = self.global_scale
            if gs is None or gs.numel() != max(1, _prod(lead)):
                raise ValueError(f"{name}: weight_global_scale must have one value per Linear "
                                 f"({max(1, _prod(lead))}), got {None if gs is None else tuple(gs.shape)}")


def stored_codes(store, name: str):
    """The raw quantized tensors (quant.schemes.QuantizedTensor) of canonical weight `name` when `store` holds it
    quantized: a quantized checkpoint (quant/ingest) or a store that quantizes on request (benchmarks'
    QuantizingStore); None for a float weight. Both GPU backends stream these codes instead of dequantizing."""
    if hasattr(store, "quantized_tensor"):          # stores that quantize on the fly (benchmarks)
        return store.quantized_tensor(name)
    from kie_moe.quant.ingest import quantized
    try:
        return quantized(store, name)
    except (KeyError, TypeError, ValueError):
        return None


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _expect(owner: str, what: str, t: torch.Tensor, dtype, shape):
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{owner}: {what} dtype {t.dtype}, expected {dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{owner}: {what} shape {tuple(t.shape)}, expected {tuple(shape)}")


# ---- torch reference dequantization (independent of the kernels' bit tricks: lookup tables, exp2) -----------------
def mma_bytes(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint e2m1 bytes -> packing "mma" (module docstring): element 2k (low nibble) to s 0 0 0 e1 e0 m 0,
    element 2k+1 (high nibble) to e1 e0 m at bits 6..4 and s at bit 0."""
    lo, hi = packed & 0x0F, packed >> 4
    return ((lo & 8) << 4) | ((lo & 7) << 1) | ((hi & 7) << 4) | ((hi & 8) >> 3)


def checkpoint_bytes(packed: torch.Tensor) -> torch.Tensor:
    """mma_bytes's inverse."""
    return ((packed >> 4) & 0x08) | ((packed >> 1) & 0x07) | (packed & 0x70) | ((packed & 1) << 7)


def _unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """u8 [.., out, in/2] -> fp32 [.., out, in]; element 2k from the low nibble of byte k."""
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=packed.device)
    lo = lut[(packed & 0x0F).long()]
    hi = lut[(packed >> 4).long()]
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def dequantize(w: WeightHandle) -> torch.Tensor:
    """fp32 [.., out, in] weight of a handle, with torch ops (the oracle the kernels are tested against)."""
    if w.fmt in ("bf16", "fp16", "fp32"):
        return w.weight.float()
    if w.fmt == "fp8":
        return w.weight.float() * w.scale.float()
    if w.fmt == "fp8_block":
        s = w.scale.float().repeat_interleave(FP8_BLOCK, -2).repeat_interleave(FP8_BLOCK, -1)
        return w.weight.float() * s[..., : w.out_features, : w.in_features]
    q = _unpack_e2m1(checkpoint_bytes(w.weight) if w.packing == "mma" else w.weight)
    if w.fmt == "nvfp4":
        gs = w.global_scale.float().reshape(*w.weight.shape[:-2], 1, 1)
        return q * w.scale.float().repeat_interleave(16, -1) / gs
    return q * torch.exp2(w.scale.float() - 127.0).repeat_interleave(32, -1)


def random_weight(fmt: str, out: int, in_: int, *, experts: int = 0, device="cpu", seed: int = 0,
                  std: float | None = None) -> WeightHandle:
    """Random weights in `fmt` with realistic magnitudes (|w| ~ std, default 1/sqrt(in)), made directly as codes +
    scales (no quantizer needed): for kernel tests and benchmarks. Never all zeros: benchmarks must not stream zeros."""
    g = torch.Generator(device=device).manual_seed(seed)
    lead = (experts,) if experts else ()
    std = std or in_ ** -0.5

    def randn(*shape):
        return torch.randn(*lead, *shape, generator=g, device=device)

    def rand(*shape):
        return torch.rand(*lead, *shape, generator=g, device=device)

    if fmt in ("bf16", "fp16", "fp32"):
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[fmt]
        return WeightHandle.from_dense((randn(out, in_) * std).to(dt))
    if fmt in ("fp8", "fp8_block"):
        w = (randn(out, in_) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        sshape = (out, 1) if fmt == "fp8" else (_cdiv(out, FP8_BLOCK), _cdiv(in_, FP8_BLOCK))
        scale = (0.5 + rand(*sshape)) * (std / 64)
        return WeightHandle(fmt, w, scale, None, out, in_)
    packed = torch.randint(0, 256, (*lead, out, in_ // 2), dtype=torch.uint8, generator=g, device=device)
    if fmt == "nvfp4":
        gs = (1000.0 + 100 * rand(1)).reshape(*lead) if experts else 1000.0 + 100 * rand(1)
        # w = e2m1 (|.| ~ 2.5) * scale / global ~ std
        scale = ((0.5 + rand(out, in_ // 16)) * std / 2.5 * 1000.0).clamp(max=448).to(torch.float8_e4m3fn)
        return WeightHandle("nvfp4", packed, scale, gs.float(), out, in_)
    if fmt == "mxfp4":
        e0 = 127 + int(round(torch.log2(torch.tensor(std / 2.5)).item()))
        e = torch.randint(e0 - 2, e0 + 2, (*lead, out, in_ // 32), generator=g, device=device).to(torch.uint8)
        return WeightHandle("mxfp4", packed, e, None, out, in_)
    raise ValueError(f"random_weight: unknown format {fmt!r}")
