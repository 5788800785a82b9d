"""What bench, sweep and preview share: the read-bandwidth probe, bytes-per-token accounting, the decode timer,
and the environment record every result carries (DESIGN.md §6).

Batch-1 decode is bytes-bound, so the floor is: per token, every active weight byte (+ its scales) and the KV
cache read once. `bytes_per_token` counts exactly that from the spec's tensor list (models/synth.count_params's
rules: top_k of each MoE layer's experts; the embedding table is one row unless it is also the head), so the
roofline of a model does not depend on which backend runs it. A backend that reads more (a dequantized copy, a
padded tile) shows it as a lower % of roofline; its own count is reported beside ours where it has one.
"""
from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

_EXPERT = re.compile(r"^layers\.(\d+)\.moe\.experts\.(\d+)\.")


# ---- the read ceiling ----------------------------------------------------------------------------------------

def read_probe(device: torch.device, nbytes: int | None = None) -> dict:
    """Bytes/s a plain streaming read reaches here, measured now (same process, same clocks as the run).

    GPU: torch int64 sum over 4 GiB, triton.testing.do_bench median (DESIGN.md §6; what benchmarks/ used).
    CPU: torch sum over a few hundred MB, median of a few reps (torch's threads, like the reference backend)."""
    if device.type == "cuda":
        import triton.testing as tt
        nbytes = nbytes or 4 << 30
        with torch.cuda.device(device):
            x = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()   # never zeros
            ms = tt.do_bench(lambda: x.view(torch.int64).sum(), warmup=50, rep=300, return_mode="median")
            del x
            torch.cuda.empty_cache()
        method = "torch int64 sum, triton.testing.do_bench median (warmup 50 ms, rep 300 ms)"
    else:
        nbytes = nbytes or 256 << 20
        x = torch.ones(nbytes // 8, dtype=torch.int64)
        x.sum()
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        del x
        method = f"torch int64 sum, median of 7 ({torch.get_num_threads()} threads)"
    return {"gbps": nbytes / ms / 1e6, "bytes": nbytes, "ms": ms, "method": method}


# ---- bytes per token -----------------------------------------------------------------------------------------

@dataclass
class Bytes:
    """Bytes one decode step must read: weight codes (or float weights), their scales, and the KV cache."""
    weights: int = 0
    scales: int = 0
    kv: int = 0
    detail: dict = field(default_factory=dict)   # per role: attn mlp experts shared router head embed norms

    @property
    def total(self) -> int:
        return self.weights + self.scales + self.kv

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def _role(name: str) -> str:
    if name in ("embed", "lm_head"):
        return "head" if name == "lm_head" else "embed"
    for key, role in (("moe.experts.", "experts"), ("moe.shared", "shared"), ("moe.router", "router"),
                      ("attn.", "attn"), ("mlp.", "mlp")):
        if key in name:
            return role
    return "norms"


def weight_bytes(spec, scheme_of=lambda n: "bf16", float_bytes: int = 2) -> Bytes:
    """Weight + scale bytes of one decode step of `spec`. scheme_of(canonical) -> "bf16" (float, `float_bytes`
    per element) or a quantization scheme (its codes and scales, as quant.schemes declares them)."""
    from kie_moe.models.registry import adapter_for
    b = Bytes()
    tied = getattr(spec, "tie_word_embeddings", False)
    for ref in adapter_for(spec.family).tensor_refs(spec):
        if ref.optional:
            continue
        name = ref.name
        m = _EXPERT.match(name)
        if m and int(m.group(2)) >= spec.layers[int(m.group(1))].moe.top_k:
            continue                                   # experts are interchangeable: top_k of them per token
        shape = list(ref.layouts[0].shape())
        numel = 1
        for s in shape:
            numel *= s
        if name == "embed" and not tied:
            numel = shape[-1]                          # a lookup reads one row
        scheme = scheme_of(name)
        role = _role(name)
        sch = None
        if scheme != "bf16" and len(shape) >= 2:
            from kie_moe.quant.schemes import NotQuantizable, get_scheme
            sch = get_scheme(scheme)
            try:
                sch.check(shape, name)
            except NotQuantizable:                     # kept in float by kie convert and QuantizingStore
                sch = None
        if sch is None:
            w, s = numel * float_bytes, 0
        else:
            specs = sch.tensor_specs(shape)
            w = s = 0
            for tname, (tshape, dt) in specs.items():
                n = 1
                for d in tshape:
                    n *= d
                if tname == sch.weight_name:
                    w += n * dt.itemsize
                else:
                    s += n * dt.itemsize
        b.weights += w
        b.scales += s
        b.detail[role] = b.detail.get(role, 0) + w + s
    return b


def kv_bytes_per_position(spec, elem_bytes: int = 2) -> list[tuple[int, int | None]]:
    """Per layer: (bytes of one cached position, sliding window or None). GQA: K and V of every kv head; MLA:
    the latent + rope key (what the graph backend caches)."""
    out = []
    for lay in spec.layers:
        a = lay.attn
        per = (a.kv_lora_rank + a.qk_rope_head_dim) if a.kind == "mla" else 2 * a.num_kv_heads * a.head_dim
        out.append((per * elem_bytes, lay.sliding_window))
    return out


def kv_bytes_mean(spec, start_pos: int, n_steps: int, elem_bytes: int = 2) -> int:
    """Mean over decode steps at positions start_pos .. start_pos + n_steps - 1 of the KV bytes each reads
    (positions 0..pos, or the last `window` of them)."""
    per = kv_bytes_per_position(spec, elem_bytes)
    n_steps = max(1, n_steps)
    total = 0
    for s in range(n_steps):
        visible = start_pos + s + 1
        total += sum(b * (min(visible, w) if w else visible) for b, w in per)
    return total // n_steps


# ---- timing ----------------------------------------------------------------------------------------------------

def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_generate(backend, prompt: list[int], new_tokens: int, device: torch.device,
                  out: list | None = None, sampling: dict | None = None) -> tuple[float, float, int]:
    """One generation with EOS ignored (greedy, or SamplingParams fields `sampling` with seed 0) -> (ttft_s,
    decode_s, tokens); the token ids go to `out` if given.
    Decode time runs from the first token to the last (the tokens after the first), as
    kie_moe.engine.GenerationResult counts it."""
    from kie_moe.sampling import SamplingParams
    p = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, **({**sampling, "seed": 0} if sampling else {}))
    _sync(device)
    t0 = time.perf_counter()
    first, n = None, 0
    for tid in backend.generate(list(prompt), p, set()):
        n += 1
        if out is not None:
            out.append(tid)
        if first is None:
            first = time.perf_counter()
    _sync(device)
    t1 = time.perf_counter()
    first = first or t1
    return first - t0, t1 - first, n


@dataclass
class Timing:
    tok_per_s: float               # median over runs
    tok_per_s_runs: list
    ttft_s: float                  # median over runs
    ttft_s_runs: list
    tokens: int
    token_ids: list = field(default_factory=list)    # the last timed run's (greedy): the same on every path

    @property
    def spread_pct(self) -> float:
        r = self.tok_per_s_runs
        return 100.0 * (max(r) - min(r)) / self.tok_per_s if self.tok_per_s else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1e3 / self.tok_per_s if self.tok_per_s else float("inf")


def measure(backend, prompt: list[int], new_tokens: int, runs: int, device: torch.device,
            warmup: bool = True, sampling: dict | None = None) -> Timing:
    """Warm up once with the same shapes (kernel compiles, CUDA-graph capture, buffer sizes), then `runs`
    timed generations; medians. A backend whose tokens do not stream (streams_tokens False: the interpreted
    monokernel) is timed over the whole generation, prefill included."""
    if new_tokens < 2:
        raise ValueError("need at least 2 new tokens to time decoding (the first token is the prefill's)")
    if warmup:
        time_generate(backend, prompt, new_tokens, device, sampling=sampling)
    tps, ttft, n = [], [], 0
    streams = getattr(backend, "streams_tokens", True)   # False: all tokens at the launch's end (interpreted)
    for _ in range(max(1, runs)):
        ids: list[int] = []
        t_first, dec, n = time_generate(backend, prompt, new_tokens, device, ids, sampling)
        if streams:
            tps.append((n - 1) / dec if dec > 0 and n > 1 else 0.0)
        else:                  # arrival times say nothing of the decode rate: tokens over the whole generation
            tps.append(n / (t_first + dec) if t_first + dec > 0 else 0.0)
        ttft.append(t_first)
    return Timing(statistics.median(tps), tps, statistics.median(ttft), ttft, n, ids)


# ---- environment -------------------------------------------------------------------------------------------------

def _run(cmd: list[str]) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        return r.stdout.strip() or None if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def archive_commit(pkg_dir: str) -> str | None:
    """The commit a `git archive` export was made from (ARCHIVE_COMMIT is export-subst in .gitattributes): how
    results from a device machine that got the tree without .git still name their commit. None in a checkout."""
    try:
        with open(os.path.join(pkg_dir, "ARCHIVE_COMMIT")) as f:
            h = f.read().strip()
    except OSError:
        return None
    return h[:12] if h and not h.startswith("$Format") else None


def environment(device: torch.device, argv: list[str] | None = None, prog: str = "kie") -> dict:
    """Device, driver and library versions, the git commit of this checkout, the command and the date, and the KIE_*
    switches set in the environment (A/B flags such as KIE_GLU_PAIR change the kernels a run measures)."""
    argv = sys.argv[1:] if argv is None else argv
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(shlex.quote(a) for a in [prog, *argv]),
           "kie_switches": {k: v for k, v in sorted(os.environ.items()) if k.startswith("KIE_")},
           "python": platform.python_version(), "torch": torch.__version__, "host_cpu": _cpu_name(),
           "cpu_threads": torch.get_num_threads()}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        from importlib.metadata import version
        env["kie_moe"] = version("kie-moe")
    except Exception:
        env["kie_moe"] = None
    here = os.path.dirname(os.path.abspath(__file__))
    env["git_commit"] = _run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"]) or archive_commit(here)
    env["git_dirty"] = bool(_run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"]))
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(device=p.name, sms=p.multi_processor_count, mem_gb=round(p.total_memory / 1e9, 1),
                   cuda=torch.version.cuda, gpus=torch.cuda.device_count(),
                   driver=_run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader",
                                f"--id={device.index or 0}"]))
    else:
        env.update(device="cpu", driver=None)
    return env


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fmt_gbps(g: float) -> str:
    """GB/s with enough digits for a tiny CPU model too (0.004 GB/s, not 0.0)."""
    return f"{g:.1f} GB/s" if g >= 10 else f"{g:.3g} GB/s"


def fmt_bytes(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"
