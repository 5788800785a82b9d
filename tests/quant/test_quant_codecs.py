"""Codecs against compressed-tensors' own element routines (the oracle), incl. every rounding tie."""

import pytest
import torch
from compressed_tensors.compressors.mx_utils import compress_mx_scale, decompress_mx_scale
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.quant_args import round_to_quantized_type_args
from compressed_tensors.quantization.utils import calculate_range
from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4
from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

from kie_moe.quant import (
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    e8m0_from_amax,
    encode_e2m1,
    encode_e4m3,
    encode_e8m0,
    pack_nibbles,
    unpack_nibbles,
)

# Every e2m1 midpoint (the ties), the grid points themselves, values just around them, +-0 and saturation.
_MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _fp4_probe() -> torch.Tensor:
    base = torch.tensor(_MIDPOINTS + _GRID + [6.5, 100.0, 1e-9, 0.2499, 0.2501])
    nudged = torch.cat([base, torch.nextafter(base, torch.full_like(base, 1e9)), torch.nextafter(base, torch.zeros_like(base))])
    rand = torch.rand(4000, generator=torch.Generator().manual_seed(0)) * 7.0
    x = torch.cat([nudged, rand])
    return torch.cat([x, -x, torch.tensor([-0.0, 0.0])])


def test_e2m1_codes_match_compressed_tensors_cast_and_pack():
    x = _fp4_probe()
    x = x[: x.numel() // 2 * 2]
    ours = encode_e2m1(x)
    ct_vals = cast_to_fp4(x.clone())  # nearest e2m1 value, with compressed-tensors' tie rules
    assert torch.equal(decode_e2m1(ours).abs(), ct_vals.abs())
    # Packed bytes bit for bit, incl. the sign nibble of negatives that round to 0 (CT packs -0.0).
    ct_packed = pack_fp4_to_uint8(ct_vals.reshape(1, -1))
    assert torch.equal(pack_nibbles(ours.reshape(1, -1)), ct_packed)


def test_e2m1_tie_direction_is_round_half_even():
    x = torch.tensor(_MIDPOINTS)
    assert decode_e2m1(encode_e2m1(x)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert encode_e2m1(torch.tensor([-0.1, -0.0, 0.0])).tolist() == [8, 0, 0]


def test_nibble_order_low_first_and_unpack_matches_compressed_tensors():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    assert pack_nibbles(codes).tolist() == [[0x21, 0x8F]]
    packed = torch.randint(0, 256, (5, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(pack_nibbles(unpack_nibbles(packed)), packed)
    ct = unpack_fp4_from_uint8(packed, 5, 24, dtype=torch.float32)
    assert torch.equal(decode_e2m1(unpack_nibbles(packed)), ct)


def test_pack_nibbles_rejects_odd_length():
    with pytest.raises(ValueError, match="even"):
        pack_nibbles(torch.zeros(3, 5, dtype=torch.uint8))


def test_e4m3_saturates_and_rounds_like_compressed_tensors():
    x = torch.randn(10000, generator=torch.Generator().manual_seed(2)) * 300
    x = torch.cat([x, torch.tensor([448.0, 449.0, 464.0, 1e6, -1e6, -0.0, 2.0**-9, 2.0**-10])])
    q = encode_e4m3(x)
    assert q.dtype == torch.float8_e4m3fn
    args = QuantizationArgs(num_bits=8, type="float", strategy="channel")
    q_min, q_max = calculate_range(args, x.device)
    ref = round_to_quantized_type_args(x, args, q_min, q_max, cast_to_original_dtype=False)
    assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8))
    assert decode_e4m3(q)[-5:-3].tolist() == [448.0, -448.0]
    assert not torch.isnan(decode_e4m3(q)).any()
    assert torch.equal(decode_e4m3(q.view(torch.uint8)), decode_e4m3(q))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_e8m0_exponent_matches_generate_mx_scales(dtype):
    g = torch.Generator().manual_seed(3)
    mant = torch.rand(3000, generator=g) + 1.0
    exps = torch.randint(-140, 120, (3000,), generator=g).float()
    amax = mant * torch.exp2(exps)
    # mantissas exactly at the 1.75 rounding boundary and just below it, powers of two, zero, subnormals
    edge = torch.tensor([1.75, 1.7499999, 1.0, 1.5, 1.9999, 0.0, 2.0**-130, 2.0**-126, 6.0, 7.0, 8.0])
    amax = torch.cat([amax, edge, edge * 1024]).to(dtype)
    ours = e8m0_from_amax(amax)
    ct = torch.clamp(generate_mx_scales(amax, num_bits=4), 0, 255).round().to(torch.int32)
    assert torch.equal(ours, ct)


def test_e8m0_decode_and_encode_roundtrip_against_compressed_tensors():
    codes = torch.arange(0, 255, dtype=torch.uint8)
    scale = decode_e8m0(codes)
    assert scale.dtype == torch.float32 and bool((scale > 0).all())
    assert torch.equal(scale, torch.exp2(codes.double() - 127).float())
    assert torch.equal(decompress_mx_scale(codes).float(), scale)
    assert torch.equal(encode_e8m0(scale), codes)
    assert torch.equal(compress_mx_scale(scale, torch.uint8), codes)
    assert torch.isnan(decode_e8m0(torch.tensor([255], dtype=torch.uint8))).all()
