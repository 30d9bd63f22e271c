"""Tokenizer + chat template: a `tokenizers.Tokenizer` built from tokenizer.json or from
GGUF metadata, and the model's chat template rendered in a Jinja sandbox."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Pre-tokenisation patterns of common BPE vocabularies (public facts of those tokenizers).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TokenizerError(ValueError):
    pass


@dataclass
class Tokenizer:
    tk: Any  # tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos: bool = False  # add BOS ourselves (GGUF); tokenizer.json post-processors do it themselves

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tk.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        encs = self.tk.encode_batch(texts, add_special_tokens=add_special_tokens)
        out = []
        for e in encs:
            ids = e.ids
            if add_special_tokens and self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
                ids = [self.bos_token_id] + ids
            out.append(ids)
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: str | list[dict], add_generation_prompt: bool = True,
                            template: str | None = None, **kwargs) -> str:
        """Render ``messages`` with ``template`` (default: the model's); ``kwargs`` are extra
        template variables (e.g. ``enable_thinking``)."""
        template = template or self.chat_template
        if template is None:
            raise TokenizerError("this model has no chat template; use chat=False")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return _render_chat(template, messages, add_generation_prompt, self.bos_token or "", self.eos_token or "",
                            **kwargs)

    def encode_prompt(self, prompt: str, chat: bool) -> list[int]:
        if chat:
            return self.encode(self.apply_chat_template(prompt), add_special_tokens=False)
        return self.encode(prompt)


_CHAT_ENV = None


def _render_chat(template: str, messages, add_generation_prompt: bool, bos: str, eos: str, **kwargs) -> str:
    global _CHAT_ENV
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if _CHAT_ENV is None:
        _CHAT_ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise TokenizerError(f"chat template: {msg}")

        _CHAT_ENV.globals["raise_exception"] = raise_exception
    tpl = _CHAT_ENV.from_string(template)
    return tpl.render(**kwargs, messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos,
                      eos_token=eos)


def tokenizer_from_hf_files(tokenizer_json: str, tokenizer_config: dict | None, chat_template_file: str | None,
                            eos_ids: tuple[int, ...], bos_id: int | None) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    tk = HFTokenizer.from_str(tokenizer_json)
    cfg = tokenizer_config or {}

    def tok_str(v):
        if isinstance(v, dict):
            return v.get("content")
        return v

    bos_token = tok_str(cfg.get("bos_token"))
    eos_token = tok_str(cfg.get("eos_token"))
    if bos_id is None and bos_token is not None:
        bos_id = tk.token_to_id(bos_token)
    eos = list(eos_ids) + [e for e in cfg.get("eos_token_ids", []) if e not in eos_ids]
    if eos_token is not None:
        eid = tk.token_to_id(eos_token)
        if eid is not None and eid not in eos:
            eos.append(eid)
    template = chat_template_file or cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return Tokenizer(tk=tk, bos_token_id=bos_id, eos_token_ids=tuple(eos), chat_template=template,
                     bos_token=bos_token, eos_token=eos_token,
                     add_bos=bool(cfg.get("add_bos_token", False)) and tk.post_processor is None)


def tokenizer_from_gguf(meta: dict[str, Any], source: str) -> Tokenizer:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerError(f"{source}: GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges_raw: list[str] = meta.get("tokenizer.ggml.merges") or []
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("llama-bpe", "llama3"):
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in ("qwen2",):
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tk.pre_tokenizer = byte_level
    tk.decoder = decoders.ByteLevel()
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t in (3, 4)]
    if special:
        tk.add_special_tokens(special)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = tuple(x for x in (eos, meta.get("tokenizer.ggml.eot_token_id")) if x is not None)
    return Tokenizer(
        tk=tk,
        bos_token_id=bos,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=tokens[bos] if bos is not None else None,
        eos_token=tokens[eos] if eos is not None else None,
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    )
