"""LoRA adapters: where a job's adapters are, what they are by content, and how a worker
hands them to its engine (docs/adapters.md).

A job names its adapters in ``model.adapters: {name: folder or Hub id}``; a task runs one
(``adapter: name``), an OpenAI batch line names one in ``body.model``. The adapter travels
with every request as its name (``item["adapter"]``; None: the base model), so:

- the driver never folds, groups or orders requests of two adapters as one prefix
  (the router's prefix salt and the prefix order key hold the name);
- a worker turns the name into the engine's adapter request (`AdapterSet.request`) with a
  fixed integer id per name (the sorted names, 1..N), the same in every worker, so the
  engine's prefix cache (vLLM keys its blocks by that id) never shares KV across adapters.

vLLM's CPU build (0.32.0) gathers the LoRA weights of every token of a batch by its slot
index, and a base-model token's index is -1, which Python reads as the last slot: in a batch
mixing base and adapter requests the base requests get an adapter
(``vllm/lora/ops/torch_ops/lora_ops.py``, ``lora_b_weights[lora_indices_tensor]``). So on a
CPU a job with adapters runs its base-model requests through a zero adapter (``base_slot``:
A and B all zeros, the first adapter's shapes), whose delta is exactly zero: every token has
a real slot and the base requests' output is the base model's. CUDA kernels skip index -1.

An adapter is a PEFT folder: ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``) and ``adapter_model.safetensors`` (pickled weights are never loaded).
A Hub id resolves through the Hugging Face cache as a model does (`dlbatch.engine.hub`), on
each node. Its identity (`adapter_identity`) is the sha256 of those files' bytes: the job
fingerprint records it, so a changed adapter refuses the resume as a changed model does.
"""
from __future__ import annotations

import hashlib
import json
import os

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM takes


def adapter_dir(name: str, ref: str) -> str:
    """The local folder of adapter ``name`` (``ref``: a local folder or a Hub id), holding its
    config and safetensors weights; raises ValueError naming what is missing."""
    from dlbatch.engine.hub import is_hub_id, snapshot

    path = snapshot(ref) if is_hub_id(ref) else ref
    missing = [f for f in (CONFIG, WEIGHTS) if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise ValueError(f"adapter {name!r} ({ref}): {path} has no {' and no '.join(missing)} (a PEFT LoRA folder "
                         "with safetensors weights)")
    return path


def adapter_rank(path: str) -> int:
    """The rank ``r`` of the adapter in folder ``path`` (its adapter_config.json)."""
    with open(os.path.join(path, CONFIG)) as f:
        cfg = json.load(f)
    r = cfg.get("r")
    if cfg.get("peft_type", "LORA").upper() != "LORA" or not isinstance(r, int) or r < 1:
        raise ValueError(f"adapter {path}: {CONFIG} is not a LoRA config with an integer rank r "
                         f"(peft_type {cfg.get('peft_type')!r}, r {r!r})")
    return r


def adapter_identity(name: str, ref: str) -> str:
    """``sha256:<hex>`` of the adapter's config and weights (names and bytes, in order)."""
    path = adapter_dir(name, ref)
    h = hashlib.sha256()
    for fname in (CONFIG, WEIGHTS):
        h.update(fname.encode() + b"\0")
        with open(os.path.join(path, fname), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def lora_limits(adapters: dict[str, str], max_loras: int | None, max_lora_rank: int | None) -> tuple[int, int]:
    """(max_loras, max_lora_rank) a worker's engine is built with: the job's, else all of its
    adapters at once and their largest rank, the rank rounded up to a value vLLM takes."""
    ranks = [adapter_rank(adapter_dir(n, r)) for n, r in sorted(adapters.items())]
    need = max(ranks)
    rank = max_lora_rank if max_lora_rank is not None else need
    if rank < need:
        raise ValueError(f"model.max_lora_rank {rank} is below the rank {need} of an adapter of the job")
    fits = [r for r in RANKS if r >= rank]
    if not fits:
        raise ValueError(f"model.max_lora_rank {rank}: the largest rank the engine takes is {RANKS[-1]}")
    return (max_loras if max_loras is not None else len(adapters)), fits[0]


BASE = "dlbatch-base"  # the zero adapter's name (base_slot): not a name a job can give (model.adapters)


def zero_adapter(like: str) -> str:
    """The folder of an adapter of the shapes of the one in folder ``like`` whose weights are
    all zeros: made once per user cache (keyed by ``like``'s config and weights' sizes) and
    shared by the workers of a node."""
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file

    from dlbatch.cache import publish_dir, user_cache_dir

    h = hashlib.sha256()
    with open(os.path.join(like, CONFIG), "rb") as f:
        h.update(f.read())
    h.update(str(os.path.getsize(os.path.join(like, WEIGHTS))).encode())
    root = user_cache_dir("lora")
    dst = os.path.join(root, "zero-" + h.hexdigest()[:20])
    if os.path.exists(os.path.join(dst, "COMPLETE")):
        return dst
    tmp = tempfile.mkdtemp(prefix=".zero-", dir=root)
    try:
        shutil.copyfile(os.path.join(like, CONFIG), os.path.join(tmp, CONFIG))
        save_file({k: v.zero_() for k, v in load_file(os.path.join(like, WEIGHTS)).items()}, os.path.join(tmp, WEIGHTS))
        publish_dir(tmp, dst)  # another worker may have made it first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


class AdapterSet:
    """A worker's adapters: name -> (integer id, local folder), resolved when the worker starts."""

    def __init__(self, adapters, base_slot: bool = False):
        """``adapters``: (name, ref) pairs (`WorkerSpec.adapters`); ``base_slot``: base-model
        requests run through a zero adapter (vLLM's CPU build: see the module's docstring)."""
        self.ids = {name: i for i, (name, _) in enumerate(sorted(adapters), start=1)}
        self.paths = {name: adapter_dir(name, ref) for name, ref in adapters}
        if base_slot and self.ids:
            self.paths[BASE] = zero_adapter(self.paths[min(self.ids)])
            self.ids[BASE] = len(self.ids) + 1

    def __bool__(self) -> bool:
        return bool(self.ids)

    def request(self, name: str | None):
        """vLLM's ``LoRARequest`` for adapter ``name``; None (or the zero adapter's, with
        ``base_slot``) for the base model. An unknown name is the request's error, naming the
        adapters there are."""
        if not name:
            name = BASE if BASE in self.ids else None
        if not name:
            return None
        if name not in self.ids:
            raise ValueError(f"adapter {name!r} is not one of this job's adapters "
                             f"({', '.join(self.ids) or 'none'}: model.adapters)")
        from vllm.lora.request import LoRARequest

        return LoRARequest(name, self.ids[name], self.paths[name])
