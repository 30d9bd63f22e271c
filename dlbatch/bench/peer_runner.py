"""Runs one peer engine (vLLM or llama.cpp) on prompts given as token ids, inside the
peer's own virtualenv: `dlbatch bench engine --peer-python PATH` executes this file with
PATH as a subprocess. It imports nothing from dlbatch (the peer's environment does not
have it) and only the standard library at module level.

Protocol (JSON files, so nothing is unpickled):
- `python peer_runner.py --detect` prints {"python": version, "backends": {"vllm":
  version or null, "llama_cpp": version or null}, "errors": {name: import error}}: a
  backend counts only if it really imports.
- `python peer_runner.py REQUEST.json RESULT.json` reads {"backend", "model",
  "prompts": [[token ids]], "max_tokens", "threads", "max_model_len", "warmup":
  [token ids], "dtype" (optional: float32, the default, or bfloat16)} and writes {"backend", "version", "outputs": [[token ids]], "load_s",
  "warmup_s", "wall_s", "settings"} or {"backend", "error"}; greedy decoding, EOS
  ignored, exactly `max_tokens` new tokens per prompt. `wall_s` is the generation of all
  prompts after the model is loaded and one short warm-up prompt has run.

vLLM: one `LLM.generate` call over every prompt (continuous batching, prefix caching on,
the request's dtype). llama.cpp: its Python API decodes one sequence at a time, so the prompts
are run one after another in the given order; `Llama` keeps the previous prompt's KV and
evaluates only the tokens after the longest common prefix, so the tasks of one paper,
given consecutively, share the paper's prefill. That is how a user of llama-cpp-python
runs this workload.
"""
from __future__ import annotations

import json
import sys
import time

BACKENDS = ("vllm", "llama_cpp")
DTYPES = ("float32", "bfloat16")


def detect() -> dict:
    import importlib
    import platform

    found, errors = {}, {}
    for name in BACKENDS:
        try:
            mod = importlib.import_module(name)
            found[name] = str(getattr(mod, "__version__", "unknown"))
        except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
            found[name] = None
            errors[name] = f"{type(e).__name__}: {e}"[:300]
    return {"python": platform.python_version(), "backends": found, "errors": errors}


def check_request(req: dict) -> None:
    """Raise ValueError naming the first bad field of a request."""
    if req.get("backend") not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {req.get('backend')!r}")
    prompts = req.get("prompts")
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if not isinstance(p, list) or not p or not all(isinstance(t, int) and t >= 0 for t in p):
            raise ValueError(f"prompt {i} must be a non-empty list of non-negative ints")
    for key in ("max_tokens", "threads", "max_model_len"):
        v = req.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{key} must be an integer >= 1, got {v!r}")
    if not isinstance(req.get("model"), str) or not req["model"]:
        raise ValueError(f"model must be a path, got {req.get('model')!r}")
    if req.get("dtype", "float32") not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {req.get('dtype')!r}")


def run_vllm(req: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams

    dtype = req.get("dtype", "float32")
    t0 = time.perf_counter()
    llm = LLM(model=req["model"], dtype=dtype, enable_prefix_caching=True, skip_tokenizer_init=True,
              max_model_len=req["max_model_len"], max_num_seqs=max(len(req["prompts"]), 1), seed=0)
    load_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True, detokenize=False)

    def gen(prompts):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    t0 = time.perf_counter()
    gen([req["warmup"]])
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outputs = gen(req["prompts"])
    wall_s = time.perf_counter() - t0
    return {"version": vllm.__version__, "outputs": outputs, "load_s": load_s, "warmup_s": warmup_s,
            "wall_s": wall_s, "settings": {"dtype": dtype, "enable_prefix_caching": True,
                                           "max_num_seqs": max(len(req["prompts"]), 1), "calls": "one generate"}}


def run_llama_cpp(req: dict) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=req["model"], n_ctx=req["max_model_len"], n_batch=512, n_threads=req["threads"],
                n_threads_batch=req["threads"], seed=0, verbose=False, logits_all=False)
    load_s = time.perf_counter() - t0

    def one(prompt):
        out = []
        for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            out.append(int(tok))
            if len(out) == req["max_tokens"]:
                break
        return out

    t0 = time.perf_counter()
    one(req["warmup"])
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outputs = [one(p) for p in req["prompts"]]
    wall_s = time.perf_counter() - t0
    return {"version": llama_cpp.__version__, "outputs": outputs, "load_s": load_s, "warmup_s": warmup_s,
            "wall_s": wall_s, "settings": {"n_threads": req["threads"], "n_ctx": req["max_model_len"],
                                           "n_batch": 512, "calls": "one sequence at a time, KV prefix reused"}}


def serve(req_path: str, out_path: str) -> int:
    with open(req_path) as f:
        req = json.load(f)
    backend = req.get("backend")
    try:
        check_request(req)
        res = {"backend": backend, **(run_vllm(req) if backend == "vllm" else run_llama_cpp(req))}
        rc = 0
    except Exception as e:  # noqa: BLE001 - reported to the bench, which prints it as "skipped"
        res, rc = {"backend": backend, "error": f"{type(e).__name__}: {e}"[:1000]}, 1
    with open(out_path, "w") as f:
        json.dump(res, f)
    return rc


def main(argv: list[str]) -> int:
    if argv == ["--detect"]:
        print(json.dumps(detect()))
        return 0
    if len(argv) != 2:
        print("usage: peer_runner.py --detect | REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    return serve(argv[0], argv[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
