"""Instruction and chat data for the fine-tuning tests (tests/test_instruct.py, the docs' runnable
block): a small Llama ``save_pretrained`` folder whose BPE tokenizer has ChatML's turn tokens and
chat template, and JSON Lines files of prompt/completion and chat records, answers of long-tailed
lengths (most short, a few near the row's length)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

WORDS = ("the", "a", "cat", "dog", "cow", "sat", "ran", "on", "under", "mat", "hill", "small", "big", "what", "where")
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]  # ids 0..5

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML, as Qwen's and many others' templates render a chat."""


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def tokenizer_folder(folder: Path) -> int:
    """A BPE tokenizer.json with ChatML's tokens, its tokenizer_config.json naming them and the
    chat template; returns its size."""
    import tokenizers

    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.txt"
    corpus.write_text("".join(_sentence(rng, 8) + " .\n" for _ in range(200)) + "user assistant system\n")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train([str(corpus)], tokenizers.trainers.BpeTrainer(vocab_size=90, special_tokens=SPECIALS))
    corpus.unlink()
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<pad>", "unk_token": "<unk>",
              "chat_template": CHATML}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return int(tok.get_vocab_size())


def model_folder(folder: Path, *, positions: int = 128, hidden: int = 32, layers: int = 2) -> Path:
    """A small Llama with seeded random weights and the chat tokenizer, saved in ``folder``."""
    import transformers

    vocab = tokenizer_folder(folder)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                                      bos_token_id=1, eos_token_id=5, pad_token_id=0)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    return folder


def answer_length(rng: random.Random, most: int) -> int:
    """Long-tailed: most answers a few words, one in ten near ``most``."""
    return rng.randint(most * 3 // 4, most) if rng.random() < 0.1 else rng.randint(1, 4)


def chat_records(n: int, *, seed: int = 0, longest: int = 40) -> list[dict[str, Any]]:
    """Chats of a system turn (sometimes), a question and an answer (sometimes two rounds); the
    answer repeats the question's last word, so that it can be learned."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        messages = [{"role": "system", "content": "a small cat"}] if rng.random() < 0.3 else []
        for _ in range(rng.choice((1, 1, 2))):
            question = _sentence(rng, rng.randint(2, 6))
            last = question.split()[-1]
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": " ".join([last] * answer_length(rng, longest))})
        records.append({"messages": messages})
    return records


def completion_records(n: int, *, seed: int = 0, longest: int = 40) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        prompt = _sentence(rng, rng.randint(2, 6))
        records.append({"prompt": prompt, "completion": " ".join([prompt.split()[-1]] * answer_length(rng, longest))})
    return records


def write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
