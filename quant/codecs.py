"""Element codecs: e4m3 (FP8), e2m1 (FP4) and e8m0 (MX shared exponent).

Pure torch, vectorised, device-agnostic (CPU and CUDA). Every rounding rule here is chosen to give the
same bits as compressed-tensors 0.20 (our oracle, see DESIGN.md section 4), so a checkpoint we write is
indistinguishable from one llm-compressor writes with the same scales:

- e4m3: clamp to +-448, then one round-to-nearest-even cast (``round_to_quantized_type_args``).
- e2m1: compressed-tensors' ``cast_to_fp4`` thresholds (round half to even on the e2m1 grid); the sign
  nibble bit is set for every strictly negative input, including the ones that round to zero (it packs
  ``-0.0``), and clear for ``-0.0`` itself (``torch.sign(-0.0) == 0``).
- e8m0: ``generate_mx_scales``: round the group amax to a power of two (up when its two top mantissa bits
  are both set, i.e. amax >= 1.75 * 2^k), subtract floor(log2(6)) = 2, bias 127, clamp to [0, 255].
"""

from __future__ import annotations

import torch

__all__ = [
    "E4M3_MAX",
    "E2M1_MAX",
    "E2M1_VALUES",
    "encode_e4m3",
    "decode_e4m3",
    "encode_e2m1",
    "decode_e2m1",
    "pack_nibbles",
    "unpack_nibbles",
    "e8m0_from_amax",
    "encode_e8m0",
    "decode_e8m0",
]

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max; e4m3fn has no inf, so saturate rather than NaN
E2M1_MAX = 6.0
# e2m1 magnitudes, indexed by the low three bits of a nibble; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127
_MX_FP4_EXP_OFFSET = 2  # floor(log2(E2M1_MAX)): maps the group amax into [4, 8) * 2^(e-127) before clamping


def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x (any float dtype, already divided by its scale) -> torch.float8_e4m3fn, saturating at +-448.

    The clamp matters on CUDA, where an out-of-range cast gives NaN (e4m3fn has no inf).
    """
    return torch.clamp(x, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def decode_e4m3(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch.float8_e4m3fn (or uint8 bytes of it) -> dtype; exact for float32/bfloat16/float16."""
    if x.dtype == torch.uint8:
        x = x.view(torch.float8_e4m3fn)
    return x.to(dtype)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """x (already divided by its scale) -> uint8 nibble codes in [0, 16), one per element (not packed).

    code = sign << 3 | index into E2M1_VALUES. The comparisons below reproduce compressed-tensors'
    ``cast_to_fp4`` exactly: ties go to the even e2m1 mantissa (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
    1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4) and everything above 5 saturates to 6.
    """
    a = x.abs()
    # Count the thresholds a lies above; strict vs non-strict follows the tie direction of each midpoint.
    idx = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    return idx | ((x < 0).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 nibble codes in [0, 16) -> values in dtype (a 16-entry lookup; -0.0 for code 8)."""
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype, device=codes.device)
    return lut[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] (n even) -> uint8 [..., n/2]; element 2k in the low nibble of byte k."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dimension, got shape {tuple(codes.shape)}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)  # [..., n/2, (low, high)]
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m] -> uint8 codes [..., 2m] (inverse of pack_nibbles)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_nibbles needs uint8 input, got {packed.dtype}")
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1)  # [..., m, 2]
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e8m0_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Per-group amax (any float dtype, >= 0, finite) -> E8M0 exponent codes as int32 in [0, 255].

    Bit-exact port of compressed-tensors' ``generate_mx_scales`` for 4-bit elements: add a quarter of the
    mantissa range and truncate the mantissa (round up to the next power of two when amax >= 1.75 * 2^k),
    then e = 127 + log2(that power of two) - 2. A zero group gives log2(0) = -inf there, clamped to 0;
    here its exponent field is 0, giving the same code. Field 255 means the rounding overflowed f32 (amax
    >= 1.75 * 2^127): compressed-tensors clamps that to 255 (NaN in OCP MX); callers must reject it.
    The result does not depend on whether amax arrives as bf16 or f32: bf16 -> f32 is exact and the
    rounding only looks at the top two mantissa bits.
    """
    bits = amax.to(torch.float32).view(torch.int32)
    rounded = (bits + (1 << 21)) & 0x7F800000  # 23-bit mantissa: 1 << (23 - 1 - 1) pushes m >= .75 up
    field = rounded >> 23  # biased f32 exponent of the rounded power of two (0 for zero / subnormal amax)
    return torch.where(field == 255, field, torch.clamp(field - _MX_FP4_EXP_OFFSET, 0, 255))


def encode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two float scale -> uint8 exponent code (compressed-tensors' ``compress_mx_scale``)."""
    return (E8M0_BIAS + torch.floor(torch.log2(scale.float())).to(torch.int32)).to(torch.uint8)


def decode_e8m0(code: torch.Tensor) -> torch.Tensor:
    """uint8 exponent code -> float32 scale 2^(e-127), built from bits so it is exact (2^-127 is an f32
    subnormal). Code 255 is NaN, as in the OCP MX spec."""
    e = code.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)  # e = 0: subnormal 2^-127
    bits = torch.where(e == 255, torch.full_like(e, 0x7FC00000), bits)
    return bits.view(torch.float32)
