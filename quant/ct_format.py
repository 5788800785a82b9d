"""Checkpoint formats: compressed-tensors read / write, and ingest of native FP8-block and gpt-oss MXFP4.

compressed-tensors (vLLM and SGLang load it):
- config.json carries ``quantization_config``; we build it from compressed-tensors' own schema objects
  (preset_name_to_scheme -> QuantizationScheme -> QuantizationConfig) so it validates by construction,
  and dump it the way ``ModelCompressor.update_config`` does.
- each quantized Linear ``<prefix>`` stores the tensors of its scheme (schemes.py) as ``<prefix>.<name>``.
- ``ignore`` entries are exact module names or ``re:`` regexes applied with ``re.match`` (a prefix match:
  ``re:.*mlp.gate`` also ignores ``mlp.gate_proj``; anchor with ``$``).

Native checkpoints we read but do not write:
- ``quant_method: fp8`` with ``weight_block_size`` (DeepSeek-V3, Qwen3-*-FP8): e4m3 ``weight`` and f32
  ``weight_scale_inv`` per block; despite the name, w = block * scale_inv.
- gpt-oss MXFP4: ``*_blocks`` u8 [E, out, in/32, 16] and ``*_scales`` u8 [E, out, in/32]. This is
  byte-for-byte compressed-tensors' mxfp4 layout (low nibble first, E8M0 bias 127), so it can be rewritten
  as mxfp4 without requantizing (``gptoss_mxfp4_as_quantized``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from compressed_tensors import __version__ as _CT_VERSION
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    QuantizationStrategy,
    preset_name_to_scheme,
)
from compressed_tensors.utils.match import match_name

from .codecs import decode_e2m1, decode_e8m0, unpack_nibbles
from .schemes import QuantizedTensor, Scheme, get_scheme

__all__ = [
    "ct_scheme",
    "quantization_config",
    "quantization_config_dict",
    "parse_quantization_config",
    "scheme_from_ct",
    "module_scheme",
    "read_quantized",
    "native_fp8_block_size",
    "dequant_fp8_block_native",
    "dequant_gptoss_mxfp4",
    "gptoss_mxfp4_as_quantized",
]

_FP4_FORMATS = {CompressionFormat.nvfp4_pack_quantized.value: "nvfp4", CompressionFormat.mxfp4_pack_quantized.value: "mxfp4"}
_FP8_FORMATS = {CompressionFormat.float_quantized.value, CompressionFormat.naive_quantized.value}


# ----------------------------------------------------------------------------------------------- write


def ct_scheme(scheme: "str | Scheme", targets: Sequence[str] = ("Linear",)) -> QuantizationScheme:
    """compressed-tensors' preset scheme for ours, with its format pinned (so no reader has to infer it)."""
    sch = get_scheme(scheme)
    qs = preset_name_to_scheme(sch.preset, list(targets))
    qs.format = CompressionFormat(sch.format)
    if getattr(sch, "observer", "minmax") != "minmax":  # how the scales were chosen (readers need not know)
        qs.weights.observer = sch.observer
    return qs


def quantization_config(
    scheme: "str | Scheme", ignore: Sequence[str] = (), targets: Sequence[str] = ("Linear",)
) -> QuantizationConfig:
    """One config group (``group_0``) of our scheme over ``targets``, status compressed."""
    sch = get_scheme(scheme)
    return QuantizationConfig(
        config_groups={"group_0": ct_scheme(sch, targets)},
        format=sch.format,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=list(ignore),
    )


def quantization_config_dict(
    scheme: "str | Scheme", ignore: Sequence[str] = (), targets: Sequence[str] = ("Linear",)
) -> dict:
    """The ``quantization_config`` entry of config.json, JSON-serialisable, laid out exactly as
    compressed-tensors' ``ModelCompressor.update_config`` writes it (version, quant_method, empty sparsity /
    transform configs, then the QuantizationConfig fields)."""
    qc = quantization_config(scheme, ignore, targets)
    return {
        "version": _CT_VERSION,
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        **qc.model_dump(mode="json", exclude={"quant_method"}),
    }


# ------------------------------------------------------------------------------------------------ read


def parse_quantization_config(config: Mapping[str, Any]) -> QuantizationConfig:
    """config.json dict, or its ``quantization_config`` entry -> QuantizationConfig (validated)."""
    qc = config.get("quantization_config", config)
    method = qc.get("quant_method", "compressed-tensors")
    if method != "compressed-tensors":
        raise ValueError(f"quantization_config.quant_method is {method!r}, not 'compressed-tensors'")
    return QuantizationConfig.model_validate(dict(qc))


def scheme_from_ct(qs: QuantizationScheme, global_format: str | None = None) -> str:
    """compressed-tensors scheme (+ the config's global format) -> our scheme name, or ValueError naming
    what we do not support. Activation settings are ignored: we run weights-only (A16)."""
    w = qs.weights
    if w is None:
        raise ValueError(f"config group targeting {qs.targets} quantizes no weights")
    fmt = qs.format
    if fmt is None and global_format not in (None, CompressionFormat.mixed_precision.value, CompressionFormat.dense.value):
        fmt = global_format
    if fmt is None:
        fmt = infer_module_format(torch.nn.Linear, qs)
    fmt = CompressionFormat(fmt).value
    desc = f"format {fmt}, weights {w.type} {w.num_bits}-bit {w.strategy} group_size={w.group_size} block={w.block_structure}"
    if w.type == "float" and w.num_bits == 8 and fmt in _FP8_FORMATS and w.symmetric:
        if w.strategy == QuantizationStrategy.CHANNEL:
            return "fp8"
        if w.strategy == QuantizationStrategy.BLOCK and list(w.block_structure) == [128, 128]:
            return "fp8-block"
    if w.type == "float" and w.num_bits == 4 and fmt in _FP4_FORMATS and w.symmetric:
        ours = get_scheme(_FP4_FORMATS[fmt])
        if w.group_size == ours.group_size:
            return ours.name
    raise ValueError(f"unsupported compressed-tensors weight scheme ({desc}); kie reads fp8, fp8-block, nvfp4, mxfp4")


def _targets(prefix: str, target: str) -> bool:
    # Class-name targets ("Linear") cannot be resolved from tensor names; every weight we are asked about
    # is a Linear's, so they match. Other targets are module names or re: regexes (compressed-tensors'
    # own match_name).
    if target == "Linear" or (not target.startswith("re:") and target.endswith("Linear") and "." not in target):
        return True
    return match_name(prefix, target)


def module_scheme(quantization_cfg: "Mapping[str, Any] | QuantizationConfig", prefix: str) -> str | None:
    """Our scheme name for module ``prefix`` (e.g. "model.layers.0.mlp.down_proj"), or None if the
    config leaves it unquantized (ignored or not targeted). First matching config group wins."""
    qc = quantization_cfg if isinstance(quantization_cfg, QuantizationConfig) else parse_quantization_config(quantization_cfg)
    if any(match_name(prefix, ig) for ig in qc.ignore or []):
        return None
    for qs in qc.config_groups.values():
        if qs.weights is not None and any(_targets(prefix, t) for t in qs.targets):
            return scheme_from_ct(qs, qc.format)
    return None


def read_quantized(
    tensors: Mapping[str, torch.Tensor],
    prefix: str,
    quantization_cfg: "Mapping[str, Any] | QuantizationConfig",
    dtype: torch.dtype = torch.bfloat16,
) -> QuantizedTensor | None:
    """Build the QuantizedTensor of module ``prefix`` from a compressed-tensors checkpoint's tensors
    (any mapping name -> tensor, e.g. a dict or a lazy safetensors view). Returns None when the module
    is stored unquantized (``<prefix>.weight`` in a float dtype). ``dtype`` is the original weight dtype
    to record (the checkpoint does not store it; config.json's ``torch_dtype`` / ``dtype`` does).

    The scheme comes from the config; the tensor names and dtypes must agree with it, otherwise the
    error names the module and what was found.
    """
    p = f"{prefix}."
    expected = module_scheme(quantization_cfg, prefix)
    if f"{p}weight_packed" in tensors:
        found = "nvfp4" if f"{p}weight_global_scale" in tensors else "mxfp4"
    elif f"{p}weight" in tensors and f"{p}weight_scale" in tensors and tensors[f"{p}weight"].dtype == torch.float8_e4m3fn:
        found = "fp8"  # channel or block: told apart by the config
    elif f"{p}weight" in tensors and torch.is_floating_point(tensors[f"{p}weight"]) and tensors[f"{p}weight"].element_size() > 1:
        found = None
    else:
        raise ValueError(f"{prefix}: no weight / weight_packed tensor found in the checkpoint")

    if found is None:
        if expected is not None:
            raise ValueError(f"{prefix}: config says {expected} but the checkpoint stores a {tensors[f'{p}weight'].dtype} weight")
        return None
    if expected is None:
        raise ValueError(f"{prefix}: checkpoint stores quantized tensors ({found}) but the config ignores / does not target it")
    if found != expected and not (found == "fp8" and expected == "fp8-block"):
        raise ValueError(f"{prefix}: config says {expected} but the checkpoint's tensors look like {found}")

    sch = get_scheme(expected)
    local = {}
    for n in sch.tensor_names:
        if f"{p}{n}" not in tensors:
            raise ValueError(f"{prefix}: missing tensor {p}{n} for scheme {sch.name}")
        local[n] = tensors[f"{p}{n}"]
    codes = local[sch.weight_name]
    shape = tuple(codes.shape[:-1]) + ((codes.shape[-1] * 2,) if sch.weight_name == "weight_packed" else (codes.shape[-1],))
    try:
        return QuantizedTensor(sch.name, local, shape, dtype)
    except ValueError as e:
        raise ValueError(f"{prefix}: {e}") from None


# ---------------------------------------------------------------------------------------- native ingest


def native_fp8_block_size(config: Mapping[str, Any]) -> tuple[int, int]:
    """config.json dict (or its quantization_config) of a native FP8 checkpoint -> (block_out, block_in)."""
    qc = config.get("quantization_config", config)
    if qc.get("quant_method") != "fp8":
        raise ValueError(f"quantization_config.quant_method is {qc.get('quant_method')!r}, not 'fp8'")
    bs = qc.get("weight_block_size")
    if bs is None or len(bs) != 2:
        raise ValueError(f"quantization_config.weight_block_size must be [rows, cols], got {bs!r}")
    return int(bs[0]), int(bs[1])


def dequant_fp8_block_native(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
    name: str = "weight",
) -> torch.Tensor:
    """Native FP8 block weight e4m3 [.., out, in] + ``weight_scale_inv`` [.., ceil(out/bo), ceil(in/bi)]
    -> dtype [.., out, in], w = e4m3 * scale_inv (computed in float32, rounded once)."""
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: native fp8 weight must be float8_e4m3fn, got {weight.dtype}")
    bo, bi = block_size
    *lead, out, inp = weight.shape
    want = (*lead, -(-out // bo), -(-inp // bi))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"{name}_scale_inv: expected shape {want} for weight {tuple(weight.shape)} and block {block_size}, "
            f"got {tuple(scale_inv.shape)}"
        )
    s = scale_inv.float().repeat_interleave(bo, dim=-2)[..., :out, :].repeat_interleave(bi, dim=-1)[..., :inp]
    return (weight.float() * s).to(dtype)


def _check_gptoss(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: gpt-oss _blocks / _scales must be uint8, got {blocks.dtype} / {scales.dtype}")
    if blocks.ndim < 3 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"{name}: expected _blocks [.., out, in/32, 16] and _scales [.., out, in/32], "
            f"got {tuple(blocks.shape)} and {tuple(scales.shape)}"
        )


def dequant_gptoss_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, name: str = "experts"
) -> torch.Tensor:
    """gpt-oss ``*_blocks`` u8 [E, out, G, 16] + ``*_scales`` u8 [E, out, G] -> dtype [E, out, G*32].

    Note the orientation: transformers' convert_moe_packed_tensors returns the transpose ([E, in, out],
    its x @ W layout); we keep [out, in] like every other weight here. For gate_up_proj, out = 2 *
    intermediate with gate = even rows and up = odd rows.
    """
    _check_gptoss(blocks, scales, name)
    vals = decode_e2m1(unpack_nibbles(blocks))  # [.., out, G, 32]
    w = vals * decode_e8m0(scales)[..., None]
    return w.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32).to(dtype)


def gptoss_mxfp4_as_quantized(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, name: str = "experts"
) -> QuantizedTensor:
    """The same bytes viewed as our mxfp4 QuantizedTensor (no requantization, no loss)."""
    _check_gptoss(blocks, scales, name)
    *lead, g, _ = blocks.shape
    packed = blocks.reshape(*lead, g * 16)  # [.., out, in/2]
    return QuantizedTensor("mxfp4", {"weight_packed": packed, "weight_scale": scales}, (*lead, g * 32), dtype)
