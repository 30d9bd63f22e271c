"""Shared helpers of the benchmarks: timing with medians, ratios, tables, JSON, machine info."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Callable, Iterable, Sequence


def median(xs: Iterable[float]) -> float:
    xs = [float(x) for x in xs]
    if not xs:
        raise ValueError("median of no values")
    return statistics.median(xs)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def time_repeats(fn: Callable[[], object], repeats: int, device: str = "cpu", warmup: int = 1,
                 budget_s: float | None = None) -> list[float]:
    """Seconds per call of `fn`, `repeats` times after `warmup` untimed calls. With
    `budget_s`, stops early (keeping at least one timing) once the timed calls have used
    the budget: a slow baseline then gets fewer repeats, and the caller reports how many."""
    for _ in range(warmup):
        fn()
        sync(device)
    ts: list[float] = []
    spent = 0.0
    for _ in range(max(1, repeats)):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        dt = time.perf_counter() - t0
        ts.append(dt)
        spent += dt
        if budget_s is not None and spent >= budget_s:
            break
    return ts


def fmt(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        if x != 0 and (abs(x) >= 1e6 or abs(x) < 10 ** -digits):
            return f"{x:.3g}"
        return f"{x:,.{digits}f}"
    return str(x)


def table(headers: Sequence[str], rows: Sequence[Sequence], title: str | None = None) -> str:
    cells = [[str(h) for h in headers]] + [[fmt(c) if not isinstance(c, str) else c for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    if title:
        lines.append(title)
    for j, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def targets_table(targets: list[dict], title: str = "target") -> str:
    """A bench's targets ({"target", "value", "goal", "met"}) as a table."""
    return table([title, "measured", "goal", "met"],
                 [[t["target"], "-" if t["value"] is None else f"{t['value']:.3g}", f"{t['goal']:g}",
                   "not measured" if t["met"] is None else ("yes" if t["met"] else "NO")] for t in targets])


def machine_info(device: str = "cpu") -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        info["loadavg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if str(device).startswith("cuda") and torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def write_json(path: str | None, obj: dict) -> None:
    if not path:
        return
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.write("\n")
    print(f"wrote {path}")


# ---------------------------------------------------------------------------- jobs (pipeline, router)
SAMPLE_PAPERS = "samples/papers"


def sample_documents(n: int, max_chars: int | None = None, papers_dir: str = SAMPLE_PAPERS) -> list[dict]:
    """`n` documents from the sample papers (parsed once with the PDF connector). Beyond
    the number of papers, copies are made distinct at their first tokens ("Copy i.") so no
    two documents share more than the chat template as prefix."""
    import glob

    from connectors import read_document_file

    base = []
    for path in sorted(glob.glob(os.path.join(papers_dir, "*.pdf"))):
        for d in read_document_file(os.path.abspath(path), "pdf"):
            if d.get("text") and not d.get("error"):
                base.append({"title": d.get("title") or os.path.basename(path), "text": d["text"]})
    if not base:
        raise RuntimeError(f"no readable sample papers under {papers_dir}")
    docs = []
    for i in range(n):
        b = base[i % len(base)]
        text = b["text"] if i < len(base) else f"Copy {i // len(base)}.\n{b['text']}"
        if max_chars:
            text = text[:max_chars]
        docs.append({"id": f"doc{i:04d}", "title": b["title"], "text": text})
    return docs


def finish_bench(result: dict, render, json_path: str | None) -> int:
    """A benchmark's ending: its rendered table, then every figure to `json_path`."""
    print()
    print(render(result))
    write_json(json_path, result)
    return 0


def write_jsonl(path: str, rows: list[dict]) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def run_job(job: str, overrides: list[str]) -> tuple[dict, dict]:
    """Run a job with `--set`-style overrides through `JobRunner` (fresh output);
    -> (report, {(doc_id, task): output text})."""
    from dlbatch.output.parquet_store import ParquetStore
    from dlbatch.jobspec import load_job
    from dlbatch.driver.runner import JobRunner

    spec = load_job(job, overrides)
    report = JobRunner(spec, fresh=True, progress=False).run()
    tbl = ParquetStore(spec.output.path).results(columns=["doc_id", "task", "output"])
    outputs = {(r["doc_id"], r["task"]): r["output"] for r in tbl.to_pylist()}
    return report, outputs


def sized_overrides(args, job: str, base: list[str]) -> tuple[list[str], object]:
    """A pipeline bench's job overrides: ``base``, then its --dtype, --max-model-len,
    --max-tokens (every task) and --set; -> (overrides, the job loaded with them)."""
    from dlbatch.jobspec import load_job

    out = list(base)
    if args.dtype:
        out.append(f"model.dtype={args.dtype}")
    if args.max_model_len:
        out.append(f"model.max_model_len={args.max_model_len}")
    if args.max_tokens:
        out += [f"tasks.{i}.max_tokens={args.max_tokens}" for i in range(len(load_job(job, base).tasks))]
    out += list(args.overrides)
    return out, load_job(job, out)


def job_overrides_for_docs(jsonl: str, out: str) -> list[str]:
    return ["input.format=jsonl", f"input.path={jsonl}", "input.text_field=text", "input.id_field=id",
            f"output.path={out}"]


# ---------------------------------------------------------------------------- transformers baseline
def load_hf_model(how: dict, dtype: str, device: str):
    """transformers model for the same weights: `how` = {"path"} for an HF directory, or
    {"path", "gguf_file", "fallback"} for a GGUF (loaded with `from_pretrained(gguf_file=...)`,
    dequantised to a dense model so it computes in `dtype` like any HF model; `fallback`, our
    conversion of the same file, only if transformers cannot read it). -> (model, source)."""
    import logging as _logging

    import torch
    from transformers import AutoModelForCausalLM

    kw = {"dtype": getattr(torch, dtype), "attn_implementation": "sdpa"}
    source = how["path"]
    try:
        if "gguf_file" in how:
            try:
                from transformers import GgufConfig

                kw["quantization_config"] = GgufConfig(gguf_file=how["gguf_file"], dequantize=True)
            except ImportError:  # older transformers: always dequantises
                pass
            model = AutoModelForCausalLM.from_pretrained(how["path"], gguf_file=how["gguf_file"], **kw)
            source = f"{how['gguf_file']} via transformers' GGUF loader (dequantised)"
        else:
            model = AutoModelForCausalLM.from_pretrained(how["path"], **kw)
    except Exception as e:  # noqa: BLE001 - fall back to our conversion of the same file
        if "fallback" not in how:
            raise
        _logging.getLogger("dlbatch.bench").warning(
            "transformers could not load the GGUF (%s); using dlbatch's conversion of it", e)
        kw.pop("quantization_config", None)
        model = AutoModelForCausalLM.from_pretrained(how["fallback"], **kw)
        source = f"{how['fallback']} (dlbatch's conversion of the GGUF)"
    return model.to(device).eval(), source


def packed_modules(model) -> int:
    """Modules that keep quantised blocks (not a dense matmul in the model's dtype)."""
    return sum(1 for m in model.modules() if "gguf" in type(m).__name__.lower())


def job_chips(spec) -> dict[str, int]:
    """chip -> workers of the pools a run of ``spec`` starts (its resolved layout)."""
    from dlbatch.driver.config import RunConfig

    return {p.chip: p.replicas for p in RunConfig.resolve(spec).pools.values()}


def start_bench_ray(chips: dict[str, int], attempts: int = 2) -> bool:
    """One local Ray for the whole benchmark (both sides run on it, so neither pays Ray's
    start-up in its wall time). Retries once: on a heavily loaded machine Ray's node
    start-up can time out. Returns True when we started it (shut it down after)."""
    import ray

    from dlbatch.workers.session import start_ray

    if ray.is_initialized():
        return False
    for i in range(attempts):
        try:
            return start_ray(None, {c: 2 * n + 2 for c, n in chips.items()})
        except Exception:  # noqa: BLE001
            if ray.is_initialized():
                ray.shutdown()
            if i == attempts - 1:
                raise
            time.sleep(5)
    return False
