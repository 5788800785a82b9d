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
streams of every window, every solved Linear's codes, and the Hessians still needed after calibration (only for
slices the converter solves again: fused qkv, gpt-oss's [E, in, out], quantized sources; one [in, in] float32 per
distinct Linear input) on the host. Routed experts run batched per expert (ReferenceDecoder.group_experts): the
embedded demo model calibrates 16k tokens in ~12 s on 2 CPU cores. Models that fit a GPU in bf16 want --device
cuda; larger ones would need a per-layer streaming pipeline, which this is not.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from .quantizable import is_linear, partner_global, partner_group, partner_groups
from .spec import canonical

__all__ = ["Calibration", "GptqOptions", "calibrate_gptq", "gptq_calibrator"]


@dataclass(frozen=True, eq=False)
class GptqOptions:
    """`kie convert --gptq`: windows [n, S] calibration token ids (kie_moe.heldout.calibration_windows), where the
    calibration and the GPTQ solves run, the dampening fraction, and where the windows came from (for messages)."""
    windows: torch.Tensor
    device: str = "cpu"
    damp: float = 0.01
    label: str = ""

    def fingerprint(self) -> str:
        """sha1 of the calibration token windows and the dampening: what makes two GPTQ conversions of one source
        differ (cache keys of kie sweep and kie demo)."""
        h = hashlib.sha1(self.windows.numpy().tobytes())
        h.update(repr(self.damp).encode())
        return h.hexdigest()


@dataclass
class Calibration:
    """hessians: canonical Linear name -> H [in, in] float32 (host; only where `keep_hessian` asked: fused partners
    share one tensor); solved: canonical name -> its GPTQ codes and scales (host QuantizedTensor), as the layers
    above were calibrated against; tokens: calibration tokens run; unseen: Linears whose input no calibration token
    reached (rounded to nearest)."""
    hessians: dict[str, torch.Tensor] = field(default_factory=dict)
    solved: dict = field(default_factory=dict)
    tokens: int = 0
    unseen: list[str] = field(default_factory=list)


def _global_scales(w: dict, names: list[str], scheme) -> dict[str, torch.Tensor | None]:
    """nvfp4: one global scale per fused-partner group of the Linears that will be quantized (`names`: those the
    scheme can hold), as the converter shares it (models.quantizable.partner_global)."""
    out: dict[str, torch.Tensor | None] = {n: None for n in names}
    if scheme.name == "nvfp4":
        for members in partner_groups(names).values():
            g = partner_global(members, w.__getitem__)
            out.update({m: g for m in members})
    return out


@torch.no_grad()
def calibrate_gptq(model, scheme, windows: torch.Tensor, device: "str | torch.device" = "cpu",
                   dtype: torch.dtype | None = None, targets: Callable[[str], bool] = is_linear,
                   damp: float | None = None, progress: Callable[[str], None] | None = None,
                   keep_hessian: Callable[[str], bool] = lambda n: True) -> Calibration:
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
    damp = DEFAULT_DAMP if damp is None else damp
    dev = torch.device(device)
    dec = ReferenceDecoder(model.spec, model.weights, dev, dtype)
    if type(dec).layer is not ReferenceDecoder.layer:
        raise TypeError(f"{model.spec.family}: GPTQ calibration needs the plain reference decoder")
    dec.group_experts = True       # each expert's Hessian from one [tokens, in] batch
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
        fits = []
        for n in names:
            try:
                check_shape(sch, tuple(dec.w[n].shape), n)
                fits.append(n)
            except NotQuantizable:
                pass                                  # the converter keeps it in float too
        globals_ = _global_scales(dec.w, fits, sch)
        host: dict[str, torch.Tensor] = {}
        for n in names:
            h = acc[key[n]].value
            if h is None:
                res.unseen.append(n)
            elif keep_hessian(n):
                res.hessians[n] = host.setdefault(key[n], h.cpu())
            if n not in globals_:
                continue
            # the stored weight in float32, not the decoder's copy (bf16 on a GPU): the codes kept in `solved` are
            # then the ones the converter would choose for the same slice
            q = gptq_quantize(model.weights.get(n).to(dev, torch.float32), h, sch, globals_[n], name=n, damp=damp)
            if h is not None:
                res.solved[n] = _on_host(q)
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
        if keep_hessian("lm_head"):
            res.hessians["lm_head"] = acc.value.cpu()
        try:
            check_shape(sch, tuple(dec.w["lm_head"].shape), "lm_head")
            res.solved["lm_head"] = _on_host(gptq_quantize(model.weights.get("lm_head").to(dev, torch.float32),
                                                           acc.value, sch, name="lm_head", damp=damp))
        except NotQuantizable:
            pass
    return res


def _on_host(q):
    """A QuantizedTensor with its tensors moved to the host (the converter writes from there)."""
    from kie_moe.quant.schemes import QuantizedTensor
    return QuantizedTensor(q.scheme, {k: v.cpu() for k, v in q.tensors.items()}, q.shape, q.dtype)


def _slice_maps(refs, shapes: dict) -> tuple[dict[tuple, list[str]], dict[tuple, str]]:
    """-> (by_slice, exact).
    by_slice: (source tensor, expert / lane index or None) -> the canonical Linears read from that slice. Every
    canonical name of one slice reads the same input (gate and up rows of one expert's fused gate_up, q/k/v rows of
    a fused qkv), so any of their Hessians is the slice's.
    exact: (source tensor, expert index or None, rows) -> the one canonical Linear that IS that slice, untransposed
    (a per-expert module, an unfused q_proj, one expert's gate rows of a fused gate_up): its calibration codes can
    be written as they are. Slices holding several canonicals (fused qkv, gpt-oss's interleaved gate/up) are not
    listed: they are solved again from the Hessian."""
    from .quantizable import resolve_layouts
    by_slice: dict[tuple, list[str]] = {}
    seen: dict[tuple, list[str]] = {}
    for name, lay in resolve_layouts(refs, shapes).items():
        idx = lay.take[0] if lay.take else None
        by_slice.setdefault((lay.hf_name, idx), []).append(name)
        if not lay.transpose and len(lay.take) <= 1:
            seen.setdefault((lay.hf_name, idx, lay.rows), []).append(name)
    return by_slice, {k: v[0] for k, v in seen.items() if len(v) == 1}


def _stack(t, shapes: dict) -> int | None:
    """How many stacked slices (experts) LinearTarget t converts one by one, or None for a single Linear."""
    out_shape = t.out_shape(shapes[t.source])
    return out_shape[0] if t.layout != "split" and len(out_shape) == 3 else None


def _slice_keys(t, i: int, stacked: bool) -> tuple[tuple, tuple]:
    """Slice i of LinearTarget t -> (its key in by_slice, its key in exact) (_slice_maps)."""
    if t.layout == "split":
        return (t.source, t.take), (t.source, t.take, t.rows)
    idx = i if stacked else None
    return (t.source, idx), (t.source, idx, None)


def gptq_calibrator(model, refs, scheme, opts: GptqOptions, progress: Callable[[str], None] | None = None):
    """-> calibrate(quantized targets) for quant.convert.convert(gptq=...). It runs calibrate_gptq over exactly the
    Linears the converter will quantize and returns solve(target, slice index, weight, global scale, name): a slice
    that is one canonical Linear gets the codes calibration already chose for it (the very weight, Hessian and
    scales: solving again would repeat the work); any other slice is solved from its Hessian on opts.device (kept
    for those slices only); None where no calibration token reached it (round to nearest)."""
    from kie_moe.quant.gptq import gptq_quantize
    shapes = model.weights.source.shapes()
    by_slice, exact = _slice_maps(refs, shapes)
    if hasattr(model.weights.source, "read_quantized"):
        # an already quantized source: the store dequantizes to bf16, the converter to float32, so calibration's
        # codes are for other weights than the converter's: solve every slice again from its Hessian
        exact = {}

    def calibrate(targets):
        want: set[str] = set()
        need_h: set[str] = set()
        for t in targets:
            n = _stack(t, shapes)
            for i in range(1 if n is None else n):
                coarse, fine = _slice_keys(t, i, n is not None)
                names = by_slice.get(coarse, ())
                want.update(names)
                if fine not in exact:
                    need_h.update(names)
        cal = calibrate_gptq(model, scheme, opts.windows, opts.device, None, targets=want.__contains__,
                             damp=opts.damp, progress=progress, keep_hessian=need_h.__contains__)

        def solve(t, i: int, w: torch.Tensor, g, name: str):
            coarse, fine = _slice_keys(t, i, _stack(t, shapes) is not None)
            if fine in exact:
                q = cal.solved.get(exact[fine])
                if q is None:
                    return None                       # unseen: round to nearest
                same_global = g is None or torch.equal(q.tensors["weight_global_scale"].reshape(g.shape), g)
                if q.shape != tuple(w.shape) or not same_global:
                    raise RuntimeError(f"{name}: GPTQ calibration solved {exact[fine]} with shape {q.shape} or an "
                                       "nvfp4 global scale other than the converter's (a bug: please report it)")
                return q
            for n in by_slice.get(coarse, ()):
                h = cal.hessians.get(n)
                if h is not None:
                    return gptq_quantize(w, h.to(opts.device), scheme, g, name=name, damp=opts.damp)
            return None
        return solve
    return calibrate
