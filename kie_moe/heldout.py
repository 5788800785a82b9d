"""Held-out text and the token windows that quality numbers are computed over: one definition for `kie demo` and
`kie sweep`, so both report the same perplexity for the same model and settings.

Text: the checkpoint's `heldout.txt` (the embedded demo model ships the standard-library files it never trained on),
else the embedded demo model's, else (kie demo only, for a foreign checkpoint) a standard-library module.

Calibration text for `--gptq` (calibration_windows) is cut the same way from the checkpoint's `calib.txt` or a
user's file; it must not be the scored text (the demo model's is train-split files only).

Windows: the text is tokenized as the model saw its training stream (no BOS / EOS added: training read random
windows of a document stream, so nearly every window it saw started mid-document), and `n` windows of `length + 1`
ids are taken at evenly spaced, non-overlapping offsets spanning the whole text. Inputs are `w[:-1]`, targets
`w[1:]`: every window scores exactly `length` next tokens, each from an empty cache.

Why it matters (the sweep-vs-demo gap, 2026-12-03): the sweep used to score the first 512 tokens of the text only
(with a BOS), which for the demo model then shipped is one docstring of prose in `_strptime.py` (perplexity 2632,
exactly what HF transformers computes for those windows), while the demo scored 4 windows spread over the file
(210). Per-window perplexity of that overfit model ranged from about 1.4 to several thousand, so a few windows were a
poor sample: over 4 random windows of 256 its bf16 perplexity spanned 48..972 (5th..95th percentile) and fp8's
perplexity change +-3 points. The retrained model shipped since (bf16 perplexity 11.69 over the whole text) varies
far less per window (3.2 to 39 over the text's 109 windows of 256; over 4 random ones 7.8..17.9, 5th..95th
percentile, and fp8's change -0.2..+0.6 points), but a few windows are still a poor sample. Both commands now
default to DEFAULT_WINDOWS x DEFAULT_WINDOW_LEN tokens spread over the whole text; windows=0 scores every window
that fits.
"""
from __future__ import annotations

import os

import torch

from kie_moe.models.errors import ConfigError, InputError

from .synthetic import EMBEDDED_DEMO

HELDOUT = "heldout.txt"
DEFAULT_WINDOW_LEN = 256
DEFAULT_WINDOWS = 32          # 8192 scored tokens: on the shipped demo model fp8 top-1 sd ~0.002, ppl-change sd
                              # ~0.1 points (32 of the text's 109 windows of 256 drawn at random, 2026-12-03)


def heldout_file(model_dir: str | None) -> str | None:
    """The checkpoint's own held-out sample, else the embedded demo model's (when this build ships it)."""
    for d in ((model_dir,) if model_dir else ()) + (EMBEDDED_DEMO,):
        path = os.path.join(d, HELDOUT)
        if os.path.isfile(path):
            return path
    return None


def encode(tok, text: str, vocab: int) -> list[int]:
    """Token ids of `text` without special tokens. `tok`: kie_moe.tokenizer.Tokenizer or an HF tokenizer."""
    hf = getattr(tok, "tok", tok)
    # the fast backend directly: transformers' wrapper warns about sequences longer than model_max_length
    backend = getattr(hf, "backend_tokenizer", None)
    ids = backend.encode(text, add_special_tokens=False).ids if backend is not None else \
        hf.encode(text, add_special_tokens=False)
    if ids and max(ids) >= vocab:
        raise ConfigError(f"the tokenizer produced id {max(ids)} but the model's vocabulary is {vocab}")
    return list(ids)


def windows(ids, n: int, length: int) -> torch.Tensor:
    """n windows of length + 1 ids at evenly spaced, non-overlapping offsets over `ids` -> [n, length + 1]
    (n = 0 or more than fit: as many as fit). The first starts at 0, the last ends at the end of `ids`."""
    if length < 1:
        raise InputError(f"a window needs at least 1 scored token, got {length}")
    if len(ids) < length + 1:
        raise InputError(f"the text has {len(ids)} tokens; a window needs {length + 1}")
    fit = len(ids) // (length + 1)
    n = fit if n <= 0 else min(n, fit)
    span = len(ids) - (length + 1)
    starts = [round(i * span / (n - 1)) for i in range(n)] if n > 1 else [0]
    t = torch.as_tensor(ids, dtype=torch.long)
    return torch.stack([t[s:s + length + 1] for s in starts])


# ---- calibration text (kie convert --gptq) ---------------------------------------------------------------------
CALIB = "calib.txt"
DEFAULT_CALIB_TOKENS = 16384  # 64 windows of 256: demo model fp8 top-1 0.9713 (RTN) -> 0.9816; all 29k tokens of
                              # its calib.txt 0.9806 (eval sd ~0.002): no gain past ~8-16k (benchmarks/NOTES.md s10)


def calibration_windows(model_dir: str, text_file: str | None, tokens: int, vocab: int,
                        window: int = DEFAULT_WINDOW_LEN) -> tuple[torch.Tensor, str]:
    """GPTQ calibration token windows [n, window] (n = tokens // window, fewer when the text is shorter), cut as
    `windows` cuts held-out text, from `text_file`, else the checkpoint's calib.txt. -> (windows, label).
    Calibration text must not be the text quality is scored on: the demo model's calib.txt is train-split files
    only (scripts/make_calib_text.py)."""
    from kie_moe.tokenizer import Tokenizer, has_tokenizer
    if tokens < window:
        raise InputError(f"--calib-tokens must be at least one window ({window} tokens), got {tokens}")
    path = text_file if text_file is not None else os.path.join(model_dir, CALIB)
    if text_file is None and not os.path.isfile(path):
        raise InputError(f"{model_dir}: GPTQ needs calibration text and the checkpoint has no {CALIB}; give "
                         "--calib FILE (text like what the model will see: chat, code, prose)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or e
        raise InputError(f"--calib {path}: cannot read it as UTF-8 text ({why})") from None
    if not has_tokenizer(model_dir):
        raise ConfigError(f"{model_dir}: no tokenizer.json, so the calibration text {path} cannot be tokenized")
    ids = encode(Tokenizer(model_dir), text, vocab)
    if len(ids) < window:
        raise InputError(f"--calib {path}: {len(ids)} tokens, fewer than one calibration window of {window}")
    wins = windows(ids, tokens // window, window - 1)
    return wins, f"{os.path.relpath(path)} ({wins.shape[0]} windows of {window} of its {len(ids)} tokens)"


def gptq_options(model_dir: str, calib: str | None, tokens: int | None, device: str | None, damp: float,
                 enabled: bool = True):
    """`--gptq`'s settings (models.calibrate.GptqOptions) for the checkpoint at model_dir: its calibration windows
    (calibration_windows; tokens None: DEFAULT_CALIB_TOKENS), the device (kie_moe.engine.resolve_device) and the
    dampening fraction. enabled False (no --gptq): None, and --calib is refused (kie convert, sweep and demo)."""
    if not enabled:
        if calib is not None:
            raise InputError("--calib is calibration text for --gptq; add --gptq (or leave --calib out)")
        return None
    tokens = DEFAULT_CALIB_TOKENS if tokens is None else tokens
    from kie_moe.engine import resolve_device
    from kie_moe.models.calibrate import GptqOptions
    from kie_moe.models.loader import read_config
    if not 0 < damp < 1:
        raise InputError(f"--damp must be in (0, 1) (a fraction of the Hessian's mean diagonal), got {damp}")
    dev = resolve_device(device)
    cfg = read_config(model_dir)
    vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
    if not vocab:
        raise ConfigError(f"{os.path.join(model_dir, 'config.json')}: no vocab_size, needed to check the "
                          "calibration text's token ids")
    wins, label = calibration_windows(model_dir, calib, tokens, int(vocab))
    return GptqOptions(wins, str(dev), damp, label)
