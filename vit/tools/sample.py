"""Generate text from a trained character GPT; the checkpoint alone is enough (it holds the vocabulary).

    vit-sample runs/gpt_cpu/checkpoints/last.ckpt --prompt "ROMEO:" --max_new_tokens 500
    vit-sample CKPT --temperature 0.8 --top_k 200 --seed 1337 --num_samples 3

temperature 0 is greedy decoding; the same seed gives the same text. (`python scripts/sample.py ...`
is the same command.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from vit.checkpoint import load_checkpoint
from vit.data.text import CharTokenizer
from vit.tools.args import non_negative_float, non_negative_int, positive_int


def sample(
    ckpt_path: str | Path,
    prompt: str = "\n",
    max_new_tokens: int = 500,
    temperature: float = 0.8,
    top_k: int | None = 200,
    seed: int = 1337,
    num_samples: int = 1,
    use_cache: bool = True,
) -> list[str]:
    """`num_samples` continuations of `prompt` (each includes the prompt)."""
    if not prompt:
        raise ValueError("the prompt is empty; give at least one character, e.g. --prompt $'\\n'")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    model, meta = load_checkpoint(ckpt_path)
    vocab = meta.get("vocab")
    if vocab is None:
        raise ValueError(f"{ckpt_path} has no vocabulary; it was not written by a LanguageModel run")
    tokenizer = CharTokenizer(vocab)
    idx = torch.tensor([tokenizer.encode(prompt)] * num_samples, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    out = model.generate(idx, max_new_tokens, temperature, top_k, generator=generator, use_cache=use_cache)
    return [tokenizer.decode(row) for row in out]


def main(args: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt", help="a .ckpt written by scripts/train.py with a LanguageModel")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument("--max_new_tokens", type=non_negative_int, default=500)
    parser.add_argument(
        "--temperature", type=non_negative_float, default=0.8, help="0 is greedy; above 1 is more random"
    )
    parser.add_argument(
        "--top_k", type=non_negative_int, default=200, help="sample from the k likeliest characters; 0 = all"
    )
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--num_samples", type=positive_int, default=1)
    parser.add_argument("--no_cache", action="store_true", help="recompute the whole context every step")
    opts = parser.parse_args(args)
    texts = sample(
        opts.ckpt,
        opts.prompt,
        opts.max_new_tokens,
        opts.temperature,
        opts.top_k or None,
        opts.seed,
        opts.num_samples,
        use_cache=not opts.no_cache,
    )
    for i, text in enumerate(texts):
        if i:
            print("-" * 40)
        print(text)
    return texts


def cli() -> None:
    """The `vit-sample` command: bad input ends with the message, not a traceback."""
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    cli()
