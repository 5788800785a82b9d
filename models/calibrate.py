"""Calibration for GPTQ (quant/gptq.py): the Hessian X^T X / N of every quantizable Linear's inputs, collected by
running the reference decoder over calibration token windows, one decoder layer at a time.

Sequential, as llm-compressor's sequential pipeline: layer i's inputs are computed by layers 0..i-1 already
quantized (GPTQ under their own Hessians), so each layer's codes compensate the error the layers below it made on
the calibration text, not an error that never happens. Within a layer every Linear is calibrated from one pass of
the float layer (q/k/v/o, router, experts alike).

The Linears are found by identity: the reference decoder calls `reference.linear(x, w)` with the very tensors it
holds under canonical names, so wrapping that function for the duration sees each Linear's input beside its
weight, for every family whose decoder is the ReferenceDecoder (attention of any kind, dense MLPs, routed and
shared experts). A routed expert sees only the tokens routed to it; one that no calibration token chose has no
Hessian and is rounded to nearest (counted in the result).

Cost: the whole model held by the reference decoder on `device` (float32 on a CPU, bf16 on a GPU), the residual
streams of every window, and the Hessians (one [in, in] float32 per distinct Linear input, kept on the host). The
reference decoder's MoE is a Python loop over experts, so on a CPU this suits small models (the embedded demo
model: ~40 s for 16k tokens); models that fit a GPU in bf16 want --device cuda; beyond that (and beyond host memory
for the Hessians: ~120 GB for qwen3-30b-a3b) a per-layer streaming pipeline would be needed, which this is not.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .quantizable import is_linear, partner_group
from .spec import canonical

__all__ = ["Calibration", "GptqOptions", "calibrate_gptq", "slice_canonicals", "gptq_calibrator"]


@dataclass(frozen=True, eq=False)
class GptqOptions:
    """`kie convert --gptq`: windows [n, S] calibration token ids (kie_moe.heldout.calibration_windows), where the
    calibration and the GPTQ solves run, the dampening fraction, and where the windows came from (for messages)."""
    windows: torch.Tensor
    device: str = "cpu"
    damp: float = 0.01
    label: str = ""


@dataclass
class Calibration:
    """hessians: canonical Linear name -> H [in, in] float32 (host); tokens: calibration tokens run; unseen:
    Linears whose input no calibration token reached (rounded to nearest)."""
    hessians: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: int = 0
    unseen: list[str] = field(default_factory=list)


def _global_scales(w: dict, names: list[str], scheme) -> dict[str, torch.Tensor | None]:
    """nvfp4: one global scale per fused-partner group (quantize shares it the same way: convert.group_global)."""
    from kie_moe.quant.schemes import shared_global_scale
    out: dict[str, torch.Tensor | None] = {n: None for n in names}
    if scheme.name != "nvfp4":
        return out
    groups: dict[str, list[str]] = {}
    for n in names:
        g = partner_group(n)
        if g is not None:
            groups.setdefault(g, []).append(n)
    for members in groups.values():
        if len(members) > 1:
            g = shared_global_scale([w[m].float() for m in members], members)
            out.update({m: g for m in members})
    return out


@torch.no_grad()
def calibrate_gptq(model, scheme, windows: torch.Tensor, device: "str | torch.device" = "cpu",
                   dtype: torch.dtype | None = None, targets: Callable[[str], bool] = is_linear,
                   damp: float | None = None, progress: Callable[[str], None] | None = None) -> Calibration:
    """Hessians of every Linear `targets(canonical)` selects, layer by layer with the layers below quantized.

    model: models.registry.LoadedModel (float or quantized checkpoint; the reference decoder dequantizes);
    scheme: the quant scheme GPTQ will write (the layers below are quantized in it); windows: [n, S] token ids,
    each run from an empty cache. Returns host float32 Hessians keyed by canonical name."""
    from kie_moe.quant.gptq import DEFAULT_DAMP, HessianAccumulator, gptq_quantize
    from kie_moe.quant.convert import _check_shape as check_shape
    from kie_moe.quant.schemes import NotQuantizable, get_scheme

    from . import reference
    from .reference import ReferenceDecoder

    sch = get_scheme(scheme)
    dev = torch.device(device)
    dec = ReferenceDecoder(model.spec, model.weights, dev, dtype)
    if type(dec).layer is not ReferenceDecoder.layer:
        raise TypeError(f"{model.spec.family}: GPTQ calibration needs the plain reference decoder")
    res = Calibration()
    xs = [dec.w["embed"][w.to(dev)] for w in windows]          # residual stream entering layer 0, [S, D] each
    res.tokens = sum(int(x.shape[0]) for x in xs)
    plain_linear = reference.linear
    for i in range(model.spec.num_layers):
        prefix = canonical(i, "")
        names = [n for n in dec.w if n.startswith(prefix) and targets(n)]
        by_id = {id(dec.w[n]): n for n in names}
        # fused partners (q/k/v, gate/up of one expert) read the same input: one accumulator and one stored H per
        # group, shared by its names (halves the Hessians' memory for gated MLPs and experts)
        key = {n: partner_group(n) or n for n in names}
        acc = {key[n]: HessianAccumulator(dec.w[n].shape[1], dev) for n in names}
        last: dict[str, torch.Tensor] = {}

        def hooked(x, w, b=None, _by_id=by_id, _acc=acc, _key=key, _last=last):
            n = _by_id.get(id(w))
            if n is not None and _last.get(_key[n]) is not x:   # the partner already added this very input
                _acc[_key[n]].add(x)
                _last[_key[n]] = x
            return plain_linear(x, w, b)

        reference.linear = hooked
        try:
            for x in xs:
                dec.reset()
                dec.layer(i, x, 0)
        finally:
            reference.linear = plain_linear
        globals_ = _global_scales(dec.w, names, sch)
        host: dict[str, torch.Tensor] = {}
        for n in names:
            h = acc[key[n]].value
            if h is None:
                res.unseen.append(n)
            else:
                res.hessians[n] = host.setdefault(key[n], h.cpu())
            try:
                check_shape(sch, tuple(dec.w[n].shape), n)
            except NotQuantizable:
                continue                              # the converter keeps it in float too
            q = gptq_quantize(dec.w[n].float(), h, sch, globals_[n], name=n,
                              damp=DEFAULT_DAMP if damp is None else damp)
            dec.w[n] = q.dequantize(dec.dtype)        # the layers above see this layer as it will be written
        for k, x in enumerate(xs):
            dec.reset()
            xs[k] = dec.layer(i, x, 0)
        if progress is not None:
            progress(f"calibrated layer {i + 1}/{model.spec.num_layers}: "
                     f"{len(names) - sum(n.startswith(prefix) for n in res.unseen)} Linears")
    if targets("lm_head") and "lm_head" in dec.w:          # --quantize-lm-head: its input is the final norm's output
        acc = HessianAccumulator(dec.w["lm_head"].shape[1], dev)
        for x in xs:
            acc.add(reference.rms_norm(x, dec.w["final_norm"], model.spec.norm_eps))
        res.hessians["lm_head"] = acc.value.cpu()
    return res


def slice_canonicals(refs, shapes: dict) -> dict[tuple[str, int | None], list[str]]:
    """(source tensor, expert / lane index or None) -> the canonical Linears read from that slice. Every canonical
    name of one slice reads the same input (gate and up rows of one expert's fused gate_up, q/k/v rows of a fused
    qkv), so any of their Hessians is the slice's."""
    from .quantizable import resolve_layouts
    out: dict[tuple[str, int | None], list[str]] = {}
    for name, lay in resolve_layouts(refs, shapes).items():
        out.setdefault((lay.hf_name, lay.take[0] if lay.take else None), []).append(name)
    return out


def _slice_key(t, i: int, stacked: bool) -> tuple[str, int | None]:
    if t.layout == "split":
        return t.source, t.take
    return t.source, (i if stacked else None)


def gptq_calibrator(model, refs, scheme, opts: GptqOptions, progress: Callable[[str], None] | None = None):
    """-> calibrate(quantized targets) for quant.convert.convert(gptq=...): runs calibrate_gptq over exactly the
    Linears the converter will quantize and returns hessian(target, slice index, stacked) -> H [in, in] on
    opts.device, or None (round to nearest: an expert no calibration token reached)."""
    shapes = model.weights.source.shapes() if hasattr(model.weights, "source") else None
    by_slice = slice_canonicals(refs, shapes)

    def calibrate(targets):
        want: set[str] = set()
        for t in targets:
            for (src, take), names in by_slice.items():
                if src == t.source and (t.layout != "split" or take == t.take):
                    want.update(names)
        cal = calibrate_gptq(model, scheme, opts.windows, opts.device, None, targets=want.__contains__,
                             damp=opts.damp, progress=progress)

        def hessian(t, i: int, stacked: bool):
            for n in by_slice.get(_slice_key(t, i, stacked), ()):
                h = cal.hessians.get(n)
                if h is not None:
                    return h.to(opts.device)
            return None
        hessian.calibration = cal
        return hessian
    return calibrate
