"""Tokenizer and chat template from the checkpoint directory (tokenizer.json / tokenizer_config.json), through
HF tokenizers/transformers. A checkpoint without tokenizer files still runs with prompt ids."""
from __future__ import annotations

import json
import os

from kie_moe.models.errors import ConfigError


def has_tokenizer(model_dir: str) -> bool:
    return any(os.path.exists(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer.model"))


_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def _broken_json(model_dir: str) -> str | None:
    """The first of the tokenizer's JSON files that is not valid JSON (transformers' own error names no file)."""
    for name in _TOKENIZER_JSON:
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            try:
                with open(path, encoding="utf-8") as f:
                    json.load(f)
            except (ValueError, UnicodeDecodeError):
                return path
    return None


class Tokenizer:
    def __init__(self, model_dir: str):
        if not has_tokenizer(model_dir):
            raise ConfigError(f"{model_dir}: no tokenizer.json (pass --prompt-ids, or add the tokenizer files)")
        from transformers import AutoTokenizer
        try:
            self.tok = AutoTokenizer.from_pretrained(model_dir)
        except Exception as e:
            raise ConfigError(f"{_broken_json(model_dir) or model_dir}: cannot load the tokenizer ({e})") from None

    @property
    def eos_token_id(self) -> int | None:
        return self.tok.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tok, "chat_template", None):
            raise ConfigError("this model has no chat template (tokenizer_config.json: chat_template)")
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


class IncrementalDecoder:
    """Streams text as ids arrive: decodes the whole suffix each time and emits what is new, holding back an
    incomplete UTF-8 sequence (shown as U+FFFD) until its next byte arrives."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.ids, self.emitted = tok, [], ""

    def push(self, tid: int) -> str:
        self.ids.append(tid)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.emitted = text[len(self.emitted):], text
        return new
