"""compressed-tensors config / checkpoint I/O and native-format ingest, each against an outside oracle:
compressed-tensors' schema objects and its checkpoint dequantizer, its FP8-block dequantizer, transformers'
CompressedTensorsConfig and gpt-oss MXFP4 conversion."""

import json

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.utils.quantization_config import CompressedTensorsConfig

from kie_moe.quant import (
    SCHEMES,
    ct_scheme,
    dequant_fp8_block_native,
    dequant_gptoss_mxfp4,
    get_scheme,
    gptoss_mxfp4_as_quantized,
    module_scheme,
    native_fp8_block_size,
    quantization_config,
    quantization_config_dict,
    quantize,
    read_quantized,
    scheme_from_ct,
)

IGNORE = ["lm_head", r"re:.*mlp\.gate$"]


@pytest.mark.parametrize("name", list(SCHEMES))
def test_config_dict_round_trips_through_compressed_tensors(name):
    sch = get_scheme(name)
    d = quantization_config_dict(name, IGNORE)
    d = json.loads(json.dumps(d))  # what config.json holds
    assert d["quant_method"] == "compressed-tensors" and d["format"] == sch.format
    assert d["quantization_status"] == "compressed" and d["ignore"] == IGNORE
    qc = QuantizationConfig.model_validate(d)
    assert qc.model_dump() == quantization_config(name, IGNORE).model_dump()
    (group,) = qc.config_groups.values()
    preset = preset_name_to_scheme(sch.preset, ["Linear"])
    # compared serialised: a symmetric scheme's zp_dtype is not written, and reloads as e4m3 for FP4
    # (preset MXFP4A16 says uint8); there is no zero point, so nothing reads it.
    assert group.model_dump(exclude={"format"}) == preset.model_dump(exclude={"format"})
    # the format we pin is the one compressed-tensors would infer itself
    assert infer_module_format(torch.nn.Linear, group).value == sch.format
    assert BaseCompressor.get_value_from_registry(group.format).__name__  # a registered compressor
    # and transformers' loader (the HF / vLLM entry point) parses it to the same config
    assert CompressedTensorsConfig.from_dict(d).quantization_config.model_dump() == qc.model_dump()
    assert scheme_from_ct(group, qc.format) == name


def _write_checkpoint(tmp_path, name):
    """A tiny checkpoint: two quantized Linears (one of them stacked experts, written per expert), an
    ignored router and lm_head in bf16."""
    g = torch.Generator().manual_seed(7)
    dense = {
        "model.layers.0.mlp.gate.weight": torch.randn(4, 96, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(11, 96, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(96, dtype=torch.bfloat16),
    }
    attn = (torch.randn(37, 96, generator=g) * 0.05).to(torch.bfloat16)
    experts = (torch.randn(2, 64, 160, generator=g) * 0.05).to(torch.bfloat16)
    qs = {"model.layers.0.self_attn.o_proj": quantize(attn, name)}
    for e, part in enumerate(quantize(experts, name).unstack()):
        qs[f"model.layers.0.mlp.experts.{e}.down_proj"] = part
    tensors = dict(dense)
    for prefix, q in qs.items():
        tensors.update(q.named(prefix))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "toy", "quantization_config": quantization_config_dict(name, IGNORE)})
    )
    return tensors, qs, dense


@pytest.mark.parametrize("name", list(SCHEMES))
def test_compressed_tensors_dequantizer_reads_our_checkpoint(tmp_path, name):
    tensors, qs, dense = _write_checkpoint(tmp_path, name)
    out = CompressedTensorsDequantizer(str(tmp_path), dtype=torch.float32).process(dict(tensors))
    for prefix, q in qs.items():
        ct_w = out[f"{prefix}.weight"]
        ref_dtype = torch.bfloat16 if name in ("nvfp4", "mxfp4") else torch.float32  # CT decompress dtype
        assert torch.equal(ct_w, q.dequantize(ref_dtype).float()), prefix
    for k, v in dense.items():  # ignored modules pass through untouched
        assert torch.equal(out[k], v)
    qparams = [k for k in out if k.rpartition(".")[2] != "weight"]
    assert qparams == [], qparams


@pytest.mark.parametrize("name", list(SCHEMES))
def test_read_quantized_round_trip(tmp_path, name):
    tensors, qs, _ = _write_checkpoint(tmp_path, name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for prefix, q in qs.items():
        r = read_quantized(tensors, prefix, cfg)
        assert r is not None and r.scheme == name and r.shape == q.shape
        assert torch.equal(r.dequantize(), q.dequantize())
    assert read_quantized(tensors, "lm_head", cfg) is None
    assert read_quantized(tensors, "model.layers.0.mlp.gate", cfg) is None


def test_read_quantized_errors_name_the_module(tmp_path):
    tensors, _, _ = _write_checkpoint(tmp_path, "nvfp4")
    p = "model.layers.0.self_attn.o_proj"
    with pytest.raises(ValueError, match=rf"{p}.*config says fp8"):
        read_quantized(tensors, p, quantization_config_dict("fp8", IGNORE))
    broken = {k: v for k, v in tensors.items() if k != f"{p}.weight_scale"}
    with pytest.raises(ValueError, match=rf"{p}.*missing tensor.*weight_scale"):
        read_quantized(broken, p, quantization_config_dict("nvfp4", IGNORE))
    bad_shape = dict(tensors)
    bad_shape[f"{p}.weight_scale"] = tensors[f"{p}.weight_scale"][:, :3]
    with pytest.raises(ValueError, match=rf"{p}.*weight_scale.*expected"):
        read_quantized(bad_shape, p, quantization_config_dict("nvfp4", IGNORE))
    with pytest.raises(ValueError, match=rf"{p}.*ignores"):
        read_quantized(tensors, p, quantization_config_dict("nvfp4", IGNORE + [p]))
    with pytest.raises(ValueError, match="lm_head.*config says nvfp4"):
        read_quantized(tensors, "lm_head", quantization_config_dict("nvfp4", []))
    with pytest.raises(ValueError, match="nope.*no weight"):
        read_quantized(tensors, "nope", quantization_config_dict("nvfp4", []))


def test_fp8_channel_vs_block_told_apart_by_config():
    w = torch.randn(37, 160)
    tensors = quantize(w, "fp8-block").named("m")
    q = read_quantized(tensors, "m", quantization_config_dict("fp8-block"))
    assert q.scheme == "fp8-block"
    with pytest.raises(ValueError, match="m: fp8 tensor 'weight_scale'"):
        read_quantized(tensors, "m", quantization_config_dict("fp8"))


def test_unanchored_ignore_regex_also_hits_gate_proj():
    # compressed-tensors matches ignore regexes with re.match: this is why the converter must anchor them.
    loose = quantization_config_dict("fp8", [r"re:.*mlp\.gate"])
    anchored = quantization_config_dict("fp8", [r"re:.*mlp\.gate$"])
    assert module_scheme(loose, "model.layers.0.mlp.gate_proj") is None
    assert module_scheme(anchored, "model.layers.0.mlp.gate_proj") == "fp8"
    assert module_scheme(anchored, "model.layers.0.mlp.gate") is None


def test_mixed_config_groups_and_unsupported_schemes():
    attn = ct_scheme("fp8", [r"re:.*self_attn\..*_proj$"])
    experts = ct_scheme("nvfp4", [r"re:.*mlp\.experts\..*"])
    qc = QuantizationConfig(config_groups={"attn": attn, "experts": experts}, format="mixed-precision", ignore=["lm_head"])
    d = {"quant_method": "compressed-tensors", **qc.model_dump(mode="json")}
    assert module_scheme(d, "model.layers.3.self_attn.k_proj") == "fp8"
    assert module_scheme(d, "model.layers.3.mlp.experts.17.up_proj") == "nvfp4"
    assert module_scheme(d, "model.layers.3.mlp.shared_expert.up_proj") is None  # not targeted
    # W4A4 NVFP4 checkpoints: same weight layout, activations are not our concern
    assert scheme_from_ct(preset_name_to_scheme("NVFP4", ["Linear"])) == "nvfp4"
    assert scheme_from_ct(preset_name_to_scheme("MXFP4", ["Linear"])) == "mxfp4"
    for preset in ("FP8", "W4A16", "MXFP8A16"):
        with pytest.raises(ValueError, match="unsupported compressed-tensors weight scheme"):
            scheme_from_ct(preset_name_to_scheme(preset, ["Linear"]))
    with pytest.raises(ValueError, match="not 'compressed-tensors'"):
        module_scheme({"quant_method": "fp8", "weight_block_size": [128, 128]}, "x")


@pytest.mark.parametrize("shape", [(37, 96), (257, 300), (128, 256), (3, 130, 129)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_fp8_block_matches_compressed_tensors_dequantizer(shape, dtype):
    g = torch.Generator().manual_seed(11)
    weight = (torch.randn(shape, generator=g) * 100).to(torch.float8_e4m3fn)
    *lead, out, inp = shape
    scale_inv = torch.rand(*lead, -(-out // 128), -(-inp // 128), generator=g) * 1e-3
    ours = dequant_fp8_block_native(weight, scale_inv, dtype=dtype)
    oracle = FP8BlockDequantizer(dtype=dtype)
    if lead:
        ref = torch.stack([oracle._create_dequantized_weight(weight[e], scale_inv[e]) for e in range(lead[0])])
    else:
        ref = oracle._create_dequantized_weight(weight, scale_inv)
    assert ours.dtype == dtype and torch.equal(ours, ref)


def test_native_fp8_block_errors_and_config():
    w = torch.zeros(37, 300, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"layers.1.q_proj.weight_scale_inv: expected shape \(1, 3\)"):
        dequant_fp8_block_native(w, torch.ones(1, 2), name="layers.1.q_proj.weight")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequant_fp8_block_native(torch.zeros(4, 4), torch.ones(1, 1))
    assert native_fp8_block_size({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}) == (128, 128)
    with pytest.raises(ValueError, match="weight_block_size"):
        native_fp8_block_size({"quant_method": "fp8"})


def test_gptoss_mxfp4_matches_transformers_and_is_our_mxfp4_layout():
    g = torch.Generator().manual_seed(13)
    E, out, G = 3, 10, 5
    blocks = torch.randint(0, 256, (E, out, G, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 135, (E, out, G), dtype=torch.uint8, generator=g)
    ours = dequant_gptoss_mxfp4(blocks, scales)
    assert ours.shape == (E, out, G * 32)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]: x @ W layout
    assert torch.equal(ours, ref.transpose(1, 2))
    assert torch.equal(dequant_gptoss_mxfp4(blocks, scales, dtype=torch.bfloat16), convert_moe_packed_tensors(blocks, scales).transpose(1, 2))
    # same bytes as compressed-tensors mxfp4: its own decompress agrees, per expert
    q = gptoss_mxfp4_as_quantized(blocks, scales)
    assert q.scheme == "mxfp4" and q.shape == (E, out, G * 32)
    cts = ct_scheme("mxfp4")
    comp = BaseCompressor.get_value_from_registry(cts.format)
    for e, part in enumerate(q.unstack()):
        dec = comp.decompress(dict(part.tensors), cts)["weight"]
        assert torch.equal(dec.float(), ours[e].to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="experts.down_proj.*_blocks"):
        dequant_gptoss_mxfp4(blocks[..., :8], scales, name="experts.down_proj")
