"""Streaming converter: a float (or already quantized) checkpoint -> a compressed-tensors checkpoint.

quant/ knows formats, not families: the caller (models/quantizable.py) lists the Linear weights as `LinearTarget`s
(which source tensor, the module it is written as, its role, its fused-partner group) and hands over an open
TensorSource (SafetensorsSource, or ingest.QuantizedSource for a quantized source: its tensors are logical).
Every source tensor that no target consumes is copied bit for bit (routers, embeddings, norms, biases, lm_head
unless asked).

Memory: source shards are processed one after another and each output shard is written before the next source
shard is touched, so the peak is about one output shard plus the tensor being quantized (stacked experts and
lanes are quantized slice by slice in float32: one [out, in] slice of scratch, never the whole stack). Source
tensors are memory-mapped, shards are written tensor by tensor (_save_shard) and freed heap is returned after
each tensor (_trim_heap). Measured: a synthetic llama-3.2-1b in three bf16 shards of up to 1.07 GB converts with
a peak of about 1.0 GB anonymous memory, 0.3 GB of it the imports (fp8 / nvfp4 / mxfp4 alike).
Fused partners (one group: q/k/v, gate/up) share one nvfp4 global scale; when they live in different shards the
partners are read once more (one at a time) to get their amax.

config.json: the source's, with `quantization_config` from compressed-tensors' schema objects (one group over
"Linear"); its `ignore` lists every module whose 2-D `.weight` stays in float (routers, embeddings, lm_head, the
Linears the scheme cannot hold) by exact name, plus the user's --ignore regexes anchored with `$` (compressed-
tensors matches with re.match, so `mlp.gate` would otherwise also hit `mlp.gate_proj`).

Layouts written (target.layout):
- "linear": `<module>.weight` [out, in] or a lane stack [L, out/L, in] -> the scheme's tensors under `<module>.`
  (a stack keeps its lead axis on every scale: each lane is quantized as its own matrix, its own nvfp4 global).
- "split": one expert's rows of a transformers-v5 fused tensor (`experts.gate_up_proj` [E, 2I, D] / `down_proj`
  [E, D, I]) -> a per-expert 2-D module, the layout Hub checkpoints and vLLM use.
- "xw": gpt-oss's fused [E, in, out] parameter P (gate/up interleaved) -> stored out-major [E, out, in]: for mxfp4
  gpt-oss's own `P_blocks` [E, out, in/32, 16] / `P_scales` [E, out, in/32] (what the native checkpoints hold);
  for the other schemes the scheme's tensors named `P_<tensor>` (`P_weight`, `P_weight_scale`, ...).
  compressed-tensors cannot express a 3-D parameter that is not a Linear's `.weight`, so neither form is in its
  schema; ingest.QuantizedSource reads both. Each expert has its own scale(s), so gate and up rows of one expert
  share its nvfp4 global by construction.

Re-packing: a target whose source is already stored in the target scheme (our own output, gpt-oss native MXFP4
-> mxfp4, native FP8-block -> fp8-block) is written from the source's codes and scales without a float round
trip (nvfp4 only when its fused partners already share a global scale; else they are requantized together).

The output goes to a temporary directory beside DST, renamed to DST at the very end: a failure (a NaN weight,
a full disk, Ctrl-C) removes the temporary directory and leaves DST absent (or, with force, the old DST intact).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from kie_moe.models.errors import CheckpointError, InputError, KieError  # user-facing error classes (a leaf module)

from .ct_format import quantization_config_dict
from .schemes import Fp8BlockScheme, NotQuantizable, QuantizedTensor, Scheme, get_scheme, nvfp4_global_scale, quantize

__all__ = ["LinearTarget", "ConvertReport", "QuantizationWarning", "convert", "check_destination",
           "DEFAULT_ROLES", "EXPERT_ROLES"]

DEFAULT_ROLES = ("attn", "mlp", "expert", "shared_expert")  # quantized by default
EXPERT_ROLES = ("expert", "shared_expert")  # --experts-only
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".onnx")
_NOT_COPIED = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")


class QuantizationWarning(UserWarning):
    """A Linear the scheme cannot represent was kept in float (the message names it)."""


@dataclass(frozen=True)
class LinearTarget:
    """One Linear weight of the source and where it goes. See the module docstring for `layout`."""

    source: str  # logical source tensor: "...q_proj.weight", "...experts.gate_up_proj"
    module: str  # written as: the module prefix ("...experts.3.gate_proj") or, for "xw", the parameter P
    role: str  # attn | mlp | expert | shared_expert | lm_head
    layout: str = "linear"  # linear | split | xw
    group: str | None = None  # fused partners: one nvfp4 global scale per group
    take: int | None = None  # split: expert index of the fused source
    rows: tuple[int, int] | None = None  # split: row range of that expert's [R, in] slice (None: all)

    def out_shape(self, src_shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of the weight as quantized: [out, in] or [N, out, in]."""
        s = tuple(src_shape)
        if self.layout == "split":
            rows = s[1] if self.rows is None else self.rows[1] - self.rows[0]
            return (rows, s[2])
        if self.layout == "xw":
            return (*s[:-2], s[-1], s[-2])
        return s


@dataclass(frozen=True)
class ConvertReport:
    src: str
    dst: str
    scheme: str
    quantized: tuple[str, ...]  # modules / parameters written quantized
    repacked: tuple[str, ...]  # of those, copied from the source's codes (no float round trip)
    kept: tuple[tuple[str, str], ...]  # (module, why) Linear targets left in float
    ignore: tuple[str, ...]  # quantization_config.ignore as written
    files: tuple[str, ...]  # safetensors shards written (names inside dst)
    bytes_written: int
    warnings: tuple[str, ...] = field(default=())
    gptq_slices: int = 0  # [out, in] slices quantized by GPTQ (the rest of `quantized`: round to nearest / re-packed)


def check_destination(src: str, dst: str, force: bool) -> None:
    """Refuse an existing DST without force, and DST == SRC always (force would delete the source)."""
    same = os.path.exists(src) and os.path.exists(dst) and os.path.samefile(src, dst)
    if same or os.path.abspath(dst) == os.path.abspath(src):
        raise InputError(f"{dst}: destination is the source checkpoint; choose another directory")
    if os.path.lexists(dst) and not force:
        raise InputError(f"{dst}: already exists (use --force to replace it)")


def _compile_ignore(patterns: Sequence[str]) -> list[re.Pattern]:
    out = []
    for p in patterns:
        anchored = p if p.endswith("$") else p + "$"  # compressed-tensors applies re.match: anchor the end
        try:
            out.append(re.compile(anchored))
        except re.error as e:
            raise InputError(f"--ignore {p!r}: not a valid regular expression ({e})") from None
    return out


def _check_finite(t: torch.Tensor, name: str, where: str, chunk: int = 1 << 24) -> None:
    """NaN / Inf anywhere -> CheckpointError naming the tensor. Chunked: a bool mask of a whole embedding
    of a whole bf16 embedding would be half of it again in memory."""
    if not torch.is_floating_point(t) or t.element_size() == 1:
        return
    flat = t.reshape(-1)
    for i in range(0, flat.numel(), chunk):
        if not bool(torch.isfinite(flat[i:i + chunk]).all()):
            n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            raise CheckpointError(f"{where}: tensor {name} has {n_nan} NaN and {n_inf} Inf values; refusing to convert")


def _check_shape(sch: Scheme, shape: tuple[int, ...], name: str) -> None:
    """The scheme's own shape rule, plus: fp8-block needs `in` to be a multiple of the 128-column block.
    schemes.py can write ragged column blocks, but compressed-tensors warns that FP8_BLOCK needs strict division
    (its dynamic activation groups fail on a ragged `in`) and vLLM's block kernels need it too, so such a
    checkpoint would not load there. Ragged rows are fine (DeepSeek-V3's kv_a_proj has 576)."""
    sch.check(shape, name)
    if isinstance(sch, Fp8BlockScheme) and shape[-1] % sch.block[1]:
        raise NotQuantizable(name, sch.name, f"in={shape[-1]} is not a multiple of the {sch.block[1]}-column block "
                                             "(compressed-tensors and vLLM need whole column blocks)")


_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
              torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.uint8: "U8", torch.int8: "I8",
              torch.int16: "I16", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL"}


def _trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc only; a no-op elsewhere). glibc's mmap threshold adapts
    upwards to the largest block freed (up to 32 MB), after which the per-slice quantization temporaries (16 MB
    each for an 8192 x 2048 weight) come from the heap and, freed, stay in RSS: converting a 1B model with 1 GB
    shards peaked at 2.1-2.3 GB of anonymous memory without this, about 1 GB with it (0.3 GB of it the imports)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


try:
    import ctypes

    _LIBC = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim
except (OSError, AttributeError):
    _LIBC = None


def _save_shard(tensors: dict[str, torch.Tensor], path: str) -> None:
    """One output shard, in the safetensors format (8-byte little-endian header length, JSON header padded to 8
    bytes, raw little-endian data), written tensor by tensor: safetensors' save_file first turns every tensor
    into a bytes copy, which would double the shard in memory. Tests replace this to simulate a full disk."""
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, t in tensors.items():
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} cannot be written to safetensors")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))


class _Converter:
    """One conversion run; state lives here so convert() reads top to bottom."""

    def __init__(self, source, sch: Scheme, targets: Sequence[LinearTarget], on_warning):
        self.source, self.sch = source, sch
        self.gptq = None     # (target, slice index, weight, global scale, name) -> QuantizedTensor or None (RTN)
        self.solved = 0      # slices quantized by GPTQ
        self.shapes = source.shapes()
        self.warn = on_warning
        # last source tensor read, float and quantized apart (a fused tensor feeds 2E targets in a row)
        self._cache: dict[bool, tuple[str, object]] = {}
        self._globals: dict[str, torch.Tensor | None] = {}
        self.by_source: dict[str, list[LinearTarget]] = {}
        for t in targets:
            if t.source not in self.shapes:
                raise CheckpointError(f"{source.path}: no tensor {t.source} (listed as a Linear weight)")
            self.by_source.setdefault(t.source, []).append(t)
        self.quant: dict[LinearTarget, str | None] = {}  # target -> None (quantize) or why it stays float

    # ---- decisions ----------------------------------------------------------------------------------
    def decide(self, experts_only: bool, ignore: list[re.Pattern], quantize_lm_head: bool) -> None:
        for ts in self.by_source.values():
            for t in ts:
                why = None
                if t.role == "lm_head" and not quantize_lm_head:
                    why = "lm_head stays in float (--quantize-lm-head quantizes it)"
                elif experts_only and t.role not in EXPERT_ROLES:
                    why = "--experts-only"
                elif t.role not in DEFAULT_ROLES + ("lm_head",):
                    why = f"role {t.role} is never quantized"
                else:
                    hit = next((p for p in ignore if p.match(t.module)), None)
                    if hit is not None:
                        why = f"--ignore {hit.pattern}"
                if why is None:
                    try:
                        _check_shape(self.sch, t.out_shape(self.shapes[t.source]), t.module)
                    except NotQuantizable as e:
                        why = e.reason
                        self.warn(f"{e}; kept in float")
                self.quant[t] = why

    # ---- reading ------------------------------------------------------------------------------------
    def _read(self, name: str, quantized: bool):
        hit = self._cache.get(quantized)
        if hit is None or hit[0] != name:
            if quantized:
                val = self.source.read_quantized(name) if hasattr(self.source, "read_quantized") else None
            else:
                val = self.source.read(name)
            self._cache[quantized] = hit = (name, val)
        return hit[1]

    def source_q(self, t: LinearTarget) -> QuantizedTensor | None:
        return self._read(t.source, True)

    def slices(self, t: LinearTarget) -> Iterator[torch.Tensor]:
        """The weight to quantize as float32 [out, in] slices (one per expert / lane of a stack)."""
        q = self.source_q(t)
        if q is not None:  # stored out-major already, also for "xw" (see ingest)
            parts = q.unstack() if len(q.shape) == 3 else [q]
            if t.layout == "split":
                w = parts[t.take].dequantize(torch.float32)
                yield w if t.rows is None else w[t.rows[0]:t.rows[1]]
                return
            for p in parts:
                yield p.dequantize(torch.float32)
            return
        w = self._read(t.source, False)
        if t.layout == "split":
            w = w[t.take]
            yield (w if t.rows is None else w[t.rows[0]:t.rows[1]]).float()
        elif w.ndim == 2:
            yield w.float()
        else:
            for i in range(w.shape[0]):
                yield w[i].float().t().contiguous() if t.layout == "xw" else w[i].float()

    def _slice_name(self, t: LinearTarget, i: int, n: int) -> str:
        if t.layout == "split":
            return f"{t.source}[expert {t.take}]"
        return t.source if n == 1 else f"{t.source}[{i}]"

    # ---- nvfp4 fused partners -----------------------------------------------------------------------
    def group_global(self, t: LinearTarget) -> torch.Tensor | None:
        """Shared global scale of t's group ([1] or [N, 1]); None: quantize alone / re-pack as stored."""
        if self.sch.name != "nvfp4" or t.group is None:
            return None
        if t.group in self._globals:
            return self._globals[t.group]
        members = [m for ts in self.by_source.values() for m in ts if m.group == t.group and self.quant[m] is None]
        g = None
        if len(members) > 1:
            qs = [self.source_q(m) if m.layout != "split" else None for m in members]
            stored = [q.tensors["weight_global_scale"] for q in qs if q is not None and q.scheme == "nvfp4"]
            if not (len(stored) == len(members) and all(torch.equal(s, stored[0]) for s in stored)):
                amax = None
                for m in members:
                    a = []
                    for i, w in enumerate(self.slices(m)):
                        _check_finite(w, self._slice_name(m, i, 2), self.source.file_of(m.source))
                        a.append(w.abs().amax())
                    a = torch.stack(a)  # [N]
                    if amax is not None and amax.shape != a.shape:
                        raise CheckpointError(f"{self.source.path}: fused partners of {t.group} have different "
                                              f"stack sizes ({amax.numel()} vs {a.numel()} slices)")
                    amax = a if amax is None else torch.maximum(amax, a)
                # nvfp4_global_scale takes a weight: one element per slice is its amax
                g = nvfp4_global_scale(amax.reshape(1, 1) if amax.numel() == 1 and not self._stacked(t)
                                       else amax.reshape(-1, 1, 1))
        self._globals[t.group] = g
        return g

    def _stacked(self, t: LinearTarget) -> bool:
        return len(t.out_shape(self.shapes[t.source])) == 3

    # ---- producing output tensors -------------------------------------------------------------------
    def quantize(self, t: LinearTarget) -> tuple[QuantizedTensor, bool]:
        """-> (QuantizedTensor [out, in] / [N, out, in] in stored orientation, re-packed?)."""
        g = self.group_global(t)
        q = self.source_q(t)
        if q is not None and q.scheme == self.sch.name and t.layout != "split" and g is None:
            return q, True
        dtype = q.dtype if q is not None else self._read(t.source, False).dtype
        parts, n = [], self._n_slices(t)
        for i, w in enumerate(self.slices(t)):
            gi = None if g is None else (g[i] if g.ndim == 2 else g).clone()  # own storage: safetensors refuses shared
            q = None if self.gptq is None else self.gptq(t, i, w, gi, self._slice_name(t, i, n))
            self.solved += q is not None
            parts.append(q if q is not None else quantize(w, self.sch, gi, name=self._slice_name(t, i, n)))
        if not self._stacked(t):
            return QuantizedTensor(self.sch.name, parts[0].tensors, parts[0].shape, dtype), False
        stacked = {k: torch.stack([p.tensors[k] for p in parts]) for k in parts[0].tensors}
        return QuantizedTensor(self.sch.name, stacked, (len(parts), *parts[0].shape), dtype), False

    def _n_slices(self, t: LinearTarget) -> int:
        s = t.out_shape(self.shapes[t.source])
        return s[0] if len(s) == 3 else 1

    def named(self, t: LinearTarget, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        if t.layout != "xw":
            return q.named(t.module)
        if q.scheme == "mxfp4":  # gpt-oss's native names and [E, out, in/32, 16] blocks
            packed = q.tensors["weight_packed"]
            return {f"{t.module}_blocks": packed.reshape(*packed.shape[:-1], -1, 16).contiguous(),
                    f"{t.module}_scales": q.tensors["weight_scale"].contiguous()}
        return {f"{t.module}_{k}": v.contiguous() for k, v in q.tensors.items()}

    def float_tensor(self, t: LinearTarget) -> tuple[str, torch.Tensor]:
        """A target kept in float: (name written, tensor) in the source's logical layout."""
        w = self._read(t.source, False)
        if t.layout == "split":
            w = w[t.take]
            w = w if t.rows is None else w[t.rows[0]:t.rows[1]]
            return f"{t.module}.weight", w.contiguous()
        return (t.module if t.layout == "xw" else f"{t.module}.weight"), w


def convert(
    source,
    config: dict,
    dst: str,
    scheme: "str | Scheme",
    targets: Sequence[LinearTarget],
    *,
    force: bool = False,
    experts_only: bool = False,
    ignore: Sequence[str] = (),
    quantize_lm_head: bool = False,
    progress: bool = True,
    on_warning: Callable[[str], None] | None = None,
    gptq: "Callable[[list[LinearTarget]], Callable] | None" = None,
) -> ConvertReport:
    """Write `source` (its config.json dict `config`) to `dst` in `scheme`; see the module docstring.

    gptq: called once with the targets that will be quantized (after --ignore, --experts-only, shape rules),
    before anything is written; returns solve(target, slice index, weight [out, in] float32, nvfp4 global scale or
    None, name) -> the slice's QuantizedTensor chosen by GPTQ (same scales as `quantize`), or None to round it to
    nearest (quant/gptq.py; the family side is models/calibrate.gptq_calibrator). Re-packed targets (already
    stored in the scheme) stay as stored."""
    try:
        sch = get_scheme(scheme)
    except ValueError as e:
        raise InputError(str(e)) from None
    src_dir = source.path
    check_destination(src_dir, dst, force)
    patterns = _compile_ignore(ignore)
    seen_warnings: list[str] = []

    def warn(msg: str) -> None:
        seen_warnings.append(msg)
        if on_warning is None:
            warnings.warn(msg, QuantizationWarning, stacklevel=3)
        else:
            on_warning(msg)

    cv = _Converter(source, sch, targets, warn)
    cv.decide(experts_only, patterns, quantize_lm_head)
    if gptq is not None:
        cv.gptq = gptq([t for t, why in cv.quant.items() if why is None])

    names = list(cv.shapes)
    files: list[str] = []
    by_file: dict[str, list[str]] = {}
    for n in names:
        f = source.file_of(n)
        if f not in by_file:
            files.append(f)
            by_file[f] = []
        by_file[f].append(n)
    n_out = len(files)
    out_names = ["model.safetensors"] if n_out == 1 else [f"model-{k + 1:05d}-of-{n_out:05d}.safetensors" for k in range(n_out)]

    parent = os.path.dirname(os.path.abspath(dst))
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(dst))}.kie-convert-", dir=parent)
    except OSError as e:
        raise InputError(f"{dst}: cannot create the destination ({e.strerror}: {e.filename})") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; DST should look like any directory the user makes
    quantized, repacked, kept, ignore_list = [], [], [], [f"re:{p.pattern}" for p in patterns]
    weight_map: dict[str, str] = {}
    from tqdm import tqdm

    bar = tqdm(total=len(names), unit="tensor", desc=f"kie convert {sch.name}", disable=not progress)
    try:
        for fpath, out_name in zip(files, out_names):
            out: dict[str, torch.Tensor] = {}
            for n in by_file[fpath]:
                for t in cv.by_source.get(n, ()):
                    if cv.quant[t] is None:
                        q, was_repacked = cv.quantize(t)
                        out.update(cv.named(t, q))
                        _trim_heap()
                        quantized.append(t.module)
                        if was_repacked:
                            repacked.append(t.module)
                    else:
                        name, w = cv.float_tensor(t)
                        _check_finite(w, t.source, fpath)
                        out[name] = w
                        kept.append((t.module, cv.quant[t]))
                if n not in cv.by_source:  # not a Linear target: bit for bit (dequantized if it was quantized)
                    w = source.read(n)
                    _check_finite(w, n, fpath)
                    out[n] = w
                bar.update(1)
            for name, w in out.items():
                mod, _, local = name.rpartition(".")
                if local == "weight" and w.ndim >= 2 and not mod.endswith("norm") and torch.is_floating_point(w) \
                        and w.element_size() > 1:
                    ignore_list.append(mod)  # a float 2-D `.weight`: compressed-tensors must leave it alone
            try:
                _save_shard(out, os.path.join(tmp, out_name))
            except (KeyboardInterrupt, KieError):
                raise
            except Exception as e:  # OSError (disk full), safetensors' own error type
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise CheckpointError(f"{dst}: writing {out_name} failed ({first}); {dst} was not created") from None
            weight_map.update({k: out_name for k in out})
            del out
        bar.close()

        if "lm_head" not in quantized and "lm_head" not in ignore_list:
            ignore_list.append("lm_head")  # also when tied to the embeddings: engines build an lm_head Linear
        total = sum(os.path.getsize(os.path.join(tmp, f)) for f in out_names)
        cfg = dict(config)
        cfg["quantization_config"] = quantization_config_dict(sch, ignore_list)
        _write_json(os.path.join(tmp, "config.json"), cfg)
        _write_json(os.path.join(tmp, "model.safetensors.index.json"),
                    {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
        for f in sorted(os.listdir(src_dir)):
            p = os.path.join(src_dir, f)
            if os.path.isfile(p) and f not in _NOT_COPIED and not f.endswith(_WEIGHT_FILES):
                shutil.copy2(p, os.path.join(tmp, f))  # tokenizer, generation config, chat template, license
        _replace(tmp, dst)
    except BaseException as e:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, KieError):
            raise
        if isinstance(e, ValueError):
            raise CheckpointError(f"{src_dir}: {e}") from None  # NaN / Inf in a weight, named by quantize()
        if isinstance(e, OSError):  # config / index / copied files: the disk filled up after the last shard
            raise CheckpointError(f"{dst}: writing failed ({e}); {dst} was not created") from None
        raise
    return ConvertReport(src_dir, dst, sch.name, tuple(quantized), tuple(repacked), tuple(kept), tuple(ignore_list),
                         tuple(out_names), total, tuple(seen_warnings), cv.solved)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _replace(tmp: str, dst: str) -> None:
    """Rename tmp -> dst; an existing dst (force) is moved aside first and deleted only after the rename."""
    if not os.path.lexists(dst):
        os.rename(tmp, dst)
        return
    old = tmp + ".old"
    os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.remove(old)
