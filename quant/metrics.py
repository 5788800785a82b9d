"""Quality metrics for the throughput-vs-quality sweep: a quantized model against its bf16 reference.

All take logits [..., V] (any leading dims: [T, V], [B, T, V]) and reduce in float32 over every position,
so a sweep can pass whole teacher-forced sequences. Logits here are *aligned* with targets: logits[..., t,
:] is the distribution that ``targets[..., t]`` is scored against (shift by one before calling when the
logits come from a causal LM over the same ids).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["kl_divergence", "top1_agreement", "perplexity", "QualityReport", "compare_logits"]


def _check_pair(ref: torch.Tensor, test: torch.Tensor) -> None:
    if ref.shape != test.shape:
        raise ValueError(f"reference logits {tuple(ref.shape)} and test logits {tuple(test.shape)} differ in shape")
    if ref.ndim < 1 or ref.shape[-1] < 1:
        raise ValueError(f"logits need a vocabulary axis, got shape {tuple(ref.shape)}")


def kl_divergence(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> float:
    """Mean over positions of KL(P_ref || P_test) in nats, P = softmax over the last axis.

    KL(ref || test) (not the reverse) is the standard "how much worse does the quantized model predict
    the reference's next token distribution" number (as in llama.cpp's KLD). -inf logits (masked vocab)
    are fine on either side as long as the reference puts no mass where test has none.
    """
    _check_pair(ref_logits, test_logits)
    lp = F.log_softmax(ref_logits.float(), dim=-1)
    lq = F.log_softmax(test_logits.float(), dim=-1)
    p = lp.exp()
    # p * (lp - lq) with 0 * anything = 0 where p = 0 (avoids 0 * inf = nan on masked entries)
    kl = torch.where(p > 0, p * (lp - lq), torch.zeros_like(p)).sum(dim=-1)
    return float(kl.mean())


def top1_agreement(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> float:
    """Fraction of positions where both argmaxes agree (greedy decoding would pick the same token)."""
    _check_pair(ref_logits, test_logits)
    return float((ref_logits.argmax(dim=-1) == test_logits.argmax(dim=-1)).float().mean())


def perplexity(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> float:
    """exp(mean negative log-likelihood of ``targets`` [...] under ``logits`` [..., V]); positions whose
    target is ``ignore_index`` (padding, prompt tokens) are skipped."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not fit targets {tuple(targets.shape)} (expect [..., V] and [...])")
    valid = targets != ignore_index
    if not bool(valid.any()):
        raise ValueError("perplexity: every target is ignore_index")
    nll = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1).long(), ignore_index=ignore_index, reduction="sum"
    )
    return math.exp(float(nll) / int(valid.sum()))


@dataclass(frozen=True)
class QualityReport:
    """One sweep row's quality columns (perplexities only when targets were given)."""

    kl: float
    top1: float
    ppl_ref: float | None = None
    ppl_test: float | None = None


def compare_logits(
    ref_logits: torch.Tensor, test_logits: torch.Tensor, targets: torch.Tensor | None = None, ignore_index: int = -100
) -> QualityReport:
    ppl_ref = perplexity(ref_logits, targets, ignore_index) if targets is not None else None
    ppl_test = perplexity(test_logits, targets, ignore_index) if targets is not None else None
    return QualityReport(kl_divergence(ref_logits, test_logits), top1_agreement(ref_logits, test_logits), ppl_ref, ppl_test)
