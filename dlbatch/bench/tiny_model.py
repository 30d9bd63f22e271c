"""A tiny random llama-like model (SmolLM's shape family: tied embeddings, one KV head, 2 layers)
written on the fly as config.json + model.safetensors + tokenizer.json, for benchmarks that
time everything but the model (`dlbatch bench scale`). It is the engine bench's random Llama
(`dlbatch.bench.random_model.make_random_llama`) at a tiny shape, in float32.

The tokenizer is word-level over whitespace: words ``t3`` .. ``t{vocab-1}`` are one token each,
so a document of N such words is N tokens. `random_words` draws seeded text from that vocabulary.
"""
from __future__ import annotations

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 1, "vocab_size": 4096, "head_dim": 16, "tie_word_embeddings": True,
         "max_position_embeddings": 1024}


def make_tiny_model(path: str, seed: int = 0, **shape) -> str:
    """Write the model under `path` (created); returns `path`. `shape` overrides SHAPE keys."""
    from dlbatch.bench.random_model import make_random_llama

    return make_random_llama(path, seed=seed, dtype="float32", **{**SHAPE, **shape})


def random_words(rng, n: int, vocab_size: int = SHAPE["vocab_size"]) -> str:
    """`n` words of the tiny model's vocabulary (one token each), drawn with `rng` (random.Random)."""
    return " ".join(f"t{rng.randrange(3, vocab_size)}" for _ in range(n))
