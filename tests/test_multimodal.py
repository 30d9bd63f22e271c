"""Vision-language jobs (docs/multimodal.md): the job schema and its refusals, the prompt
stage's image prompts (the model's processor builds them and counts their tokens), the
long-input policy over image tokens, and jobs on vLLM with a tiny random Idefics3 made by
transformers (tests/helpers/tiny_vlm.py): the engine counts the prompt as we do, the job
over the sample papers with page images and figure crops commits every row once across a
driver kill -9. The vLLM parts need vLLM (`make setup-vllm`); skipped, with the reason,
without it.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time

import pytest
import yaml

from dlbatch.backends import REGISTRY
from dlbatch.jobspec import JobSpecError, load_job
from tests.helpers.jobs import REPO, check_committed, committed_parts, kill_group_and_ray, start_run

WHY = REGISTRY["vllm"].unavailable_reason()
PAPERS = os.path.join(REPO, "samples", "papers")
KIND = {"type": "object", "properties": {"kind": {"enum": ["plot", "table", "photo"]}}, "required": ["kind"],
        "additionalProperties": False}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from tests.helpers.tiny_vlm import make_tiny_vlm

    path = str(tmp_path_factory.mktemp("vlm") / "model")
    make_tiny_vlm(path)
    return path


def _job(tmp_path, model, tasks=None, backend="vllm", **top) -> str:
    tasks = tasks if tasks is not None else [
        {"name": "pages", "prompt": "{{ text }}\n\nWhat do these pages show?", "max_tokens": 8,
         "images": {"pages": "first:2", "dpi": 72}},
        {"name": "figs", "prompt": "{{ figures }}What kind of figures are these?", "max_tokens": 40,
         "images": {"figures": True, "dpi": 72}, "output": {"json_schema": KIND}},
        {"name": "text", "prompt": "{{ text }}\n\nSummarize.", "max_tokens": 8}]
    job = {"name": "vlm", "pipeline": "papers", "input": {"format": "pdf", "path": PAPERS},
           "output": {"path": str(tmp_path / "out")},
           "model": {"name": model, "backend": backend, "dtype": "float32", "max_model_len": 2048},
           "tasks": tasks, "sampling": {"temperature": 0.0, "seed": 0},
           "cluster": {"colocated": {"chip": "fast", "replicas": 1, "num_cpus": 1}}, **top}
    if backend != "vllm":
        job["cluster"] = {"colocated": {"chip": "fast", "replicas": 1, "num_cpus": 1}}
    path = tmp_path / f"job-{len(list(tmp_path.glob('job-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def _doc(name: str, spec) -> dict:
    from connectors.parse import parse_file
    from dlbatch.prompts.multimodal import parse_request

    (doc,) = parse_file({"url": os.path.join(PAPERS, name)}, "pdf", "text", None, None, 1000,
                        images=parse_request(spec))
    return doc


# ------------------------------------------------------------------ the job file
def test_image_tasks_are_checked_when_the_job_loads(tmp_path, vlm):
    spec = load_job(_job(tmp_path, vlm))
    assert spec.tasks[0].images.pages == "first:2" and spec.tasks[1].images.figures
    with pytest.raises(JobSpecError, match=r"task 'x' uses figure but asks for no images: give it images:"):
        load_job(_job(tmp_path, vlm, [{"name": "x", "prompt": "{{ figure('Figure 1') }} what?"}]))
    with pytest.raises(JobSpecError, match=r"pages 'last:2': give a list of page numbers, 'all' or 'first:N'"):
        load_job(_job(tmp_path, vlm, [{"name": "x", "prompt": "{{ text }}", "images": {"pages": "last:2"}}]))
    with pytest.raises(JobSpecError, match=r"long_inputs chunk does not map images over chunks"):
        load_job(_job(tmp_path, vlm, [{"name": "x", "prompt": "{{ text }}", "images": {}}], long_inputs="chunk"))
    with pytest.raises(JobSpecError, match=r"page images and figure crops come from PDF inputs, not jsonl"):
        load_job(_job(tmp_path, vlm), ["input.format=jsonl", "input.path=samples/papers.jsonl"])


def test_our_engine_refuses_images_and_a_vlm_naming_the_vllm_backend(tmp_path, vlm):
    from dlbatch.driver.config import RunConfig

    with pytest.raises(JobSpecError, match=r"image inputs .*: model.backend dlbatch does not run them\..*"
                                           r"set model.backend: vllm"):
        load_job(_job(tmp_path, vlm, backend="dlbatch"))
    text_only = load_job(_job(tmp_path, vlm, [{"name": "t", "prompt": "{{ text }}"}], backend="dlbatch"))
    with pytest.raises(ValueError, match=r"idefics3.*model.backend: vllm"):
        RunConfig.resolve(text_only)


# ------------------------------------------------------------------ the prompt stage
def test_image_prompts_are_built_by_the_models_processor(tmp_path, vlm):
    from transformers import AutoProcessor

    from dlbatch.prompts.stage import PromptStage

    spec = load_job(_job(tmp_path, vlm))
    stage = PromptStage(spec, max_model_len=2048)
    doc = _doc("tidal_array_wakes.pdf", spec)
    rows = {r["task"]: r for r in stage.process(doc)}
    image_id = stage.tok.encode("<image>", add_special_tokens=False)[0]
    proc = AutoProcessor.from_pretrained(vlm)
    pages, figs, text = rows["pages"], rows["figs"], rows["text"]
    assert len(pages["images"]) == 2 and list(pages["prompt_ids"]).count(image_id) == 2
    assert len(figs["images"]) == 4 and list(figs["prompt_ids"]).count(image_id) == 4
    assert text["images"] is None and image_id not in text["prompt_ids"]
    # the images come first in the user turn (the template places none), as the processor's chat template writes it
    shown = stage.tok.decode(list(pages["prompt_ids"])[:8], skip_special_tokens=False)
    assert shown.startswith("<|im_start|>User:<image><image>")
    # each image's tokens as the processor counts them: a whole page (72 dpi, 612x792) and a crop
    from PIL import Image
    import io

    size = Image.open(io.BytesIO(pages["images"][0])).size
    counts = proc._get_num_multimodal_tokens(image_sizes=[(size[1], size[0])])["num_image_tokens"]
    assert pages["image_tokens"] == 2 * counts[0]
    assert pages["prefix_salt"] and pages["prefix_salt"] != figs["prefix_salt"]
    from dlbatch.records import prompt_length

    assert prompt_length(pages) == len(pages["prompt_ids"]) - 2 + pages["image_tokens"]
    assert prompt_length(pages) <= 2048 - 8 and pages["long_input_policy"] == "truncate"  # the text was cut


def test_figure_of_another_document_is_that_tasks_dead_letter(tmp_path, vlm):
    from dlbatch.prompts.stage import PromptStage

    spec = load_job(_job(tmp_path, vlm, [
        {"name": "fig3", "prompt": "{{ figure('Figure 3') }}What does it show?", "images": {"figures": True}},
        {"name": "page2", "prompt": "{{ page_image(2) }}Read it.", "images": {"pages": [2]}}]))
    stage = PromptStage(spec, max_model_len=2048)
    rows = {r["task"]: r for r in stage.process(_doc("kv_cache_transfer.pdf", spec))}  # a short paper, no figures
    assert rows["fig3"]["error_type"] == "TemplateError" and "no 'Figure 3' in this document" in rows["fig3"]["error"]
    assert rows["page2"]["error"] is None and len(rows["page2"]["images"]) == 1
    rows = {r["task"]: r for r in stage.process(_doc("urban_heat_islands.pdf", spec))}
    assert rows["fig3"]["error"] is None and len(rows["fig3"]["images"]) == 1
    assert "Figure 3: " in stage.tok.decode(list(rows["fig3"]["prompt_ids"]))  # figure(): the crop and its caption


def test_long_inputs_count_image_tokens(tmp_path, vlm):
    from dlbatch.prompts.stage import PromptStage
    from dlbatch.records import prompt_length

    task = {"name": "p", "prompt": "{{ page_images }}{{ text }}\n\nRead.", "max_tokens": 8,
            "images": {"pages": "all", "dpi": 72}}
    spec = load_job(_job(tmp_path, vlm, [task]), ["model.max_model_len=600"])
    doc = _doc("rainfed_wheat_soil_moisture.pdf", spec)  # 11 pages of 34 tokens each: 374 image tokens
    (row,) = PromptStage(spec, max_model_len=600).process(doc)
    assert len(row["images"]) == 11 and row["image_tokens"] == 374 and prompt_length(row) <= 592
    assert row["long_input_policy"] == "truncate" and 0 < row["kept_tokens"] < 600 - 374
    (row,) = PromptStage(spec, max_model_len=300).process(doc)  # the pages alone do not fit: cut by page
    assert 0 < len(row["images"]) < 11 and prompt_length(row) <= 292 and row["kept_tokens"] >= 0
    skip = load_job(_job(tmp_path, vlm, [{**task, "long_inputs": "skip"}]))
    (row,) = PromptStage(skip, max_model_len=600).process(doc)
    assert row["error_type"] == "LongInput" and "exceeds max_model_len 600" in row["error"]


def test_a_scanned_paper_reaches_the_image_tasks_only(tmp_path, vlm):
    from dlbatch.prompts.stage import PromptStage
    from tests.helpers.bad_inputs import image_only_pdf

    src = tmp_path / "scans"
    src.mkdir()
    (src / "scan.pdf").write_bytes(image_only_pdf())
    spec = load_job(_job(tmp_path, vlm, [
        {"name": "read", "prompt": "Transcribe the page.", "images": {}},
        {"name": "text", "prompt": "{{ text }}\n\nSummarize."}]), [f"input.path={src}"])
    from connectors.parse import parse_file
    from dlbatch.prompts.multimodal import parse_request

    (doc,) = parse_file({"url": str(src / "scan.pdf")}, "pdf", "text", None, None, 1000, images=parse_request(spec))
    rows = {r["task"]: r for r in PromptStage(spec, max_model_len=2048).process(doc)}
    assert rows["read"]["error"] is None and len(rows["read"]["images"]) == 1  # the scanned page, OCR-free
    assert rows["text"]["error_type"] == "EmptyDocument" and "no text layer" in rows["text"]["error"]


# ------------------------------------------------------------------ OpenAI batch lines with images
def _png(color, size=(120, 90)) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _batch_rows(tmp_path, model, colors, backend="vllm"):
    """The request rows of an OpenAI batch file, one chat line per image pair of ``colors``."""
    import base64

    from connectors.listing import read_document_file
    from dlbatch.prompts.stage import PromptStage

    def part(c):
        url = "data:image/png;base64," + base64.b64encode(_png(c)).decode()
        return {"type": "image_url", "image_url": {"url": url}}

    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": [
                  {"type": "text", "text": "Which is brighter, "}, part(a), {"type": "text", "text": " or "}, part(b),
                  {"type": "text", "text": "?"}]}]}} for i, (a, b) in enumerate(colors)]
    src = tmp_path / "batch.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    job = {"name": "vlm_batch", "pipeline": "papers", "input": {"format": "openai_batch", "path": str(src)},
           "output": {"path": str(tmp_path / "out")},
           "model": {"name": model, "backend": backend, "dtype": "float32", "max_model_len": 2048},
           "sampling": {"temperature": 0.0, "seed": 0},
           "cluster": {"colocated": {"chip": "fast", "replicas": 1, "num_cpus": 1}}}
    path = tmp_path / "batch.yaml"
    path.write_text(yaml.safe_dump(job))
    stage = PromptStage(load_job(str(path)), max_model_len=2048)
    return stage, [r for doc in read_document_file(str(src), "openai_batch") for r in stage.process(doc)]


def test_an_openai_batch_line_with_image_parts_is_an_image_prompt(tmp_path, vlm):
    """Data-URL image parts: the chat through the model's processor (one placeholder per image,
    in place), the images' bytes and tokens in the row, the images in its prefix key; our engine
    makes such a line a dead letter naming model.backend: vllm."""
    from transformers import AutoProcessor

    from dlbatch.records import prompt_length

    stage, (a, b) = _batch_rows(tmp_path, vlm, [((250, 250, 250), (10, 10, 10)), ((10, 10, 10), (250, 250, 250))])
    image_id = stage.tok.encode("<image>", add_special_tokens=False)[0]
    assert a["error"] is None and a["images"] == [_png((250, 250, 250)), _png((10, 10, 10))]
    assert list(a["prompt_ids"]).count(image_id) == 2
    text = stage.tok.decode(list(a["prompt_ids"]), skip_special_tokens=False)
    assert text.startswith("<|im_start|>User:Which is brighter, <image> or <image>?<end_of_utterance>")
    per_image = AutoProcessor.from_pretrained(vlm)._get_num_multimodal_tokens(image_sizes=[(90, 120)])
    assert a["image_tokens"] == 2 * per_image["num_image_tokens"][0]
    assert prompt_length(a) == len(a["prompt_ids"]) - 2 + a["image_tokens"]
    assert a["prompt_ids"] == b["prompt_ids"] and a["prefix_salt"] != b["prefix_salt"]  # same text, other images
    _, (c,) = _batch_rows(tmp_path, vlm, [((1, 2, 3), (4, 5, 6))], backend="dlbatch")
    assert c["error_type"] == "InvalidRequest" and "model.backend: vllm" in c["error"]


# ------------------------------------------------------------------ on vLLM
ENGINE_COUNT = """
import pickle, sys
from dlbatch.backends.vllm_backend import VllmBackend
from dlbatch.backends.worker_spec import WorkerSpec
from dlbatch.engine.config import EngineConfig
model, items = pickle.load(open(sys.argv[1], "rb"))
spec = WorkerSpec(model=model, engine=EngineConfig(dtype="float32", max_model_len=2048), backend="vllm",
                  engine_args={"enforce_eager": True})
b = VllmBackend(spec, "colocated", "cpu")
out = {}
for it in items:
    b.add("generate", it)
while b.has_unfinished():
    for key, res in b.step():
        out[key] = res if isinstance(res, dict) else repr(res)
pickle.dump(out, open(sys.argv[1], "wb"))
"""


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_the_engine_counts_image_prompts_as_we_do(tmp_path, vlm):
    """Our stage's prompts (page images, figure crops, a structured output, an OpenAI batch
    line's image parts) in vLLM's engine: its prompt length (each placeholder expanded by its
    processor) is ours; the JSON is valid; the same text with other images answers otherwise."""
    from dlbatch.prompts.stage import PromptStage
    from dlbatch.records import prompt_length, request_id, request_inputs

    spec = load_job(_job(tmp_path, vlm))
    stage = PromptStage(spec, max_model_len=2048)
    rows = stage.process(_doc("tidal_array_wakes.pdf", spec)) + stage.process(_doc("urban_heat_islands.pdf", spec))
    _, lines = _batch_rows(tmp_path, vlm, [((250, 250, 250), (10, 10, 10))])  # an OpenAI batch line's image parts
    rows += lines
    items = [{"request_id": request_id(r), "token_ids": list(r["prompt_ids"]), "max_tokens": r["max_tokens"],
              "temperature": 0.0, "seed": 0, **request_inputs(r),
              **({"constraint": {"kind": "json_schema", "spec": KIND}} if r["task"] == "figs" else {})}
             for r in rows]
    blob = tmp_path / "io.pkl"
    blob.write_bytes(pickle.dumps((vlm, items)))
    env = {**os.environ, "PYTHONPATH": REPO}
    r = subprocess.run([sys.executable, "-c", ENGINE_COUNT, str(blob)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = pickle.loads(blob.read_bytes())
    for row in rows:
        got = res[request_id(row)]
        assert isinstance(got, dict), got
        assert got["prompt_tokens"] == prompt_length(row), (row["task"], got["prompt_tokens"], prompt_length(row))
    figs = [res[request_id(x)]["output"] for x in rows if x["task"] == "figs"]
    assert all(json.loads(f)["kind"] in ("plot", "table", "photo") for f in figs)
    pages = [res[request_id(x)]["output"] for x in rows if x["task"] == "pages"]
    assert pages[0] != pages[1]  # two papers' pages (and texts): two answers


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_the_sample_papers_job_commits_every_row_once_across_a_driver_kill(tmp_path, vlm, raytmp):
    """`dlbatch run` over two sample papers (one long, with four figures) with page images,
    figure crops (a JSON output) and a text task: killed (-9) after its first commit, rerun:
    every (paper, task) committed once, as a run that was never killed wrote it."""
    from tests.helpers.jobs import canon, output_rows

    job = _job(tmp_path, vlm)
    extra = ["input.limit=2", "tasks.1.max_tokens=40", "model.engine_args.enforce_eager=true",
             "batching.max_batch_tokens=4096", "batching.max_inflight_batches=1"]
    clean = str(tmp_path / "clean")
    with open(tmp_path / "clean.log", "wb") as logf:
        rc = start_run(job, clean, extra, raytmp, logf).wait(timeout=900)
    assert rc == 0, (tmp_path / "clean.log").read_text()[-3000:]
    ours = canon(output_rows(clean))
    out = str(tmp_path / "out")
    with open(tmp_path / "run1.log", "wb") as logf:
        proc = start_run(job, out, extra, raytmp, logf)
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None and not committed_parts(out):
            time.sleep(0.1)
        finished = proc.poll() == 0
        kill_group_and_ray(proc, raytmp)
    rows, _ = check_committed(out, job, extra, raytmp)
    # killed after its first commit: some rows, or all 6 when one batch held both papers
    # (its manifest then not yet complete: the rerun finds the work done and completes it)
    assert finished or 0 < len(rows) <= 6, (tmp_path / "run1.log").read_text()[-3000:]
    with open(tmp_path / "run2.log", "wb") as logf:
        rc = start_run(job, out, extra, raytmp, logf).wait(timeout=900)
    assert rc == 0, (tmp_path / "run2.log").read_text()[-3000:]
    rows, st = check_committed(out, job, extra, raytmp)
    assert canon(rows) == ours and st["complete"] and len(rows) == 6
    by = {(r["doc_id"], r["task"]): r for r in output_rows(out)}
    assert {r["images"] for (_, t), r in by.items() if t == "pages"} == {2}
    assert max(r["images"] for (_, t), r in by.items() if t == "figs") == 4  # the long paper's four figures
    assert all(r["valid"] for (_, t), r in by.items() if t == "figs")  # structured output on image prompts
    assert all(r["prompt_tokens"] >= r["image_tokens"] > 0 for (_, t), r in by.items() if t == "pages")


def test_a_processor_without_a_size_rule_is_counted_by_processing(tmp_path, vlm):
    """`MultimodalPrompts.image_tokens`: a processor without transformers' size rule
    (`_get_num_multimodal_tokens`) has each image processed and its prompt's growth counted;
    the counts equal the rule's where both exist."""
    from transformers import AutoProcessor

    from dlbatch.engine.loader import load_tokenizer
    from dlbatch.jobspec import load_job
    from dlbatch.prompts.multimodal import MultimodalPrompts, image_ref

    spec = load_job(_job(tmp_path, vlm))
    refs = [image_ref(_png("red", (120, 90)), "a"), image_ref(_png("blue", (64, 48)), "b")]
    by_rule = MultimodalPrompts.for_job(spec, load_tokenizer(vlm)).image_tokens(refs)
    assert by_rule == [int(n) for n in AutoProcessor.from_pretrained(vlm)._get_num_multimodal_tokens(
        image_sizes=[(90, 120), (48, 64)])["num_image_tokens"]]
    mm = MultimodalPrompts.for_job(spec, load_tokenizer(vlm))
    mm.processor._get_num_multimodal_tokens = None  # a processor without the rule
    assert mm.image_tokens(refs) == by_rule
