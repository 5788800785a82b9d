"""Sampling parameters and the host-side sampler (greedy, temperature, top-k, top-p) used by the reference
backend; GPU backends implement the same rules in their kernels and are tested against this."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kie_moe.models.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = off
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):   # NaN fails the first test
            raise InputError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """logits [V] float32 -> token id. Temperature sampling draws from the filtered softmax with `gen`."""
    if p.greedy:
        return int(torch.argmax(logits))
    x = logits.float() / p.temperature
    if p.top_k:
        kth = torch.topk(x, min(p.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = probs.cumsum(-1) - probs >= p.top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))
