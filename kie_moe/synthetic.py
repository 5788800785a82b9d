"""Models for bench / sweep / preview: a checkpoint directory, or a preset ARCH built straight into device memory
(models/synth: real shapes, random weights, no disk), optionally quantized in memory (QuantizingStore).

QuantizingStore is what a converted checkpoint would give the backends, without writing one: the graph backend
and the monokernel ask `quantized_tensor(name)` (kernels/weights.stored_codes) and stream the codes + scales; any
reader of `get(name)` (the reference backend, float weights of the GPU backends, every prefill) gets the scheme's
*dequantized* values, so quality numbers are the scheme's even where the bytes streamed are still bf16 (bench
labels that case).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from kie_moe.models.errors import InputError

# Which canonical tensors are quantized Linear weights. Mirrors the converter's table (models/quantizable.role:
# attn q/k/v/o/q_a/q_b/kv_a/kv_b, dense mlp, routed and shared experts); routers, the shared-expert gate,
# embeddings, norms, biases and lm_head stay in float (DESIGN.md §4). tests/test_bench.py checks the two agree.
_LINEAR = re.compile(r"layers\.\d+\.(attn\.(q|k|v|o|q_a|q_b|kv_a|kv_b)|mlp\.(gate|up|down)|"
                     r"moe\.experts\.\d+\.(gate|up|down)|moe\.shared\.(gate|up|down))")
SCHEMES = ("bf16", "fp8", "fp8-block", "nvfp4", "mxfp4")


def is_quantized_linear(canonical: str, lm_head: bool = False) -> bool:
    """Whether `canonical` is a Linear weight kie convert quantizes (lm_head only with --quantize-lm-head)."""
    return _LINEAR.fullmatch(canonical) is not None or (lm_head and canonical == "lm_head")


def check_scheme(scheme: str, where: str = "--scheme") -> str:
    if scheme not in SCHEMES:
        raise InputError(f"{where}: unknown scheme {scheme!r} (choose from {', '.join(SCHEMES)})")
    return scheme


class QuantizingStore:
    """WeightStore-like wrapper: Linear weights quantized to `scheme` on their own device, on request.

    Nothing is cached: the graph backend keeps the codes it asked for (stacked per expert), and caching here too
    would hold a second quantized copy (30 GB for qwen3-30b-a3b in fp8) next to the bf16 original."""

    def __init__(self, store, scheme: str, lm_head: bool = False):
        self.store, self.scheme, self.lm_head = store, check_scheme(scheme), lm_head
        self.path = getattr(store, "path", "<memory>")
        self._groups: dict[str, list[str]] | None = None     # partner group -> its quantized Linears (nvfp4)
        self._globals: dict[str, torch.Tensor | None] = {}

    def names(self):
        return self.store.names()

    def __contains__(self, n):
        return n in self.store

    def _quantize(self, n, w):
        """QuantizedTensor of `w`, or None where the format cannot hold its shape (e.g. nvfp4 needs in % 16 == 0):
        such weights stay in float, as kie convert keeps them (roofline.weight_bytes counts them so too)."""
        from kie_moe.quant.schemes import NotQuantizable, quantize
        try:
            return quantize(w, self.scheme, self._group_global(n), name=n)
        except NotQuantizable:
            return None

    def _group_global(self, n):
        """nvfp4: the global scale n shares with its fused partners (q/k/v, an expert's gate/up), as kie convert
        writes it (models.quantizable.partner_global over the partners the scheme can hold); None for other
        schemes and for Linears without partners."""
        from kie_moe.models.quantizable import partner_global, partner_group, partner_groups
        from kie_moe.quant.schemes import NotQuantizable, get_scheme
        if self.scheme != "nvfp4" or (key := partner_group(n)) is None:
            return None
        if self._groups is None:
            self._groups = partner_groups(m for m in self.store.names() if is_quantized_linear(m, self.lm_head))
        if key not in self._globals:
            held = {}
            for m in self._groups.get(key, []):
                w = self.store.get(m)
                try:
                    get_scheme("nvfp4").check(tuple(w.shape), m)
                    held[m] = w
                except NotQuantizable:
                    pass
            self._globals[key] = partner_global(list(held), held.__getitem__)
        return self._globals[key]

    def quantized_tensor(self, n):
        if self.scheme == "bf16" or not is_quantized_linear(n, self.lm_head):
            return None
        return self._quantize(n, self.store.get(n))

    def get(self, n):
        w = self.store.get(n)
        if self.scheme == "bf16" or not is_quantized_linear(n, self.lm_head):
            return w
        q = self._quantize(n, w)
        return w if q is None else q.dequantize(w.dtype)


@dataclass
class Source:
    """What MODEL named: a checkpoint directory or a preset, and the scheme its Linear weights are in."""
    model: object                # registry.LoadedModel
    kind: str                    # "checkpoint" | "synthetic"
    name: str                    # the directory, or the preset name (+ " (tiny)")
    scheme: str                  # bf16 (float), or the quantization scheme
    scheme_of: object            # canonical name -> scheme of that tensor ("bf16" for float)
    note: str = ""


# `demo` names the embedded demo model (kie_moe/demo.py's DEFAULT_MODEL is this path) unless a directory of that name exists here
EMBEDDED_DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "demo-moe")


def resolve_model(model: str) -> str:
    return EMBEDDED_DEMO if model == "demo" and not os.path.exists(model) else model


def is_checkpoint_dir(model: str) -> bool:
    return os.path.isdir(model) and os.path.exists(os.path.join(model, "config.json"))


def checkpoint_schemes(cfg: dict, spec, refs) -> tuple[str, dict]:
    """(scheme, {canonical: scheme}) of a checkpoint's Linear weights, from its config.json. A float checkpoint:
    ("bf16", {}). compressed-tensors: per module (its own matching rules); native FP8 block: fp8-block; gpt-oss
    native MXFP4: its experts. Bytes of anything else are counted as float."""
    qc = cfg.get("quantization_config")
    if not qc:
        return "bf16", {}
    method = qc.get("quant_method", "compressed-tensors")
    per: dict[str, str] = {}
    for r in refs:                      # lm_head too: `kie convert --quantize-lm-head` may have quantized it
        if r.optional or not is_quantized_linear(r.name, lm_head=True):
            continue
        hf = r.layouts[0].hf_name
        if method == "compressed-tensors":
            from kie_moe.quant.ct_format import module_scheme
            prefix = hf[:-len(".weight")] if hf.endswith(".weight") else hf
            s = module_scheme(cfg, prefix)
        elif method == "fp8":
            s = "fp8-block"
        elif method == "mxfp4":
            s = "mxfp4" if ".experts." in r.name else None
        else:
            s = None
        if s:
            per[r.name] = s
    found = sorted(set(per.values()))
    return (found[0] if len(found) == 1 else "+".join(found) or "bf16"), per


def open_model(model: str, device: torch.device, *, scheme: str = "bf16", tiny: bool = False,
               dtype: torch.dtype | None = None, seed: int = 0, quantize_lm_head: bool = False) -> Source:
    """MODEL (a checkpoint directory or a preset name) -> Source. Presets are built on `device` in `dtype`
    (default bf16); `scheme` quantizes float Linear weights in memory (a quantized checkpoint must not be
    quantized again: its own scheme is reported instead), and the lm_head too with quantize_lm_head (as
    `kie convert --quantize-lm-head` would)."""
    from kie_moe.models.registry import LoadedModel, adapter_for, load_model
    check_scheme(scheme)
    if quantize_lm_head and scheme == "bf16":
        raise InputError("--quantize-lm-head needs a quantization --scheme (fp8, fp8-block, nvfp4, mxfp4)")
    model = resolve_model(model)
    if is_checkpoint_dir(model):
        if tiny:
            raise InputError(f"--tiny applies to a preset ARCH, not to the checkpoint directory {model}")
        m = load_model(model)
        refs = adapter_for(m.spec.family).tensor_refs(m.spec)
        ck, per = checkpoint_schemes(m.config, m.spec, refs)
        if ck != "bf16":
            if quantize_lm_head:
                raise InputError(f"{model}/config.json: the checkpoint is already {ck}; its lm_head is as converted "
                                 f"(kie convert --quantize-lm-head), --quantize-lm-head cannot change it")
            if scheme not in ("bf16", ck):
                raise InputError(f"{model}/config.json: the checkpoint is already {ck}; --scheme {scheme} would "
                                 f"quantize it twice (leave --scheme out)")
            return Source(m, "checkpoint", model, ck, lambda n: per.get(n, "bf16"))
        if scheme != "bf16":
            _check_head(m.spec, model, quantize_lm_head)
            m = LoadedModel(m.path, m.config, m.spec, QuantizingStore(m.weights, scheme, quantize_lm_head))
        return Source(m, "checkpoint", model, scheme, _scheme_fn(scheme, quantize_lm_head))
    if os.path.exists(model):
        raise InputError(f"{model}: not a checkpoint directory (no config.json there)")
    from kie_moe.models.presets import preset_names
    if model not in preset_names():
        raise InputError(f"{model!r} is neither a checkpoint directory nor a preset "
                         f"(presets: {', '.join(preset_names())})")
    from kie_moe.models.synth import synth_weights_on_device
    spec, store = synth_weights_on_device(model, device, dtype or torch.bfloat16, tiny=tiny, seed=seed,
                                          lazy=_too_big_to_hold(model, device, dtype or torch.bfloat16, tiny))
    name = model + (" (tiny)" if tiny else "")
    _check_head(spec, name, quantize_lm_head)
    w = QuantizingStore(store, scheme, quantize_lm_head) if scheme != "bf16" else store
    return Source(LoadedModel(f"<synthetic {name}>", {}, spec, w), "synthetic", name, scheme,
                  _scheme_fn(scheme, quantize_lm_head),
                  "random weights with the preset's shapes, built on the device"
                  + ("; lm_head quantized too" if quantize_lm_head else ""))


def _check_head(spec, name: str, quantize_lm_head: bool) -> None:
    if quantize_lm_head and getattr(spec, "tie_word_embeddings", False):
        raise InputError(f"--quantize-lm-head: {name} ties its lm_head to the embedding (tie_word_embeddings); "
                         f"there is no separate lm_head to quantize")


def _too_big_to_hold(preset: str, device: torch.device, dtype: torch.dtype, tiny: bool) -> bool:
    """True when the preset's float weights would take over half of the device's free memory: then they are drawn
    tensor by tensor when read (models.synth.SynthSource) and only what a backend packs stays resident."""
    if device.type != "cuda" or tiny:
        return False
    from kie_moe.models.presets import preset as preset_config
    from kie_moe.models.registry import spec_from_config
    from kie_moe.models.synth import count_params
    total, _ = count_params(spec_from_config(preset_config(preset)))
    free, _ = torch.cuda.mem_get_info(device)
    return total * torch.finfo(dtype).bits // 8 > free // 2


def _scheme_fn(scheme: str, lm_head: bool = False):
    return lambda n: scheme if (scheme != "bf16" and is_quantized_linear(n, lm_head)) else "bf16"
