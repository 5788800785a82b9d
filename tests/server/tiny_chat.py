"""A tiny checkpoint with a real tokenizer and chat template, for the server tests: a byte-level BPE trained on a
few KB of generated ASCII text (so every id decodes to plain ASCII and decoding is concatenative, which the
stop-string tests rely on), wrapped in PreTrainedTokenizerFast and saved next to a tiny llama made by
tests/models/hf_tiny.make_checkpoint with vocab_size set to the tokenizer's size."""
from __future__ import annotations

import random

from tests.models import hf_tiny

EOS = "</s>"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}" + EOS + "\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
WORDS = ("the a expert router token stream kernel weight cache layer prompt model server queue request reply "
         "fast slow small large one two three four five six seven eight nine ten red blue green of to in on "
         "and or but with without before after every each some many few").split()


def corpus(n_words: int = 1200, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_words // 12):
        words = [rng.choice(WORDS) for _ in range(12)]
        lines.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ",", ";"]))
        # chat-formatted turns, so the template's markers tokenize into merges rather than lone bytes
        lines.append(f"<|{rng.choice(['user', 'assistant', 'system'])}|>\n" + " ".join(words[:6]) + EOS)
    # every printable ASCII byte once, so any ASCII prompt encodes losslessly
    lines.append("".join(chr(c) for c in range(32, 127)) + "\n\t")
    return lines


def make_tokenizer(vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # no initial_alphabet: only the bytes seen in the ASCII corpus, so no id decodes to a lone UTF-8 fragment
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, chat_template=CHAT_TEMPLATE,
                                   clean_up_tokenization_spaces=False)


def make_chat_checkpoint(out_dir: str, max_position: int = 4096, with_tokenizer: bool = True) -> str:
    tok = make_tokenizer()
    name = f"server_llama_{len(tok)}_{max_position}"
    # a llama sized to the tokenizer; registered as a case so make_checkpoint builds and saves it
    hf_tiny.CASES[name] = ("llama", dict(vocab_size=len(tok), intermediate_size=96,
                                         max_position_embeddings=max_position, num_hidden_layers=2))
    hf_tiny.make_checkpoint(name, out_dir)
    if with_tokenizer:
        tok.save_pretrained(out_dir)
    return out_dir
