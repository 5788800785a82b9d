"""Tiny random HF checkpoints made with transformers' own classes (`save_pretrained`): the oracle side of the
family tests. Each config turns on the features the family's adapter must get right."""
from __future__ import annotations

import torch

BASE = dict(vocab_size=211, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None,
            initializer_range=0.15, tie_word_embeddings=False)

# name -> (model_type, overrides). Names say which feature each case exercises.
CASES = {
    "llama": ("llama", dict(intermediate_size=96, rope_parameters={
        "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(intermediate_size=96, head_dim=24, use_sliding_window=True, sliding_window=7,
                            max_window_layers=1)),
    "qwen3_moe_mixed": ("qwen3_moe", dict(intermediate_size=96, moe_intermediate_size=40, num_experts=9,
                                          num_experts_per_tok=3, decoder_sparse_step=2, mlp_only_layers=[],
                                          num_hidden_layers=4, norm_topk_prob=False, head_dim=16)),
    "qwen3_moe_norm": ("qwen3_moe", dict(intermediate_size=96, moe_intermediate_size=40, num_experts=8,
                                         num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True)),
    "qwen2_moe": ("qwen2_moe", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=6,
                                    num_experts_per_tok=2, shared_expert_intermediate_size=48,
                                    norm_topk_prob=False)),
    "mixtral_window": ("mixtral", dict(intermediate_size=48, num_local_experts=5, num_experts_per_tok=2,
                                       sliding_window=6)),
    "olmoe": ("olmoe", dict(intermediate_size=32, num_experts=8, num_experts_per_tok=3, clip_qkv=3.0,
                            norm_topk_prob=False)),
    "gpt_oss": ("gpt_oss", dict(intermediate_size=40, num_local_experts=6, num_experts_per_tok=2, head_dim=16,
                                sliding_window=6, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 64})),
    "deepseek_v2": ("deepseek_v2", dict(intermediate_size=96, moe_intermediate_size=24, n_routed_experts=8,
                                        num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
                                        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
                                        qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=4,
                                        topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                        routed_scaling_factor=1.5,
                                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                         "original_max_position_embeddings": 128, "mscale": 0.707,
                                                         "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1})),
    "deepseek_v3": ("deepseek_v3", dict(intermediate_size=96, moe_intermediate_size=24, n_routed_experts=8,
                                        num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1,
                                        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                        v_head_dim=12, num_key_value_heads=4, n_group=4, topk_group=2,
                                        norm_topk_prob=True, routed_scaling_factor=2.5)),
}


def make_checkpoint(case: str, out_dir: str, dtype=torch.float32, seed: int = 0):
    """Build `case` with transformers' own class, randomise buffers it leaves at zero, save; return the model."""
    from transformers import AutoConfig, AutoModelForCausalLM
    mt, over = CASES[case]
    cfg = AutoConfig.for_model(mt, **{**BASE, **over})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            # HF zero-inits biases, sinks and DeepSeek's e_score_correction_bias: make them matter
            if name.endswith(("bias", "sinks", "e_score_correction_bias")) and "inv_freq" not in name:
                t.normal_(0, 0.3)
            elif name.endswith("norm.weight") or "layernorm" in name:
                t.uniform_(0.6, 1.4)
    model = model.to(dtype)
    model.save_pretrained(out_dir)
    return model.float()
