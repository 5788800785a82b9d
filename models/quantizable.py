"""Which canonical tensors are Linear weights, which of them are fused partners, and the conversion plan built
from that (the family knowledge quant/convert.py is handed; quant/ itself knows only formats).

Classification is by canonical name (models/spec.canonical), so every adapter's tensor_refs is covered by one
table; a family whose adapter exposes `linear_weights(spec)` / `fused_partners(spec)` (Laneformer:
dense/adapter.py) is planned from those instead:

    role            canonical names                                       quantized by default
    attn            layers.i.attn.{q,k,v,o,q_a,q_b,kv_a,kv_b}              yes
    mlp             layers.i.mlp.{gate,up,down}   (dense layers)           yes
    expert          layers.i.moe.experts.e.{gate,up,down}                  yes
    shared_expert   layers.i.moe.shared.{gate,up,down}                     yes
    lm_head         lm_head                                                with --quantize-lm-head
    router          layers.i.moe.router   (HF mlp.gate / router)           never
    shared_gate     layers.i.moe.shared_gate (Qwen2-MoE)                   never
    embed / norm / other (biases, sinks, score bias)                       never (not Linear weights)

Fused partners read the same input and are fused by inference engines into one GEMM, so they share one nvfp4
global scale (vLLM keeps only one): q/k/v of an attention, q_a/kv_a of MLA with q_lora_rank (vLLM's
fused_qkv_a_proj), gate/up of a dense MLP, of each routed expert and of the shared expert.
"""
from __future__ import annotations

import os
import re
import warnings
from typing import Callable, Sequence

from .errors import ConfigError
from .loader import Layout, TensorRef, WeightStore, read_config
from .registry import adapter_for, checked_spec, open_source

__all__ = ["LINEAR_ROLES", "role", "is_linear", "partner_group", "partner_groups", "partner_global", "linear_targets",
           "convert_checkpoint"]

LINEAR_ROLES = ("attn", "mlp", "expert", "shared_expert")

_ROLE_PATTERNS = (
    ("attn", re.compile(r"attn\.(q|k|v|o|q_a|q_b|kv_a|kv_b)")),
    ("mlp", re.compile(r"mlp\.(gate|up|down)")),
    ("expert", re.compile(r"moe\.experts\.\d+\.(gate|up|down)")),
    ("shared_expert", re.compile(r"moe\.shared\.(gate|up|down)")),
    ("router", re.compile(r"moe\.router")),
    ("shared_gate", re.compile(r"moe\.shared_gate")),
)
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_GROUPS = (
    (re.compile(r"(layers\.\d+\.attn)\.(q|k|v)"), r"\1.qkv"),
    (re.compile(r"(layers\.\d+\.attn)\.(q_a|kv_a)"), r"\1.qkv_a"),
    (re.compile(r"(layers\.\d+\.(?:mlp|moe\.shared|moe\.experts\.\d+))\.(gate|up)"), r"\1.gate_up"),
)


def role(canonical: str) -> str:
    """The role of a canonical tensor name (see the module docstring)."""
    if canonical in ("lm_head", "embed"):
        return canonical
    m = _LAYER.fullmatch(canonical)
    rest = m.group(2) if m else canonical
    if m:
        for r, pat in _ROLE_PATTERNS:
            if pat.fullmatch(rest):
                return r
    return "norm" if rest.endswith("norm") else "other"


def is_linear(canonical: str) -> bool:
    """A Linear weight quantized by default (lm_head is one too, but only on request)."""
    return role(canonical) in LINEAR_ROLES


def partner_group(canonical: str) -> str | None:
    """Name of the fused-partner group (e.g. "layers.3.attn.qkv", "layers.1.moe.experts.7.gate_up"), or None."""
    for pat, repl in _GROUPS:
        if pat.fullmatch(canonical):
            return pat.sub(repl, canonical)
    return None


def partner_groups(names) -> dict[str, list[str]]:
    """Fused-partner group -> its members among `names` (in their order); names without a group are left out."""
    groups: dict[str, list[str]] = {}
    for n in names:
        if (g := partner_group(n)) is not None:
            groups.setdefault(g, []).append(n)
    return groups


def partner_global(members: Sequence[str], weight_of: Callable):
    """The nvfp4 global scale a group's quantized members share (kie convert's rule, quant/convert.py
    _Converter.group_global): quant.schemes.shared_global_scale over their weights; None for a group of one
    (it takes its own). `members`: those the scheme will quantize; weight_of(name) -> [out, in] weight."""
    from kie_moe.quant.schemes import shared_global_scale
    if len(members) < 2:
        return None
    return shared_global_scale([weight_of(m).float() for m in members], list(members))


def resolve_layouts(refs: Sequence[TensorRef], shapes: dict) -> dict[str, Layout]:
    """canonical name -> the layout present in the checkpoint (first present wins, as in WeightStore)."""
    out = {}
    for ref in refs:
        for lay in ref.layouts:
            if lay.hf_name in shapes:
                out[ref.name] = lay
                break
    return out


def _per_expert_alternative(ref: TensorRef, fused: str) -> Layout | None:
    """The per-expert 2-D `.weight` layout a fused v5 tensor's slice can be written as: the ref's alternative
    with no indexing, preferring the one that shares the longest prefix with the fused tensor's name."""
    alts = [l for l in ref.layouts if not l.take and not l.transpose and l.rows is None and l.hf_name.endswith(".weight")]
    return max(alts, key=lambda l: len(os.path.commonprefix([l.hf_name, fused])), default=None)


def linear_targets(spec, refs: Sequence[TensorRef], shapes: dict, adapter=None):
    """The LinearTargets of a checkpoint whose (logical) tensor shapes are `shapes`: one per Linear module to
    write (routers and shared-expert gates are not listed: they are never quantized)."""
    from kie_moe.quant.convert import LinearTarget

    lays = resolve_layouts(refs, shapes)
    lane_names = set(adapter.linear_weights(spec)) if hasattr(adapter, "linear_weights") else None
    lane_groups = {}
    if hasattr(adapter, "fused_partners"):
        for grp in adapter.fused_partners(spec):
            lane_groups.update({hf: grp[0] for hf in grp})
    by_hf: dict[str, list[tuple[TensorRef, Layout, str]]] = {}
    for ref in refs:
        lay, r = lays.get(ref.name), role(ref.name)
        if lay is None or r not in LINEAR_ROLES + ("lm_head",):
            continue
        if lane_names is not None and r != "lm_head" and lay.hf_name not in lane_names:
            continue
        by_hf.setdefault(lay.hf_name, []).append((ref, lay, r))

    targets = []
    for hf, members in by_hf.items():
        ref, lay, r = members[0]
        group = lane_groups.get(hf) if lane_names is not None else partner_group(ref.name)
        if len(members) == 1 and not lay.take and not lay.transpose and lay.rows is None:
            if hf.endswith(".weight"):
                targets.append(LinearTarget(hf, hf[: -len(".weight")], r, "linear", group))
        elif all(l.transpose and len(l.take) == 1 for _, l, _ in members) and len(shapes[hf]) == 3:
            # gpt-oss [E, in, out]: one stacked parameter; each expert's own nvfp4 global covers its gate and up
            targets.append(LinearTarget(hf, hf, r, "xw"))
        elif all(not l.transpose and len(l.take) == 1 and (l.rows is None or isinstance(l.rows, tuple))
                 for _, l, _ in members) and _covers(members, shapes[hf]):
            pieces = []
            for ref_m, l, r_m in members:
                alt = _per_expert_alternative(ref_m, hf)
                if alt is None:
                    break
                pieces.append(LinearTarget(hf, alt.hf_name[: -len(".weight")], r_m, "split", partner_group(ref_m.name),
                                           take=l.take[0], rows=l.rows))
            else:
                targets += pieces
        # anything else (a layout nothing here can name as a module) is copied as stored
    return targets


def _covers(members, shape) -> bool:
    """Do the per-expert slices of a fused [E, R, in] tensor cover all of it (so nothing is lost by writing the
    slices instead of the tensor)?"""
    E, R = shape[0], shape[1]
    rows: dict[int, list[tuple[int, int]]] = {}
    for _, l, _ in members:
        rows.setdefault(l.take[0], []).append(l.rows or (0, R))
    if sorted(rows) != list(range(E)):
        return False
    for spans in rows.values():
        end = 0
        for a, b in sorted(spans):
            if a != end:
                return False
            end = b
        if end != R:
            return False
    return True


def convert_checkpoint(src: str, dst: str, scheme: str, *, force: bool = False, experts_only: bool = False,
                       ignore: Sequence[str] = (), quantize_lm_head: bool = False, progress: bool = True,
                       on_warning: Callable[[str], None] | None = None, observer: str = "minmax",
                       gptq=None, on_progress: Callable[[str], None] | None = None):
    """`kie convert`: plan the Linear targets of the checkpoint at `src` from its family adapter and write the
    quantized checkpoint to `dst` (quant.convert.convert does the writing). observer: how the fp4 schemes pick
    their scales (quant.schemes.with_observer); gptq: models.calibrate.GptqOptions to choose the codes by GPTQ
    over calibration text (on_progress hears each calibrated layer). -> quant.convert.ConvertReport."""
    from kie_moe.quant.convert import QuantizationWarning, check_destination, convert
    from kie_moe.quant.schemes import with_observer
    from .errors import InputError

    try:
        scheme = with_observer(scheme, observer)  # before touching any file
    except ValueError as e:
        raise InputError(str(e)) from None
    cfg = read_config(src)
    check_destination(src, dst, force)
    path = os.path.join(src, "config.json")
    adapter = adapter_for(cfg.get("model_type"), path)
    spec = checked_spec(adapter, cfg, path)
    source = open_source(src, cfg)
    refs = adapter.tensor_refs(spec)
    ignore_fn = adapter.ignore(spec) if hasattr(adapter, "ignore") else (lambda n: False)
    store = WeightStore(source, refs, ignore_fn)  # validates every name and shape against config.json; reads nothing
    targets = linear_targets(spec, refs, source.shapes(), adapter)
    if quantize_lm_head and not any(t.role == "lm_head" for t in targets):
        msg = "--quantize-lm-head: lm_head is tied to the embeddings (tie_word_embeddings), nothing to quantize"
        on_warning(msg) if on_warning is not None else warnings.warn(msg, QuantizationWarning, stacklevel=2)
    if not targets:
        raise ConfigError(f"{path}: found no Linear weights to quantize in {src}")
    calibrate = None
    if gptq is not None:
        from .calibrate import gptq_calibrator
        from .registry import LoadedModel
        if hasattr(adapter, "reference_decoder") or hasattr(adapter, "linear_weights"):
            raise InputError(f"kie convert --gptq: {spec.family} checkpoints ({path}) are not supported (their "
                             "decoder is not the reference decoder GPTQ calibrates through); convert without --gptq")
        calibrate = gptq_calibrator(LoadedModel(src, cfg, spec, store), refs, scheme, gptq, on_progress)
    return convert(source, cfg, dst, scheme, targets, force=force, experts_only=experts_only, ignore=ignore,
                   quantize_lm_head=quantize_lm_head, progress=progress, on_warning=on_warning,
                   gptq=calibrate)
