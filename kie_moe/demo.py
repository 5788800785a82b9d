"""`kie demo`: the whole product on the embedded model, on a fresh machine, in about a minute on a laptop CPU.

The embedded model (kie_moe/assets/demo-moe: a small Qwen3-MoE trained on Python source, the standard library and
site-packages, see its TRAINING.md) is converted to each scheme (cached under --out, keyed by a hash of the source
weights, so a second run only generates), each version completes a Python prompt greedily, and a table compares them
with bf16: weight bytes, decode tokens/s, and quality teacher-forced on held-out text the model never trained on
(top-1 agreement and mean KL(bf16 || scheme) of the next-token distributions, perplexity), over the same token
windows `kie sweep` scores by default (kie_moe.heldout: 32 windows of 256 tokens spread over the whole text;
--windows 0 scores all of it).

Quality runs through the reference decoder in float32 on every device (the oracle, so the numbers measure the
weights, not a backend's arithmetic); generation and tokens/s use the engine's backend (auto: the fastest there).
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from kie_moe import heldout as H
from kie_moe.engine import resolve_device
from kie_moe.models.errors import ConfigError, InputError
from kie_moe.synthetic import EMBEDDED_DEMO

DEFAULT_MODEL = EMBEDDED_DEMO
DEFAULT_SCHEMES = ("fp8", "nvfp4")
PROMPT = "def fibonacci(n):"


@dataclass
class DemoRow:
    scheme: str
    path: str
    bytes: int              # weight files (*.safetensors: weights + scales) on disk
    tokens_per_s: float | None  # decode rate (tokens after the first / time after the first); None: not streamed
    top1: float             # fraction of held-out positions whose argmax matches bf16's
    kl: float               # mean KL(bf16 || this) in nats per position
    ppl: float              # held-out perplexity
    text: str               # the prompt's completion
    n_tokens: int


@dataclass
class DemoResult:
    model: str
    device: str
    backend: str
    prompt: str
    eval_tokens: int        # teacher-forced positions scored per scheme
    text_source: str        # where the held-out text came from
    rows: list[DemoRow] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def default_out_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kie-moe", "demo")


def fingerprint(model_dir: str) -> str:
    """Hash of config.json and the weight files (+ this package's version): a changed model or converter
    re-converts instead of reusing a stale cache."""
    h = hashlib.sha256()
    try:
        from importlib.metadata import version
        h.update(version("kie-moe").encode())
    except Exception:  # noqa: BLE001 -- running from a source tree without installed metadata
        pass
    files = ["config.json"] + sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    for f in files:
        h.update(f.encode())
        with open(os.path.join(model_dir, f), "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()[:12]


def weight_bytes(model_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir) if f.endswith(".safetensors"))


def check_model_dir(model_dir: str) -> None:
    if not os.path.isdir(model_dir):
        hint = " (the package was installed without its assets: reinstall kie-moe)" if model_dir == DEFAULT_MODEL else ""
        raise InputError(f"{model_dir}: no such model directory{hint}")
    for f in ("config.json", "tokenizer.json"):
        if not os.path.exists(os.path.join(model_dir, f)):
            raise ConfigError(f"{model_dir}: no {f} (kie demo needs an HF checkpoint with its tokenizer)")
    if not any(f.endswith(".safetensors") for f in os.listdir(model_dir)):
        raise ConfigError(f"{model_dir}: no *.safetensors weight files")


def converted(src: str, out: str, scheme: str, fp: str, log: Callable[[str], None], gptq=None) -> str:
    """out/<fingerprint>-<scheme>[-gptq-<calibration hash>]: reused when present (convert renames a finished folder
    into place, so one that exists is complete), else written now. gptq: models.calibrate.GptqOptions; its hash
    covers the calibration token windows and the dampening, so other calibration text converts again."""
    from kie_moe.models.quantizable import convert_checkpoint
    tag = "" if gptq is None else f"-gptq-{gptq.fingerprint()[:10]}"
    dst = os.path.join(out, f"{fp}-{scheme}{tag}")
    if os.path.exists(os.path.join(dst, "config.json")):
        return dst
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise InputError(f"{out}: cannot create the demo's cache folder ({e.strerror}); pass --out DIR") from None
    t0 = time.perf_counter()
    rep = convert_checkpoint(src, dst, scheme, force=True, progress=False, on_warning=lambda m: log(f"warning: {m}"),
                             gptq=gptq)
    how = f" by GPTQ ({rep.gptq_slices} slices; calibration: {gptq.label})" if gptq is not None else ""
    log(f"converted to {scheme}{how}: {len(rep.quantized)} Linear weights quantized, "
        f"{rep.bytes_written / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s -> {dst}")
    return dst


def heldout_text(model_dir: str) -> tuple[str, str]:
    """The model's held-out sample (kie_moe.heldout: its own heldout.txt, else the embedded demo model's), else
    a standard-library module's source."""
    path = H.heldout_file(model_dir)
    if path is None:
        import sysconfig
        path = os.path.join(sysconfig.get_paths()["stdlib"], "argparse.py")
    return open(path, encoding="utf-8").read(), path


def eval_windows(tok, text: str, n: int, length: int, vocab: int) -> torch.Tensor:
    """n windows of length+1 token ids spread evenly over `text` -> [n, length+1] (inputs [:, :-1], targets [:, 1:]);
    the same windows kie sweep scores (kie_moe.heldout)."""
    return H.windows(H.encode(tok, text, vocab), n, length)


@torch.no_grad()
def teacher_forced(eng, windows: torch.Tensor) -> torch.Tensor:
    """Logits [n*T, V] (float32, CPU) of the reference decoder over each window's inputs."""
    from kie_moe.models.reference import ReferenceDecoder
    dec = getattr(eng.backend, "decoder", None)
    if not isinstance(dec, ReferenceDecoder) or dec.dtype != torch.float32:
        dec = ReferenceDecoder(eng.spec, eng.model.weights, eng.device, torch.float32)
    out = []
    for w in windows:
        dec.reset()
        out.append(dec.forward(w[:-1]).float().cpu())
    dec.reset()
    return torch.cat(out)


def open_engine(path: str, device: str | None, backend: str, prompt: str, log: Callable[[str], None]):
    """-> (Engine, prompt ids), after a 2-token generation, so one-time costs (kernel compiles, graph capture,
    allocator) stay out of the tokens/s column. With --backend auto, a GPU backend that fails to build or run falls
    back to the reference one: the demo is the first command a user runs, and the warning says what happened."""
    from kie_moe.engine import Engine
    from kie_moe.models.errors import KieError
    from kie_moe.sampling import SamplingParams

    def start(name: str):
        eng = Engine(path, device=device, backend=name)
        if eng.tokenizer is None:
            raise ConfigError(f"{path}: no tokenizer files")
        ids = eng.encode(prompt)
        eng.generate(ids, SamplingParams(max_new_tokens=2, temperature=0.0))
        return eng, ids

    try:
        return start(backend)
    except KieError:
        raise
    except Exception as e:  # noqa: BLE001 -- any GPU backend failure; the reference backend's are re-raised
        if backend != "auto" or resolve_device(device).type == "cpu":
            raise
        log(f"warning: the auto backend failed on {path} ({type(e).__name__}: {e}); using the reference backend")
        return start("reference")


def run_demo(model: str | None = None, out: str | None = None, device: str | None = None, backend: str = "auto",
             schemes=DEFAULT_SCHEMES, prompt: str = PROMPT, max_new_tokens: int = 48,
             windows: int = H.DEFAULT_WINDOWS, window_len: int = H.DEFAULT_WINDOW_LEN,
             on_text: Callable[[str], None] | None = None, log: Callable[[str], None] = lambda m: None,
             gptq: bool = False, calib: str | None = None, calib_tokens: int | None = None,
             damp: float = 0.01) -> DemoResult:
    """Convert, generate, compare. on_text streams the completions (with a `[scheme]` line before each). gptq:
    convert by GPTQ over calib (default: the model's calib.txt; rows are labelled `SCHEME+gptq`)."""
    from kie_moe.quant.metrics import compare_logits
    from kie_moe.sampling import SamplingParams
    from kie_moe.tokenizer import IncrementalDecoder

    t_start = time.perf_counter()
    model = os.path.abspath(model or DEFAULT_MODEL)
    out = os.path.abspath(out or default_out_dir())
    check_model_dir(model)
    for s in schemes:
        if s in ("bf16", "fp16", "float"):
            raise InputError(f"--schemes: {s} is the reference row, always shown; list quantized schemes only")
    opts = H.gptq_options(model, calib, calib_tokens, device, damp, enabled=gptq)
    fp = fingerprint(model)
    paths = [("bf16", model)] + [(s + ("+gptq" if gptq else ""), converted(model, out, s, fp, log, opts))
                                 for s in schemes]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)

    res, ref_logits, targets = None, None, None
    for scheme, path in paths:
        eng, ids = open_engine(path, device, backend, prompt, log)
        if res is None:
            text, src = heldout_text(model)
            win = eval_windows(eng.tokenizer, text, windows, window_len, eng.spec.vocab_size)
            targets = win[:, 1:].reshape(-1)
            res = DemoResult(model, str(eng.device), "", prompt, int(targets.numel()), src)
        if eng.backend_name not in res.backend.split("/"):  # a fallback (open_engine) mixed backends: say so
            res.backend += f"/{eng.backend_name}"
        dec = IncrementalDecoder(eng.tokenizer)
        if on_text is not None:
            on_text(f"[{scheme}] {prompt}")
        push = (lambda t: on_text(dec.push(t))) if on_text is not None else None
        gen = eng.generate(ids, params, push)
        if on_text is not None:
            on_text("\n")
        logits = teacher_forced(eng, win)
        if ref_logits is None:
            ref_logits = logits
        q = compare_logits(ref_logits, logits, targets)
        res.rows.append(DemoRow(scheme, path, weight_bytes(path), gen.tokens_per_s, q.top1, q.kl, q.ppl_test,
                                gen.text or "", len(gen.token_ids)))
        del eng
    res.backend = res.backend.strip("/")
    res.seconds = time.perf_counter() - t_start
    return res


# ------------------------------------------------------------------------------------------------ output
COLUMNS = ("scheme", "weights MB", "tok/s", "top-1 vs bf16", "KL vs bf16", "held-out ppl")


def table_cells(res: DemoResult) -> list[list[str]]:
    return [[r.scheme, f"{r.bytes / 1e6:.2f}", "-" if r.tokens_per_s is None else f"{r.tokens_per_s:.1f}",
             f"{r.top1:.4f}", f"{r.kl:.5f}", f"{r.ppl:.3f}"] for r in res.rows]


def caption(res: DemoResult) -> str:
    return (f"{os.path.basename(res.model)} on {res.device} (backend {res.backend}); quality teacher-forced over "
            f"{res.eval_tokens} held-out tokens ({os.path.basename(res.text_source)}); {res.seconds:.1f} s")


def plain_table(res: DemoResult) -> str:
    """Fixed-width text: one header line, one line per scheme (what pipes and tests read)."""
    rows = [list(COLUMNS)] + table_cells(res)
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(rows[0]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows[1:]]
                     + [caption(res)])


def print_table(res: DemoResult, file=None) -> None:
    file = file or sys.stdout
    if file.isatty():
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            pass
        else:
            t = Table(caption=caption(res))
            for i, c in enumerate(COLUMNS):
                t.add_column(c, justify="left" if i == 0 else "right")
            for r in table_cells(res):
                t.add_row(*r)
            Console(file=file).print(t)
            return
    print(plain_table(res), file=file)
