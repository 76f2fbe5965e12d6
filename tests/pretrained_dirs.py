"""Small pretrained models as ``save_pretrained`` folders, for ``--init`` (tests/test_init.py and
the torchrun cases of tests/dist_init.py): a Llama stored in bfloat16 in several shards, a GPT-2
with tied embeddings in one file, each with a BPE tokenizer.json trained on a text file."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

WORDS = ("the", "a", "cat", "dog", "cow", "sat", "ran", "on", "under", "mat", "hill", "small", "big", "quickly")
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3: gpipe pads with 0


def text_file(folder: Path, lines: int = 120) -> Path:
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "text.txt"
    rows = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) + ".\n" for _ in range(lines))
    path.write_text("".join(rows))
    return path


def tokenizer_files(folder: Path, text: Path) -> int:
    """A BPE tokenizer.json trained on ``text`` and its tokenizer_config.json; returns its size."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train([str(text)], tokenizers.trainers.BpeTrainer(vocab_size=80, special_tokens=SPECIALS))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return int(tok.get_vocab_size())


def llama_config(vocab: int) -> Any:
    import transformers

    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip


def gpt2_config(vocab: int) -> Any:
    import transformers

    return transformers.GPT2Config(vocab_size=vocab, n_layer=2, n_embd=32, n_head=4, n_positions=64,
                                   bos_token_id=1, eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0)  # fmt: skip


def gemma_config(vocab: int) -> Any:
    import transformers

    return transformers.GemmaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                                    pad_token_id=0)  # fmt: skip


def save(kind: str, folder: Path, text: Path) -> Path:
    """A ``kind`` ('llama', 'gpt2' or 'gemma') model with seeded random weights saved in ``folder``:
    the Llama in bfloat16 in shards of at most 20 KB (an index and several files), the GPT-2 and the
    Gemma in float32 in one file, their output projection tied to the embeddings (absent from the
    file; Gemma also scales its embeddings)."""
    import transformers

    vocab = tokenizer_files(folder, text)
    config = {"llama": llama_config, "gpt2": gpt2_config, "gemma": gemma_config}[kind](vocab)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = transformers.AutoModelForCausalLM.from_config(config)
    if kind == "llama":
        model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="20KB")
    else:
        model.save_pretrained(folder)
    return folder


def reference(folder: Path) -> Any:
    """``from_pretrained(folder)`` in float32, in eval mode: what the pipeline must compute."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return model.eval()


def folders(root: Path) -> dict[str, Path]:
    """The text file and the three folders in ``root``, written on the first call (tests/test_init.py's
    fixture and the torchrun cases it adds to the session's pool share them)."""
    paths = {"text": root / "text.txt", **{kind: root / kind for kind in ("llama", "gpt2", "gemma")}}
    if not (root / "complete").exists():
        text = text_file(root)
        for kind in ("llama", "gpt2", "gemma"):
            save(kind, root / kind, text)
        (root / "complete").touch()
    return paths
