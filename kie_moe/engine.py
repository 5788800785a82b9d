"""The engine: model directory -> backend -> stream of token ids.

Backends implement `generate(prompt_ids, params, eos_ids) -> Iterator[int]`. The reference backend wraps the
pure-PyTorch decoder (any family; the CPU path); GPU backends register here by name and are imported lazily.
"""
from __future__ import annotations

import glob
import importlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from kie_moe.models.errors import CheckpointError, ConfigError, InputError, Unsupported
from kie_moe.models.registry import adapter_for, check_token_ids, load_model
from kie_moe.sampling import SamplingParams, sample
from kie_moe.tokenizer import Tokenizer, has_tokenizer

# name -> "module:factory"; factory(model: LoadedModel, device: torch.device) -> backend
BACKENDS = {
    "reference": "kie_moe.engine:ReferenceBackend",
    "graph": "kie_moe.kernels.graph:GraphBackend",
    "monokernel": "kie_moe.kernels.monokernel.runtime:MonokernelBackend",
}
# what --backend auto picks, fastest first. On one GPU the graph backend decodes 2-3x faster than the monokernel
# today (H100 / H200, benchmarks/NOTES.md: qwen3-30b-a3b fp8 ~490 vs ~160 tok/s, llama-3.2-1b bf16 ~920 vs ~560), so
# it goes first; the monokernel takes what the graph backend refuses (the Laneformer) and moves back to the front
# when it is the faster one (issue 6's target: 1.3x the graph backend).
AUTO_ORDER = {"cuda": ("graph", "monokernel", "reference"), "cpu": ("reference",)}


def logits_not_finite(path: str, step: int) -> CheckpointError:
    return CheckpointError(f"{path}: the model's logits are not finite at step {step} (NaN / Inf weights in the "
                           "checkpoint, or settings that make them)")


class ReferenceBackend:
    """Host loop around the reference decoder; the oracle for every other backend."""
    name = "reference"

    def __init__(self, model, device: torch.device, dtype: torch.dtype | None = None):
        self.path = str(getattr(model, "path", "the model"))
        adapter = adapter_for(model.spec.family)
        if hasattr(adapter, "reference_decoder"):
            self.decoder = adapter.reference_decoder(model.spec, model.weights, device, dtype)
        else:
            from kie_moe.models.reference import ReferenceDecoder
            self.decoder = ReferenceDecoder(model.spec, model.weights, device, dtype)

    def generate(self, prompt_ids: list[int], p: SamplingParams, eos_ids: set[int]) -> Iterator[int]:
        gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        self.decoder.reset()
        logits = self.decoder.forward(torch.tensor(prompt_ids, dtype=torch.long))[-1]
        for n in range(p.max_new_tokens):
            if not bool(torch.isfinite(logits).all()):   # else argmax of NaN is token 0: a silent "EOS"
                raise logits_not_finite(self.path, n)
            tid = sample(logits, p, gen)
            yield tid
            if (tid in eos_ids and not p.ignore_eos) or n + 1 == p.max_new_tokens:
                return
            logits = self.decoder.forward(torch.tensor([tid], dtype=torch.long))[-1]


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA GPU is available on this machine (use --device cpu)")
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise InputError(f"--device must be cpu or cuda, got {device!r}")
    return torch.device(device)


def _importable(name: str) -> bool:
    mod = BACKENDS[name].split(":")[0]
    try:
        return importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        return False


def make_backend(name: str, model, device: torch.device):
    """Build backend `name` for `model`. "auto" takes AUTO_ORDER's first importable backend that supports the
    model: a backend that raises NotImplementedError while it builds (the monokernel planner's "not supported
    yet", e.g. one Linear kind mixing float and quantized weights) hands over to the next one, with a warning on
    stderr and the reason kept on the backend (`auto_note`), as a user of --backend auto would expect. An
    Unsupported (a whole family the backend does not take) hands over without the warning."""
    if name != "auto":
        return _build(name, model, device)
    cands = [c for c in AUTO_ORDER[device.type] if _importable(c)]
    skipped = []
    for i, cand in enumerate(cands):
        try:
            be = _build(cand, model, device)
        except NotImplementedError as e:
            if i == len(cands) - 1:
                raise
            skipped.append(f"{cand}: {e}")
            if not isinstance(e, Unsupported):   # a family the backend never takes (the graph's Laneformer): quiet
                print(f"kie: backend auto: {cand} does not support this model ({e}); trying {cands[i + 1]}",
                      file=sys.stderr, flush=True)
            continue
        if skipped:
            be.auto_note = "auto skipped " + "; ".join(skipped)
        return be
    raise InputError(f"backend auto: no backend is available for device {device.type}")


def _build(name: str, model, device: torch.device):
    if name not in BACKENDS:
        raise InputError(f"unknown backend {name!r} (choose from auto, {', '.join(BACKENDS)})")
    if not _importable(name):
        raise InputError(f"backend {name!r} is not available in this build")
    mod, fn = BACKENDS[name].split(":")
    try:
        return getattr(importlib.import_module(mod), fn)(model, device)
    except torch.OutOfMemoryError:
        raise _out_of_memory(name, model, device) from None


def _out_of_memory(name: str, model, device: torch.device) -> InputError:
    """What a user can do when a model does not fit: say how big it is against the GPU, and the ways out."""
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    path = str(getattr(model, "path", "the model"))
    files = glob.glob(os.path.join(path, "*.safetensors")) if os.path.isdir(path) else []
    need = f"{sum(os.path.getsize(f) for f in files) / 1e9:.1f} GB of weights" if files else "its weights"
    return InputError(f"{name} backend: out of GPU memory loading {path} ({need}) onto "
                      f"{torch.cuda.get_device_name(device)} ({total / 1e9:.0f} GB, {free / 1e9:.1f} GB free after "
                      f"the attempt). Convert it to fp8 or fp4 (kie convert MODEL DST --scheme fp8|nvfp4|mxfp4), "
                      f"free the GPU, or spread it over GPUs (--devices N)")


def generation_eos(model_dir: str) -> set[int]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.exists(path):
        return set()
    try:
        e = json.load(open(path)).get("eos_token_id")
    except ValueError:
        raise ConfigError(f"{path}: not valid JSON") from None
    return set(e if isinstance(e, list) else [e] if e is not None else [])


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    prompt_tokens: int
    ttft_s: float
    decode_s: float
    finish_reason: str = "length"
    extra: dict = field(default_factory=dict)
    streamed: bool = True        # False: every token arrived at the end of one launch (the interpreted monokernel)
    sampling_fallbacks: int = 0  # top-k / top-p draws taken as plain temperature samples (Engine.sampling_fallbacks)

    @property
    def tokens_per_s(self) -> float | None:
        """Decode rate: tokens after the first over the time after the first; None where the tokens did not stream
        (their arrival times then say nothing of the decode rate)."""
        if not self.streamed:
            return None
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


class Engine:
    def __init__(self, model_dir: str, device: str | None = None, backend: str = "auto", *, model=None,
                 backend_impl=None):
        """`model`: model_dir already loaded; `backend_impl`: an already built backend object instead of
        `backend` (a `--devices N` rank's, kie_moe/ranks.py)."""
        self.model_dir = model_dir
        self.model = load_model(model_dir) if model is None else model
        self.spec = self.model.spec
        self.device = resolve_device(device)
        self.backend = backend_impl if backend_impl is not None else make_backend(backend, self.model, self.device)
        self.tokenizer = Tokenizer(model_dir) if has_tokenizer(model_dir) else None
        gen_eos = generation_eos(model_dir)
        check_token_ids(sorted(gen_eos, key=str), self.spec.vocab_size,
                        f"{os.path.join(model_dir, 'generation_config.json')}: eos_token_id")
        self.eos_ids = set(self.spec.eos_token_ids) | gen_eos
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None and not self.eos_ids:
            self.eos_ids.add(self.tokenizer.eos_token_id)

    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def devices(self) -> int:
        return getattr(self.backend, "world", 1)

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ConfigError(f"{self.model_dir}: no tokenizer.json, so --prompt needs --prompt-ids instead")
        return self.tokenizer.encode(prompt)

    def check_prompt(self, ids: list[int], p: SamplingParams):
        V, ctx = self.spec.vocab_size, self.spec.max_position
        if not ids:
            raise InputError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise InputError(f"prompt id {bad[0]} is outside the vocabulary (0..{V - 1})")
        if len(ids) >= ctx:
            raise InputError(f"the prompt has {len(ids)} tokens; the model's context is {ctx}")
        if len(ids) + p.max_new_tokens > ctx:
            raise InputError(f"prompt ({len(ids)} tokens) + max_new_tokens ({p.max_new_tokens}) exceeds the "
                             f"model's context of {ctx} tokens")

    def stream(self, prompt_ids: list[int], p: SamplingParams) -> Iterator[int]:
        self.check_prompt(prompt_ids, p)
        return self._checked(self.backend.generate(list(prompt_ids), p, self.eos_ids))

    def _checked(self, tokens: Iterator[int]) -> Iterator[int]:
        """The backend's tokens; -1 is a device sampler's mark for NaN / +inf logits (kernels/sampling.py)."""
        for n, tid in enumerate(tokens):
            if tid < 0:
                raise logits_not_finite(self.model_dir, n)
            yield tid

    def warmup(self, long_context: bool | None = None) -> list[str]:
        """Compile and capture what a first request would otherwise wait for: a short greedy generation, then one
        with top-k (the GPU samplers' filtered variant: the monokernel's compiles for ~30 s, its first use would
        stall a request that long). A backend that refuses top-k (tensor parallel) skips it. long_context (default:
        on a GPU): also a greedy generation from the monokernel's long-context threshold (its 64-position attention
        blocks are another compiled variant, backend.long_from), where the model's context reaches it. -> what
        ran."""
        greedy = SamplingParams(max_new_tokens=2, ignore_eos=True)
        runs = [("greedy", [0, 0], greedy),
                ("top-k", [0, 0], SamplingParams(max_new_tokens=2, temperature=1.0, top_k=1, seed=0,
                                                 ignore_eos=True))]
        if long_context is None:
            long_context = self.device.type == "cuda"
        long_from = getattr(self.backend, "long_from", 0)   # 0: no long-context variant
        if long_context and 0 < long_from and long_from + 2 < self.spec.max_position:
            runs.append(("long-context", [0] * long_from, greedy))
        ran = []
        for what, ids, p in runs:
            try:
                for _ in self.stream(ids, p):
                    pass
            except InputError:
                continue
            ran.append(what)
        return ran

    def sampling_fallbacks(self, p: SamplingParams) -> int:
        """After a request with top-k / top-p: how many of its draws the GPU sampler took as plain temperature
        samples because the nucleus was wider than its candidates (kernels/sampling.py); 0 for other requests and
        for backends that sample exactly (reference)."""
        from kie_moe.kernels.sampling import needs_filter
        count = getattr(self.backend, "sampling_fallbacks", None)
        return count() if count is not None and needs_filter(p.temperature, p.top_k, p.top_p) else 0

    def generate(self, prompt_ids: list[int], p: SamplingParams, on_token=None) -> GenerationResult:
        t0 = time.perf_counter()
        t_first, out, reason = None, [], "length"
        for tid in self.stream(prompt_ids, p):
            if t_first is None:
                t_first = time.perf_counter()
            out.append(tid)
            if on_token is not None:
                on_token(tid)
            if tid in self.eos_ids and not p.ignore_eos:
                reason = "stop"
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        text = self.tokenizer.decode(out) if self.tokenizer is not None else None
        return GenerationResult(out, text, len(prompt_ids), (t_first or t1) - t0, t1 - (t_first or t1), reason,
                                streamed=getattr(self.backend, "streams_tokens", True),
                                sampling_fallbacks=self.sampling_fallbacks(p))
