"""A tiny random-init Llama, a byte-level BPE tokenizer trained here, and a toy prompt set.

Everything is built locally (nothing is downloaded), for tests and the CPU demo::

    python -m conduit_verl.tiny /tmp/conduit-tiny

writes ``model/`` (config, weights, tokenizer, chat template) and ``data/{train,val}.parquet``
in verl's RL dataset layout (``prompt`` chat messages, ``data_source``, ``reward_model``).
:func:`compute_score` is a toy reward for verl's ``reward.custom_reward_function``.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

__all__ = ["make_tokenizer", "make_model", "make_dataset", "build", "compute_score", "main"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
WORDS = ["add", "sum", "two", "three", "four", "five", "plus", "minus", "what", "is", "the", "answer", "of",
         "and", "count", "apples", "pears", "numbers", "total", "make"]


def _corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
        out.append(f"user: {words} {a} + {b} = {a + b}\nassistant: the answer is {a + b}.")
    return out


def make_tokenizer(vocab_size: int = 320, seed: int = 0) -> Any:
    """A byte-level BPE tokenizer trained on a synthetic arithmetic corpus, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<pad>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(_corpus(2000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model(tokenizer: Any, *, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               max_positions: int = 512, seed: int = 0) -> Any:
    """A randomly initialised ``LlamaForCausalLM`` (untied embeddings, fp32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # LlamaConfig accepts torch_dtype at runtime (extra kwargs); its typed signature does not list it
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden,  # type: ignore[call-arg]
                      intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, tie_word_embeddings=False,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, torch_dtype="float32")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def make_dataset(path: Path, n: int, seed: int) -> None:
    """``n`` arithmetic prompts in verl's RL dataset layout, written as parquet."""
    import pandas as pd

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"data_source": "conduit/tiny-arith",
                     "prompt": [{"role": "user", "content": f"what is {a} + {b}"}],
                     "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"split": "train", "index": i}})
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)


def build(root: str | Path, *, hidden: int = 32, layers: int = 2, train_size: int = 64, val_size: int = 8,
          seed: int = 0) -> dict[str, Path]:
    """Write the model, tokenizer and datasets under ``root``; returns their paths."""
    root = Path(root)
    model_dir = root / "model"
    tok = make_tokenizer(seed=seed)
    model = make_model(tok, hidden=hidden, layers=layers, seed=seed)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    make_dataset(root / "data" / "train.parquet", train_size, seed)
    make_dataset(root / "data" / "val.parquet", val_size, seed + 1)
    return {"model": model_dir, "train": root / "data" / "train.parquet", "val": root / "data" / "val.parquet"}


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None,
                  **_: Any) -> float:
    """Toy reward: 1 for the right sum, else the share of digit characters (so GRPO groups differ)."""
    text = solution_str or ""
    if ground_truth and ground_truth in text.split():
        return 1.0
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conduit_verl.tiny", description=__doc__.splitlines()[0])
    p.add_argument("root", help="directory to write model/ and data/ into")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--train-size", type=int, default=64)
    a = p.parse_args(argv)
    paths = build(a.root, hidden=a.hidden, layers=a.layers, train_size=a.train_size)
    for k, v in paths.items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
