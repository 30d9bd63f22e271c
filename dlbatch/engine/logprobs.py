"""Logprobs as results carry them (both backends): per output token
``{"token": str, "token_id": int, "logprob": float, "top": [{"token", "token_id", "logprob"}, ...]}``,
the top k sorted by logprob, highest first; each token's text is our tokenizer's decoding of
it alone, special tokens included."""
from __future__ import annotations


def logprob_entries(tokenizer, raw) -> list[dict]:
    """``raw``: per output token (token id, its logprob, top-k ids, their logprobs)."""
    cache: dict[int, str] = {}

    def text(t: int) -> str:
        s = cache.get(t)
        if s is None:
            s = cache[t] = tokenizer.decode([t], skip_special_tokens=False)
        return s

    return [{"token": text(int(tok)), "token_id": int(tok), "logprob": float(lp),
             "top": [{"token": text(int(i)), "token_id": int(i), "logprob": float(v)} for i, v in zip(ids, lps)]}
            for tok, lp, ids, lps in raw]
