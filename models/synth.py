"""Synthetic checkpoints: a real architecture's config.json and tensor shapes, random weights.

The tensor list is never written down here: it comes from the family adapter's `tensor_refs(spec)`, the same
list the loader validates against, so a synthetic checkpoint cannot drift from what `load_model` expects. Of
each ref we write its first layout (the layout real checkpoints on the Hub use); refs that point into one fused
HF tensor (gpt-oss `experts.gate_up_proj`) write that tensor once; optional refs (lm_head of a tied model) are
not written.

Memory: shards are planned from the shapes before any weight exists, then every tensor is generated in chunks
of `_CHUNK_ELEMS` elements (a few threads drawing ahead of the writer) and streamed into its shard file, so
writing a 600 GB checkpoint holds `workers + 1` chunks (32 MB each in bf16), never a shard, let alone the model.
The safetensors files are written by hand (8-byte header length, JSON header, raw little-endian data; the loader
and the safetensors library read them back in the tests) because `safetensors.torch.save_file` needs every
tensor of a shard in memory at once.

Values are deterministic: chunk j of tensor `hf_name` is drawn from a generator seeded with hash(seed, hf_name,
j), so values do not depend on the order of tensors, on `shard_bytes`, on the number of threads, or on which
other tensors exist. `synth_weights_on_device(..., device="cpu")` therefore returns exactly the weights `write_synthetic` writes; on
CUDA the generator differs, so values differ (same distribution, still deterministic per seed).

Initialisation, chosen so a random model decodes sanely in bf16 (no inf/NaN, non-flat logits, spread routing):
  norms (RMSNorm weights)     1 (q_norm / k_norm of GQA: 2, see _QK_GAIN)
  Linear weights [out, in]    N(0, 1/in): every projection keeps the activation scale; GQA q and k 4x that
                              variance, so attention is peaked and tokens (and their routing) stay distinct
  output projections          N(0, 1/(in * 2 * num_layers)): attn.o and every down projection, so the residual
                              stream grows ~sqrt(2) over the whole model, not per layer (GPT-2 style)
  embeddings [V, D]           N(0, 1/D): with a normalised final hidden state, logits have std ~1 whether the
                              head is tied or not
  routers [E, D]              N(0, 1/D): logits std ~1, so top-k picks vary from token to token
  biases, score bias          N(0, 0.02^2); DeepSeek-V3's e_score_correction_bias is float32 as in the real files
  attention sinks             N(0, 0.5^2): per-head logits of the order of a score
"""
from __future__ import annotations

import hashlib
import math
import json
import os
import re
import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import torch

from .errors import ConfigError
from .loader import DictSource, Layout, TensorRef, WeightStore
from . import presets as _presets
from .registry import adapter_for, checked_spec
from .spec import ModelSpec

# Elements generated per step. Part of the value stream (see module docstring): changing it changes the weights.
_CHUNK_ELEMS = 1 << 24

_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64"}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32", torch.float64: "float64"}


@dataclass(frozen=True)
class SynthTensor:
    """One HF tensor to write: name, shape, dtype and how to initialise it."""
    hf_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    init: str                         # "const": every element = scale | "normal": N(0, scale^2)
    scale: float = 0.0
    canonical: str = ""               # first canonical tensor that reads it (for messages)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


# ---- config -> spec -> tensor plan ----------------------------------------------------------------------------

def resolve_config(arch_or_config, tiny: bool = False) -> tuple[str, dict]:
    """A preset name or a config.json dict -> (display name, config dict copy)."""
    if isinstance(arch_or_config, dict):
        if tiny:
            raise ConfigError("tiny=True needs a preset name, not a config dict")
        return str(arch_or_config.get("model_type", "config")), json.loads(json.dumps(arch_or_config))
    if not isinstance(arch_or_config, str):
        raise ConfigError(f"expected a preset name or a config.json dict, got {type(arch_or_config).__name__}")
    return arch_or_config, (_presets.tiny(arch_or_config) if tiny else _presets.preset(arch_or_config))


def build(cfg: dict, path: str = "config.json"):
    """config dict -> (adapter module, ModelSpec)."""
    adapter = adapter_for(cfg.get("model_type"), path)
    return adapter, checked_spec(adapter, cfg, path)


_OUTPUT_PROJ = re.compile(r"(^|\.)(attn\.o|down)$")


# Attention sharpness: q and k of GQA attention are scaled so raw scores have std ~_QK_GAIN**2 = 4 instead of 1.
# With std-1 scores softmax is nearly flat, every position outputs about the running mean of v, and with depth all
# tokens' hidden states converge (mean cosine 0.86 after 24 layers of a Qwen3 shape) and so does their routing
# (one expert taking every token). Peaked attention, as in trained models, keeps tokens apart (cosine ~0.4).
# MLA needs nothing: its YaRN mscale^2 already sharpens the scores.
_QK_GAIN = 2.0
_LAYER = re.compile(r"^layers\.(\d+)\.")


def _init_for(ref: TensorRef, lay: Layout, spec: ModelSpec, dtype: torch.dtype) -> tuple[str, float, torch.dtype]:
    """-> (init, scale, dtype) of the HF tensor behind `ref`'s first layout."""
    leaf = ref.name.rsplit(".", 1)[-1]
    m = _LAYER.match(ref.name)
    gqa = m is not None and spec.layers[int(m.group(1))].attn.kind == "gqa"
    if gqa and ref.name.endswith(("attn.q_norm", "attn.k_norm")):
        return "const", _QK_GAIN, dtype                          # q/k are normalised: the gain goes here
    if leaf.endswith("norm"):                                     # attn_norm, final_norm, q_a_norm, kv_a_norm
        return "const", 1.0, dtype
    if leaf == "score_bias":
        return "normal", 0.02, torch.float32
    if leaf.endswith("bias"):
        return "normal", 0.02, dtype
    if leaf == "sinks":
        return "normal", 0.5, dtype
    if ref.name in ("embed", "lm_head"):
        return "normal", spec.hidden_size ** -0.5, dtype
    if len(lay.hf_shape) - len(lay.take) < 2:
        raise ConfigError(f"synth: no initialisation rule for 1-D tensor {lay.hf_name} ({ref.name}); "
                          f"add one to models/synth.py")
    std = lay.shape()[-1] ** -0.5  # canonical tensors are [out, in]
    if _OUTPUT_PROJ.search(ref.name):
        std /= (2 * spec.num_layers) ** 0.5
    if gqa and ref.name.endswith(("attn.q", "attn.k")):
        std *= _QK_GAIN
    return "normal", std, dtype


def plan_tensors(spec: ModelSpec, refs: list[TensorRef], dtype: torch.dtype = torch.bfloat16) -> list[SynthTensor]:
    """The HF tensors a checkpoint of `spec` holds, in adapter order, each once."""
    out: dict[str, SynthTensor] = {}
    for ref in refs:
        if ref.optional:
            continue
        lay = ref.layouts[0]
        prev = out.get(lay.hf_name)
        if prev is not None:                                      # another view of a fused tensor
            if prev.shape != tuple(lay.hf_shape):
                raise ConfigError(f"synth: {lay.hf_name} is read as {list(prev.shape)} by {prev.canonical} "
                                  f"and as {list(lay.hf_shape)} by {ref.name}")
            continue
        init, scale, dt = _init_for(ref, lay, spec, dtype)
        out[lay.hf_name] = SynthTensor(lay.hf_name, tuple(lay.hf_shape), dt, init, scale, ref.name)
    return list(out.values())


def plan_shards(tensors: list[SynthTensor], shard_bytes: int) -> list[list[SynthTensor]]:
    """Greedy in order: a shard closes before the tensor that would take it past `shard_bytes`; a tensor larger
    than `shard_bytes` gets a shard of its own (as transformers' save_pretrained does)."""
    if shard_bytes <= 0:
        raise ConfigError(f"synth: shard_bytes must be positive, got {shard_bytes}")
    shards: list[list[SynthTensor]] = []
    cur: list[SynthTensor] = []
    size = 0
    for t in tensors:
        if cur and size + t.nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    if cur:
        shards.append(cur)
    return shards


# ---- values ---------------------------------------------------------------------------------------------------

def _tensor_seed(seed: int, hf_name: str) -> int:
    h = hashlib.blake2b(f"{seed}\0{hf_name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def _n_chunks(t: SynthTensor) -> int:
    return max(1, -(-t.numel // _CHUNK_ELEMS))


def _chunk(t: SynthTensor, seed: int, j: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Chunk j (1-D, t.dtype, on `device`, at most _CHUNK_ELEMS elements) of tensor `t`. Every chunk has its own
    generator, so chunks can be drawn in any order and in parallel with the same result."""
    n = min(_CHUNK_ELEMS, t.numel - j * _CHUNK_ELEMS)
    if t.init == "const":
        return torch.full((n,), t.scale, dtype=t.dtype, device=device)
    g = torch.Generator(device=device)
    g.manual_seed(_tensor_seed(seed, f"{t.hf_name}#{j}"))
    return torch.empty(n, dtype=t.dtype, device=device).normal_(0.0, t.scale, generator=g)


def _ordered(pool, fn, items, window: int) -> Iterator:
    """fn(*item) for each item, in order, computed by `pool` at most `window` ahead of the consumer (so at most
    window + 1 results exist at once)."""
    pending: deque = deque()
    for it in items:
        pending.append(pool.submit(fn, *it))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def materialize(t: SynthTensor, seed: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """The whole tensor, filled chunk by chunk (same values as the file writer on the same device type)."""
    out = torch.empty(t.numel, dtype=t.dtype, device=device)
    for j in range(_n_chunks(t)):
        c = _chunk(t, seed, j, device)
        out[j * _CHUNK_ELEMS:j * _CHUNK_ELEMS + c.numel()] = c
    return out.view(t.shape)


# ---- files ----------------------------------------------------------------------------------------------------

def _shard_header(tensors: list[SynthTensor]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for t in tensors:
        header[t.hf_name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)                     # safetensors pads the header so the data is 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _write_shard(path: str, tensors: list[SynthTensor], seed: int, pool, window: int, bar) -> None:
    tmp = path + ".partial"
    items = [(t, seed, j) for t in tensors for j in range(_n_chunks(t))]
    with open(tmp, "wb") as f:
        f.write(_shard_header(tensors))
        for c in _ordered(pool, _chunk, items, window):
            f.write(memoryview(c.view(torch.uint8).numpy()))          # raw little-endian bytes, no copy
            if bar is not None:
                bar.update(c.numel() * c.element_size())
    os.replace(tmp, path)


_OURS = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors(\.partial)?|model\.safetensors\.index\.json|"
                   r"config\.json|generation_config\.json)$")


def _prepare_dir(out_dir: str, overwrite: bool) -> None:
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{out_dir}: cannot create the directory ({e.strerror}: {e.filename})") from None
    present = [f for f in os.listdir(out_dir) if f.endswith((".safetensors", ".safetensors.index.json")) or f == "config.json"]
    if present and not overwrite:
        raise ConfigError(f"{out_dir}: already holds a checkpoint ({', '.join(sorted(present)[:3])}); "
                          f"pass --force (overwrite=True) to replace it")
    if present:
        strangers = [f for f in present if not _OURS.match(f)]
        if strangers:
            raise ConfigError(f"{out_dir}: holds files a synthetic checkpoint would not write "
                              f"({', '.join(sorted(strangers)[:3])}); refusing to overwrite")
        for f in os.listdir(out_dir):
            if _OURS.match(f):
                os.remove(os.path.join(out_dir, f))


def write_synthetic(arch, out_dir: str, *, tiny: bool = False, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                    shard_bytes: int = 2 ** 30, progress: bool = True, overwrite: bool = False,
                    workers: int | None = None) -> dict:
    """Write a checkpoint of preset `arch` (or a config.json dict) with random weights into `out_dir`:
    config.json, generation_config.json, model-0000i-of-0000n.safetensors and model.safetensors.index.json.
    Returns the index dict. config.json is written last, so an interrupted run leaves no loadable checkpoint.
    `workers` threads draw chunks ahead of the writer (torch releases the GIL; values do not depend on it);
    at most workers + 1 chunks of _CHUNK_ELEMS elements exist at once."""
    if dtype not in _ST_DTYPES:
        raise ConfigError(f"synth: dtype {dtype} is not supported (bfloat16, float16, float32, float64)")
    name, cfg = resolve_config(arch, tiny)
    cfg["torch_dtype"] = _DTYPE_NAMES[dtype]
    cfg.pop("dtype", None)
    cfg.pop("quantization_config", None)              # the weights we write are plain floating point
    adapter, spec = build(cfg, f"preset {name}")
    tensors = plan_tensors(spec, adapter.tensor_refs(spec), dtype)
    shards = plan_shards(tensors, shard_bytes)
    _prepare_dir(out_dir, overwrite)

    n = len(shards)
    total = sum(t.nbytes for t in tensors)
    weight_map: dict[str, str] = {}
    workers = max(1, workers or min(16, os.cpu_count() or 1))
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"synth {name}")
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="synth") as pool:
            for k, shard in enumerate(shards, 1):
                fname = f"model-{k:05d}-of-{n:05d}.safetensors"
                _write_shard(os.path.join(out_dir, fname), shard, seed, pool, workers, bar)
                weight_map.update({t.hf_name: fname for t in shard})
    finally:
        if bar is not None:
            bar.close()

    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(os.path.join(out_dir, "model.safetensors.index.json"), index)
    gen = {"_from_model_config": True, "bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id")}
    if cfg.get("pad_token_id") is not None:
        gen["pad_token_id"] = cfg["pad_token_id"]
    _write_json(os.path.join(out_dir, "generation_config.json"), gen)
    _write_json(os.path.join(out_dir, "config.json"), cfg)
    return index


def _write_json(path: str, obj) -> None:
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


# ---- in memory, no disk ---------------------------------------------------------------------------------------

class SynthSource:
    """A TensorSource that draws each tensor on `device` when it is read and holds nothing: under a store that
    quantizes on request only the codes stay resident (gpt-oss-120b's 117B parameters do not fit an H200 in bf16,
    its MXFP4 codes do)."""

    def __init__(self, tensors: list[SynthTensor], seed: int, device: torch.device, path: str):
        self.by_name, self.seed, self.device, self.path = {t.hf_name: t for t in tensors}, seed, device, path

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: t.shape for n, t in self.by_name.items()}

    def read(self, name: str) -> torch.Tensor:
        return materialize(self.by_name[name], self.seed, self.device)


class SynthStore(WeightStore):
    """A WeightStore over synthetic HF tensors: held in memory (a dict), or drawn when read (a SynthSource)."""

    def __init__(self, tensors: dict[str, torch.Tensor] | SynthSource, refs, path: str):
        super().__init__(tensors if isinstance(tensors, SynthSource) else DictSource(tensors, path), refs)


def synth_weights_on_device(arch_or_config, device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
                            *, tiny: bool = False, seed: int = 0, lazy: bool = False) -> tuple[ModelSpec, SynthStore]:
    """(spec, store) with random weights built directly in `device` memory (benchmarks: no disk, no host copy).
    Needs the whole model's bytes on `device`, unless `lazy`: then each tensor is drawn again whenever it is read
    (same values). On CPU the values equal write_synthetic's."""
    if dtype not in _DTYPE_NAMES:
        raise ConfigError(f"synth: dtype {dtype} is not supported (bfloat16, float16, float32, float64)")
    name, cfg = resolve_config(arch_or_config, tiny)
    cfg["torch_dtype"] = _DTYPE_NAMES[dtype]
    cfg.pop("dtype", None)
    cfg.pop("quantization_config", None)
    adapter, spec = build(cfg, f"preset {name}")
    refs = adapter.tensor_refs(spec)
    device = torch.device(device)
    path = f"<synthetic {name} on {device}>"
    planned = plan_tensors(spec, refs, dtype)
    if lazy:
        return spec, SynthStore(SynthSource(planned, seed, device, path), refs, path)
    return spec, SynthStore({t.hf_name: materialize(t, seed, device) for t in planned}, refs, path)


# ---- parameter counts -----------------------------------------------------------------------------------------

_EXPERT = re.compile(r"^layers\.(\d+)\.moe\.experts\.(\d+)\.")


def _canonical_numel(lay: Layout) -> int:
    """numel of Layout.apply(hf tensor), from shapes alone (a meta-tensor round trip per ref is 10x slower)."""
    return math.prod(lay.shape())


def count_params(spec: ModelSpec, *, embed_in_active: bool = True) -> tuple[int, int]:
    """(total, active per token) parameters of `spec`, from the adapter's tensor list.

    total: every tensor the checkpoint holds (a tied head counted once). active: attention, norms, dense MLPs,
    routers, shared experts, top_k of the routed experts of each MoE layer, the head, and the embedding table
    if `embed_in_active` (authors differ: see presets.Published.embed_in_active)."""
    adapter = adapter_for(spec.family)
    total = active = 0
    for ref in adapter.tensor_refs(spec):
        if ref.optional:
            continue
        n = _canonical_numel(ref.layouts[0])
        total += n
        m = _EXPERT.match(ref.name)
        if m and int(m.group(2)) >= spec.layers[int(m.group(1))].moe.top_k:
            continue                                  # experts are interchangeable: count top_k of them
        if ref.name == "embed" and not embed_in_active and not spec.tie_word_embeddings:
            continue                                  # a lookup reads one row; a tied table is the head too
        active += n
    return total, active


def published(name: str):
    """presets.PUBLISHED entry of `name` (or None)."""
    return _presets.PUBLISHED.get(name)
