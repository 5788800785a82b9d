"""GPTQ: choose a weight's codes so that its layer's output on calibration inputs moves least, not each weight.

Round-to-nearest (quant.schemes.quantize) rounds every weight on its own. GPTQ (Frantar et al. 2022, "GPTQ:
Accurate Post-Training Quantization for Generative Pre-trained Transformers"; llm-compressor's GPTQModifier)
rounds one input column at a time and moves the not-yet-rounded columns of the same rows to cancel the error it
just made, weighted by how the layer's inputs correlate: it minimises ||X W^T - X Q^T||^2 over calibration inputs
X [N, in] through the Hessian H = X^T X / N [in, in] (only H is needed, never X).

As in llm-compressor: the scales are the scheme's own (its observer, on the original weight), fixed before the
first column; only the codes change, so the output is the same format, read by the same readers (compressed-
tensors, vLLM, our kernels). With H diagonal (uncorrelated inputs) no error is carried to other columns and the
result equals round-to-nearest bit for bit (tests/quant/test_gptq.py).

Rows are independent: a row's codes depend on that row, H and its scales only, so a fused tensor (gate/up rows of
one expert) quantized whole gives the same codes as its parts quantized apart.
"""
from __future__ import annotations

import torch

from .schemes import QuantizedTensor, Scheme, get_scheme, quantize

__all__ = ["gptq_quantize", "HessianAccumulator", "DEFAULT_DAMP", "DEFAULT_BLOCK"]

DEFAULT_DAMP = 0.01    # llm-compressor's dampening_frac: lambda = 1% of the mean diagonal, added to H's diagonal
DEFAULT_BLOCK = 128    # columns per lazy-update block (the paper's B); changes speed only, not the result


class HessianAccumulator:
    """Running H = X^T X / N for one Linear's inputs ([in, in], float32, on the inputs' device)."""

    def __init__(self, n_in: int, device: "torch.device | str" = "cpu"):
        self.h = torch.zeros(n_in, n_in, dtype=torch.float32, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        """x: [..., in] inputs of the Linear (any float dtype)."""
        x = x.reshape(-1, x.shape[-1]).float()
        if x.shape[1] != self.h.shape[0]:
            raise ValueError(f"Hessian of a Linear with in={self.h.shape[0]} got inputs of width {x.shape[1]}")
        m = x.shape[0]
        if m == 0:
            return
        # running mean, so a long calibration run never overflows or loses the early samples' weight
        self.h.mul_(self.n / (self.n + m)).add_(x.t() @ x, alpha=1.0 / (self.n + m))
        self.n += m

    @property
    def value(self) -> torch.Tensor | None:
        return self.h if self.n else None


def _inverse_cholesky(h: torch.Tensor, damp: float, name: str) -> torch.Tensor:
    """Upper Cholesky factor of (H + lambda I)^-1 [in, in] (float32). Columns that never saw a non-zero input
    (diag 0: an expert no calibration token chose, a dead channel) get a unit diagonal, so nothing is carried out
    of them and their weights are rounded to nearest. A matrix that is still not positive definite is retried with
    10x the dampening, up to 1000x, before giving up."""
    h = h.float().clone()
    diag = torch.diagonal(h)
    dead = diag <= 0
    h[dead, :] = 0
    h[:, dead] = 0
    diag[dead] = 1
    lam = damp * float(diag.mean())
    for attempt in range(4):
        try:
            hd = h + lam * (10 ** attempt) * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
            inv = torch.cholesky_inverse(torch.linalg.cholesky(hd))
            return torch.linalg.cholesky(inv, upper=True)
        except torch.linalg.LinAlgError:
            continue
    raise ValueError(f"{name}: calibration Hessian is not positive definite even with {damp * 1000:g} x its mean "
                     "diagonal added (NaN / Inf in the calibration activations?)")


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor | None, scheme: "str | Scheme",
                  global_scale: "torch.Tensor | float | None" = None, *, name: str = "weight",
                  damp: float = DEFAULT_DAMP, block: int = DEFAULT_BLOCK, actorder: bool = True) -> QuantizedTensor:
    """Quantize a 2-D [out, in] weight by GPTQ under `hessian` [in, in] (None: round to nearest, as `quantize`).

    Scales, global scale and validation are `quantize`'s (same arguments, same errors); codes are chosen column by
    column, each column's rounding error carried onto the later columns through the inverse Hessian's Cholesky
    factor. actorder: columns in order of decreasing H diagonal (the inputs with the most energy first, while
    the most columns are left to absorb their error; llm-compressor's actorder="static": scales stay fixed, so
    the order changes only which codes are chosen), else input order."""
    sch = get_scheme(scheme)
    rtn = quantize(weight, sch, global_scale, name=name)
    if hessian is None:
        return rtn
    if weight.ndim != 2:
        raise ValueError(f"{name}: GPTQ takes one [out, in] weight at a time, got shape {tuple(weight.shape)}")
    out, n = weight.shape
    if tuple(hessian.shape) != (n, n):
        raise ValueError(f"{name}: Hessian of shape {tuple(hessian.shape)} does not match in={n}")
    if not bool(torch.isfinite(hessian).all()):
        raise ValueError(f"{name}: calibration Hessian has NaN / Inf entries")
    dev = hessian.device
    w = weight.to(dev, torch.float32).clone()                                  # [out, in], updated in place
    # the scale each element is divided by: the scheme's own dequantization of all-ones codes, [out, in]
    step = sch._dequantize({**{k: v.to(dev) for k, v in rtn.tensors.items()},
                            sch.weight_name: sch._store(torch.ones_like(w))}, (out, n))
    perm = torch.argsort(torch.diagonal(hessian), descending=True, stable=True) if actorder else None
    if perm is not None:
        w, step, hessian = w[:, perm].contiguous(), step[:, perm].contiguous(), hessian[perm][:, perm]
    u = _inverse_cholesky(hessian, damp, name)                                 # [in, in] upper
    z = torch.empty_like(w)          # each element divided by its scale, as it stood when its column was rounded
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        w1, u1 = w[:, i1:i2], u[i1:i2, i1:i2]
        err = torch.empty_like(w1)                                              # [out, i2 - i1]
        for i in range(i2 - i1):
            col, s = w1[:, i], step[:, i1 + i]
            z[:, i1 + i] = zc = col / s
            qc = sch._round(zc) * s
            e = (col - qc) / u1[i, i]
            w1[:, i + 1:] -= e[:, None] * u1[i, i + 1:][None, :]
            err[:, i] = e
        w[:, i2:] -= err @ u[i1:i2, i2:]
    if perm is not None:
        z = z[:, torch.argsort(perm)]
    tensors = dict(rtn.tensors)
    tensors[sch.weight_name] = sch._store(z).to(rtn.tensors[sch.weight_name].device)
    return QuantizedTensor(sch.name, tensors, rtn.shape, rtn.dtype)
