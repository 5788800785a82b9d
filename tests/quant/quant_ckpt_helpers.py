"""Checkpoints for the converter / ingest tests: tiny HF models of every family (transformers' own classes, via
tests/models/hf_tiny), a tiny Laneformer, and the pre-quantized formats other tools ship (gpt-oss native MXFP4,
native FP8-block, transformers-v5 fused experts, an llm-compressor-style compressed-tensors checkpoint), built by
rewriting the tiny ones. A uniquely named module so it never collides with another test folder's helpers."""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from kie_moe.quant import quantize

SCHEME_NAMES = ("fp8", "fp8-block", "nvfp4", "mxfp4")
LANE_CASE = "laneformer"


def make_hf(model_type: str, overrides: dict, out_dir: str, dtype=torch.bfloat16, seed: int = 0, **save_kw):
    """tests/models/hf_tiny.make_checkpoint for a config not in its CASES (same base and randomisation)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.models.hf_tiny import BASE

    cfg = AutoConfig.for_model(model_type, **{**BASE, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("bias", "sinks", "e_score_correction_bias")) and "inv_freq" not in name:
                t.normal_(0, 0.3)
            elif name.endswith("norm.weight") or "layernorm" in name:
                t.uniform_(0.6, 1.4)
    model.to(dtype).save_pretrained(out_dir, **save_kw)
    return out_dir


def make_case(case: str, out_dir: str) -> str:
    """bf16 checkpoint of an hf_tiny case, or of the tiny Laneformer (LANE_CASE)."""
    if case == LANE_CASE:
        from kie_moe.dense.preset import preset, write_checkpoint
        write_checkpoint(preset("laneformer-tiny"), out_dir, dtype=torch.bfloat16, seed=1, init_std=0.25,
                         norm_jitter=0.2)
        return out_dir
    from tests.models.hf_tiny import CASES, make_checkpoint
    assert case in CASES, case
    make_checkpoint(case, out_dir, dtype=torch.bfloat16)
    return out_dir


def rewrite(src: str, dst: str, fn, config_update: dict | None = None) -> str:
    """Copy checkpoint src -> dst with its (single) model.safetensors passed through fn(dict) -> dict."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = fn(load_file(path))
    save_file(tensors, path, metadata={"format": "pt"})
    index = os.path.join(dst, "model.safetensors.index.json")
    if os.path.exists(index):  # keep it true to the rewritten file
        json.dump({"metadata": {}, "weight_map": {n: "model.safetensors" for n in tensors}}, open(index, "w"))
    if config_update:
        cfg = json.load(open(os.path.join(dst, "config.json")))
        cfg.update(config_update)
        json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=2)
    return dst


def to_gptoss_native_mxfp4(src: str, dst: str) -> str:
    """gpt-oss bf16 [E, in, out] experts -> the native `_blocks` [E, out, in/32, 16] / `_scales` [E, out, in/32]
    layout and quant_method mxfp4 (attention, router, embeddings stay bf16, as in openai/gpt-oss-*)."""

    def fn(t):
        out = {}
        for n, w in t.items():
            if n.endswith(("experts.gate_up_proj", "experts.down_proj")):
                q = quantize(w.transpose(1, 2), "mxfp4", name=n)  # [E, out, in]
                packed = q.tensors["weight_packed"]
                out[n + "_blocks"] = packed.reshape(*packed.shape[:-1], -1, 16).contiguous()
                out[n + "_scales"] = q.tensors["weight_scale"].contiguous()
            else:
                out[n] = w
        return out

    return rewrite(src, dst, fn, {"quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}})


def to_native_fp8_block(src: str, dst: str, linear_suffixes=("_proj.weight", "_mqa.weight")) -> str:
    """Every projection -> e4m3 `weight` + f32 `weight_scale_inv` per 128x128 block, quant_method fp8 (as in
    deepseek-ai/DeepSeek-V3); routers (`mlp.gate.weight`), embeddings, norms and lm_head stay bf16."""

    def fn(t):
        out = {}
        for n, w in t.items():
            if n.endswith(linear_suffixes) and w.ndim == 2:
                q = quantize(w, "fp8-block", name=n)
                out[n] = q.tensors["weight"]
                out[n[: -len("weight")] + "weight_scale_inv"] = q.tensors["weight_scale"]
            else:
                out[n] = w
        return out

    return rewrite(src, dst, fn, {"quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}})


def to_v5_fused_experts(src: str, dst: str, num_experts: int) -> str:
    """Per-expert `experts.{e}.{gate,up,down}_proj.weight` -> transformers-v5's in-memory layout on disk:
    `experts.gate_up_proj` [E, 2I, D] (gate rows first) and `experts.down_proj` [E, D, I]."""

    def fn(t):
        out, layers = {}, {}
        for n, w in t.items():
            if ".mlp.experts." in n:
                pre, rest = n.split(".mlp.experts.")
                e, proj, _ = rest.split(".")
                layers.setdefault(pre, {})[(int(e), proj)] = w
            else:
                out[n] = w
        for pre, ws in layers.items():
            E = range(num_experts)
            out[f"{pre}.mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([ws[(e, "gate_proj")], ws[(e, "up_proj")]]) for e in E])
            out[f"{pre}.mlp.experts.down_proj"] = torch.stack([ws[(e, "down_proj")] for e in E])
        return out

    return rewrite(src, dst, fn)


# Cases beyond hf_tiny's: every `in` a multiple of 128, so fp8-block (which needs whole 128-column blocks) has
# something to quantize, and native FP8-block checkpoints can be re-packed.
BLOCK128_CASES = {
    "qwen3_moe_block128": ("qwen3_moe", dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                                             num_experts=4, num_experts_per_tok=2, head_dim=32, mlp_only_layers=[0],
                                             norm_topk_prob=True, num_hidden_layers=2)),
    "deepseek_v3_block128": ("deepseek_v3", dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                                                 n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                                 first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=128,
                                                 qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64,
                                                 num_attention_heads=2, num_key_value_heads=2, n_group=2,
                                                 topk_group=1, norm_topk_prob=True, num_hidden_layers=2)),
}


def make_any(case: str, out_dir: str) -> str:
    if case in BLOCK128_CASES:
        mt, over = BLOCK128_CASES[case]
        return make_hf(mt, over, out_dir)
    return make_case(case, out_dir)
