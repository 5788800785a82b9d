"""Shared pieces of the Laneformer tests: small configs covering every switch (a uniquely named module, so it
never collides with another test folder's helpers)."""
from __future__ import annotations

# 5 layers, 4 lanes of 2 q heads / 1 kv head, head_dim 4; odd vocab. Weights are drawn with std 0.3 (and norm
# scales 1 +- 0.2) so attention is far from uniform and greedy tokens vary.
BASE = dict(model_type="laneformer", vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=5,
            num_attention_heads=8, num_key_value_heads=4, num_lanes=4, broadcast_delay=2, use_comm=True,
            use_early_comm=True, replicated_rmsn_scale=False, pre_norm_lane_agg=True, lm_head_type="replicate",
            sliding_window=3, sliding_window_n_layers=3, unclamped_layers=[], rope_theta=10000.0, norm_eps=1e-5,
            max_position_embeddings=64, eos_token_id=2, bos_token_id=1, tie_word_embeddings=False)
EIGHT_LANES = dict(num_lanes=8, hidden_size=64, num_attention_heads=16, num_key_value_heads=8, intermediate_size=64)
PROMPT = [1, 5, 17, 33, 8, 60, 2, 44, 91]                # longer than every window used


def config(**overrides) -> dict:
    c = dict(BASE)
    c.update(overrides)
    return c
