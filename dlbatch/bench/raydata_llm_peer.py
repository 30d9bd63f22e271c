"""The peer of `dlbatch bench pipeline --backend vllm`: the same papers and tasks through
Ray Data LLM on vLLM, as its documentation has a user write it, run by the peer's own
Python (`--peer-python`), so it imports nothing of dlbatch.

    python raydata_llm_peer.py REQUEST.json RESULT.json

REQUEST: {"jsonl": documents {"id", "text"}, "model": an HF folder, "tasks": [{"name",
"prefix", "suffix", "max_tokens"}] (the prompt is prefix + text + suffix, sent as the user
message through the model's chat template), "dtype", "max_model_len", "num_cpus",
"batch_size", "env": vLLM's settings for its engine}. RESULT: {"rows": [{"doc_id", "task",
"output", "output_tokens"}], "wall_s" (from this process's start, Ray's start-up
included), "ray": version, "vllm": version} or {"error"}.
"""
from __future__ import annotations

import json
import sys
import time

T0 = time.time()


def run(req: dict) -> dict:
    import ray
    import vllm
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    # Ray Data LLM's chat-template and tokenize stages each keep an actor holding one logical
    # CPU; on a 2-core machine the vLLM stage's actor would then wait forever for its CPU.
    # Logical CPUs are scheduling tokens: four more let every stage start, while vLLM's
    # threads stay bound to the real cores by VLLM_CPU_OMP_THREADS_BIND.
    ray.init(num_cpus=req["num_cpus"] + 4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": req.get("env", {})})
    tasks = req["tasks"]

    def expand(row: dict) -> list[dict]:
        return [{"doc_id": row["id"], "task": t["name"], "prompt": t["prefix"] + row["text"] + t["suffix"],
                 "max_tokens": t["max_tokens"]} for t in tasks]

    config = vLLMEngineProcessorConfig(
        model_source=req["model"],
        engine_kwargs={"dtype": req["dtype"], "max_model_len": req["max_model_len"], "enable_prefix_caching": True,
                       **req.get("engine_kwargs", {})},
        concurrency=1, batch_size=req["batch_size"],
        # its Prometheus export needs Ray Serve, which `ray[data]` does not install
        log_engine_metrics=False,
        placement_group_config={"bundles": [{"CPU": 1}]},
        runtime_env={"env_vars": req.get("env", {})})
    processor = build_processor(
        config,
        preprocess=lambda r: {"doc_id": r["doc_id"], "task": r["task"],
                              "messages": [{"role": "user", "content": r["prompt"]}],
                              "sampling_params": {"temperature": 0.0, "max_tokens": int(r["max_tokens"])}},
        postprocess=lambda r: {"doc_id": r["doc_id"], "task": r["task"], "output": r["generated_text"],
                               "output_tokens": int(r.get("num_generated_tokens") or 0)})
    ds = processor(ray.data.read_json(req["jsonl"]).flat_map(expand))
    rows = ds.take_all()
    wall = time.time() - T0
    ray.shutdown()
    return {"rows": rows, "wall_s": wall, "ray": ray.__version__, "vllm": vllm.__version__}


def main() -> int:
    with open(sys.argv[1]) as f:
        req = json.load(f)
    try:
        res, rc = run(req), 0
    except Exception as e:  # noqa: BLE001 - reported to the bench, which prints the column as failed
        res, rc = {"error": f"{type(e).__name__}: {e}"[-2000:]}, 1
    with open(sys.argv[2], "w") as f:
        json.dump(res, f)
    return rc


if __name__ == "__main__":
    sys.exit(main())
