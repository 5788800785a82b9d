"""QuantizedTensor.narrow (tensor-parallel shards of quantized checkpoints): cutting codes + scales must equal
cutting the dequantized weight (whose decode matches compressed-tensors' decompressors: tests/quant), and a cut
inside a scale group must be refused with the tensor named."""
import pytest
import torch

from kie_moe.models.errors import ConfigError
from kie_moe.quant.schemes import quantize

CUTS = {  # scheme: (dim, start, length) that are whole groups / blocks
    "fp8": [(0, 3, 5), (1, 7, 90)],
    "fp8-block": [(0, 128, 64), (1, 0, 128), (1, 128, 128)],   # the last block of rows / columns may be short
    "nvfp4": [(0, 1, 7), (1, 16, 32), (1, 224, 32)],
    "mxfp4": [(0, 5, 11), (1, 32, 64), (1, 192, 64)],
}


@pytest.mark.parametrize("scheme", list(CUTS))
def test_narrow_equals_the_dequantized_slice(scheme):
    w = torch.randn(192, 256, generator=torch.Generator().manual_seed(0))
    q = quantize(w, scheme)
    full = q.dequantize()
    for dim, start, length in CUTS[scheme]:
        part = q.narrow(dim, start, length)
        assert part.shape[dim] == length
        torch.testing.assert_close(part.dequantize(), full.narrow(dim, start, length), rtol=0, atol=0)


@pytest.mark.parametrize("scheme,dim,start,length", [("nvfp4", 1, 8, 16), ("mxfp4", 1, 32, 48),
                                                     ("fp8-block", 0, 64, 64), ("fp8", 0, 190, 5)])
def test_narrow_refuses_a_cut_inside_a_group(scheme, dim, start, length):
    q = quantize(torch.randn(192, 256), scheme)
    with pytest.raises(ConfigError, match="layers.0.attn.o"):
        q.narrow(dim, start, length, what="layers.0.attn.o")
