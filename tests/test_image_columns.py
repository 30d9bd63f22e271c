"""Images a row holds or names (docs/multimodal.md): a JSONL / Parquet input's image columns
(bytes, data URLs, paths, loopback http URLs, lists), read and checked in the parse stage,
their dead letters and budgets, the job schema's refusals, the document's identity over the
images' bytes, prompts placing them (`{{ images }}`, `{{ image(n) }}`), and OpenAI batch
lines whose image_url is a URL. On vLLM (skipped without it): the engine counts the rows'
image prompts as we do, and (slow, Ray) `dlbatch run` over a JSONL with an image column.
Images are made with PIL; URLs are served by a loopback http.server: nothing leaves the machine.
"""
from __future__ import annotations

import base64
import functools
import http.server
import io
import json
import os
import pickle
import re
import subprocess
import sys
import threading
import time

import pytest
import yaml

from dlbatch.backends import REGISTRY
from dlbatch.jobspec import JobSpecError, load_job
from tests.helpers.jobs import REPO

WHY = REGISTRY["vllm"].unavailable_reason()


def png(color, size=(120, 90), fmt="PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, kind="png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(folder, base URL): a loopback HTTP server over a folder of images, for the module."""
    root = tmp_path_factory.mktemp("served")
    (root / "red.png").write_bytes(png((250, 10, 10)))
    (root / "blue.jpg").write_bytes(png((10, 10, 250), fmt="JPEG"))
    (root / "notes.txt").write_text("not an image")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def send_head(self):
            if self.path.startswith("/slow"):  # a server that does not answer in time
                time.sleep(3)
            return super().send_head()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from tests.helpers.tiny_vlm import make_tiny_vlm

    path = str(tmp_path_factory.mktemp("vlm") / "model")
    make_tiny_vlm(path)
    return path


# ------------------------------------------------------------------ the column reader
def test_each_kind_of_value_is_read_and_checked(tmp_path, served, monkeypatch):
    from connectors.image_columns import column_images

    root, url = served
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "green.webp").write_bytes(png((10, 250, 10), (64, 32), "WEBP"))
    raw = png((1, 2, 3), (30, 20))
    row = {"a": raw, "b": data_url(png((4, 5, 6), (8, 8))), "c": str(root / "red.png"), "d": "imgs/green.webp",
           "e": f"{url}/blue.jpg", "f": [raw, f"{url}/red.png"], "g": None, "h": {"bytes": None, "path": "imgs/green.webp"}}
    got = column_images(row, list(row), base=str(tmp_path))
    assert [(i["label"], i["format"], i["width"], i["height"]) for i in got] == [
        ("a 1", "png", 30, 20), ("b 1", "png", 8, 8), ("c 1", "png", 120, 90), ("d 1", "webp", 64, 32),
        ("e 1", "jpeg", 120, 90), ("f 1", "png", 30, 20), ("f 2", "png", 120, 90), ("h 1", "webp", 64, 32)]
    assert got[0]["data"] == raw and got[6]["data"] == (root / "red.png").read_bytes()
    assert all(i["kind"] == "column" for i in got) and got[5]["column"] == "f"
    monkeypatch.chdir(tmp_path)  # no base: relative paths from the current directory
    assert column_images({"d": "imgs/green.webp"}, ["d"])[0]["width"] == 64


@pytest.mark.parametrize("value, reason", [
    (b"GIF89a....", r"not a PNG, JPEG or WebP image \(its 10 bytes start b'GIF89a..'\)"),
    (b"\x89PNG\r\n\x1a\nbroken", r"PIL cannot read it"),
    ("missing.png", r"no such file or URL \(.*missing.png\)"),
    ("{url}/nowhere.png", r"cannot read it \(ClientResponseError: 404"),
    ("{url}/notes.txt", r"not a PNG, JPEG or WebP image"),
    ("data:image/png;base64,%%%", r"its base64 payload does not decode"),
    (42, r"a int is not an image"),
    ("", r"an empty string is not an image"),
])
def test_a_bad_value_names_the_column_the_value_and_why(tmp_path, served, value, reason):
    from connectors.image_columns import ImageError, column_images

    value = value.format(url=served[1]) if isinstance(value, str) else value
    with pytest.raises(ImageError, match=r"^image column 'fig' value .*: " + reason) as e:
        column_images({"fig": [png((0, 0, 0)), value]}, ["fig"], base=str(tmp_path))
    assert e.value.error_type == "BadImage"


def test_the_budget_bounds_images_pixels_bytes_and_time(tmp_path, served):
    from connectors.image_columns import ImageError, column_images

    four = [png((i, i, i), (100, 100)) for i in range(4)]
    with pytest.raises(ImageError, match=r"image 'fig 4' .* would be image 4 of the document, over "
                                         r"input.max_images=3") as e:
        column_images({"fig": four}, ["fig"], max_images=3)
    assert e.value.error_type == "ImageBudgetExceeded"
    with pytest.raises(ImageError, match=r"30,000 pixels, over input.max_image_pixels=25,000"):
        column_images({"fig": four}, ["fig"], max_pixels=25_000)
    (tmp_path / "big.png").write_bytes(four[0])
    with pytest.raises(ImageError, match=r"over input.max_file_bytes=100 bytes; not read"):
        column_images({"fig": str(tmp_path / "big.png")}, ["fig"], max_bytes=100)
    with pytest.raises(ImageError, match=r"'http://.*/slow.png': no answer in 0.5 s \(input.parse_timeout_s\)"):
        column_images({"fig": f"{served[1]}/slow.png"}, ["fig"], timeout_s=0.5)
    with pytest.raises(ImageError, match=r"image column 'photo': the row has no such column \(its columns: fig\)"):
        column_images({"fig": four}, ["photo"])


# ------------------------------------------------------------------ the parse stage
def _request(columns, **kw):
    return {"renders": [], "columns": columns, "base": None, "max_images": 64, "max_pixels": 64_000_000, **kw}


def test_jsonl_and_parquet_rows_carry_their_images_or_a_dead_letter(tmp_path, served):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from connectors.images import unpack_images
    from connectors.parse import parse_file

    root, url = served
    lines = [{"id": "a", "text": "one", "fig": f"{url}/red.png"},
             {"id": "b", "text": "two", "fig": [data_url(png((9, 9, 9))), str(root / "blue.jpg")]},
             {"id": "c", "text": "three", "fig": f"{url}/gone.png"}, {"id": "d", "text": "four", "fig": None}]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    docs = parse_file({"url": str(src)}, "jsonl", "text", "id", None, None, images=_request(["fig"]))
    by = {d["doc_id"]: d for d in docs}
    assert [i["label"] for i in unpack_images(by["a"]["images"])] == ["fig 1"]
    assert [i["format"] for i in unpack_images(by["b"]["images"])] == ["png", "jpeg"]
    assert by["c"]["error_type"] == "BadImage" and by["c"]["images"] is None
    assert by["c"]["error"].startswith(f"BadImage: image column 'fig' value '{url}/gone.png': cannot read it")
    assert by["d"]["error"] is None and by["d"]["images"] is None
    # without input.id_field: a bad row's id is its line's (two rows may share a text, not a line)
    src.write_text("".join(json.dumps({**x, "text": "same"}) + "\n" for x in lines[2:3] * 2))
    twins = parse_file({"url": str(src)}, "jsonl", "text", None, None, None, images=_request(["fig"]))
    assert [d["error_type"] for d in twins] == ["BadImage"] * 2 and twins[0]["doc_id"] != twins[1]["doc_id"]
    table = pa.table({"id": ["p", "q"], "text": ["x", "y"], "fig": [png((1, 1, 1)), b"not an image"]})
    pq.write_table(table, tmp_path / "rows.parquet")
    docs = parse_file({"url": str(tmp_path / "rows.parquet")}, "parquet", "text", "id", None, None,
                      images=_request(["fig"]))
    assert unpack_images(docs[0]["images"])[0]["data"] == png((1, 1, 1))
    assert docs[1]["error"].startswith("BadImage: image column 'fig' value \"<12 bytes starting b'not an i'>\"")


def test_a_ray_datasets_rows_carry_their_images_as_a_files_do():
    import pyarrow as pa

    from connectors.images import unpack_images
    from connectors.ray_dataset import DatasetDocuments

    table = pa.table({"id": ["p", "q"], "text": ["x", "y"], "fig": [[png((1, 1, 1)), png((2, 2, 2))], [b"GIF89a"]]})
    docs = DatasetDocuments("text", "id", images=_request(["fig"]))(table).to_pylist()
    assert [i["label"] for i in unpack_images(docs[0]["images"])] == ["fig 1", "fig 2"]
    assert docs[1]["error_type"] == "BadImage" and docs[1]["doc_id"] == "q" and docs[1]["source"] == "dataset#q"


# ------------------------------------------------------------------ the job file
def _job(tmp_path, model, tasks, fmt="jsonl", path=None, **top) -> str:
    job = {"name": "cols", "pipeline": "papers", "input": {"format": fmt, "path": path or str(tmp_path / "rows.jsonl")},
           "output": {"path": str(tmp_path / "out")},
           "model": {"name": model, "backend": "vllm", "dtype": "float32", "max_model_len": 2048},
           "tasks": tasks, "sampling": {"temperature": 0.0, "seed": 0},
           "cluster": {"colocated": {"chip": "fast", "replicas": 1, "num_cpus": 1}}, **top}
    path = tmp_path / f"job-{len(list(tmp_path.glob('job-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def test_the_job_refuses_images_its_input_cannot_give(tmp_path, vlm):
    col = {"name": "look", "prompt": "{{ images }}What is this?", "images": {"column": "fig"}}
    spec = load_job(_job(tmp_path, vlm, [col]))
    assert spec.tasks[0].images.column == "fig"
    from dlbatch.jobspec import parse_job

    assert parse_job(spec.to_dict()) == spec  # a dumped spec (every images key spelled) loads again
    papers = os.path.join(REPO, "samples", "papers")
    with pytest.raises(JobSpecError, match=r"tasks.0.images.column: task 'look' takes its images from the column "
                                           r"'fig' of a row, and pdf inputs have no such rows"):
        load_job(_job(tmp_path, vlm, [col], fmt="pdf", path=papers))
    with pytest.raises(JobSpecError, match=r"tasks.0.images: task 'p': page images and figure crops come from PDF "
                                           r"inputs, not jsonl; a row's images come from a column"):
        load_job(_job(tmp_path, vlm, [{"name": "p", "prompt": "{{ text }}", "images": {"pages": [1]}}]))
    with pytest.raises(JobSpecError, match=r"task 'both': images.column takes the row's images; pages, dpi are how"):
        load_job(_job(tmp_path, vlm, [{"name": "both", "prompt": "{{ images }}",
                                       "images": {"column": "fig", "pages": [1], "dpi": 72}}]))
    with pytest.raises(JobSpecError, match=r"task 'f' uses figure, a PDF's images, but takes its images from "
                                           r"column 'fig': place them with \{\{ images \}\}"):
        load_job(_job(tmp_path, vlm, [{"name": "f", "prompt": "{{ figure('Figure 1') }}",
                                       "images": {"column": "fig"}}]))
    with pytest.raises(JobSpecError, match=r"task 'n' uses images but asks for no images"):
        load_job(_job(tmp_path, vlm, [{"name": "n", "prompt": "{{ images }} and {{ text }}"}]))


# ------------------------------------------------------------------ identity
def test_an_edited_image_is_a_new_version_of_its_row(tmp_path, vlm, monkeypatch):
    from connectors.parse import parse_file
    from dlbatch.driver.edits import current_versions
    from dlbatch.prompts.doc_identity import DocIdentity
    from dlbatch.prompts.multimodal import parse_request

    (tmp_path / "fig.png").write_bytes(png((1, 1, 1)))
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"text": "same", "fig": "fig.png"}) + "\n")
    spec = load_job(_job(tmp_path, vlm, [{"name": "look", "prompt": "{{ images }}{{ text }}",
                                          "images": {"column": "fig"}}]))
    ident = DocIdentity.for_job(spec)
    request = {**parse_request(spec), "base": str(tmp_path)}

    def doc():
        (d,) = parse_file({"url": str(src)}, "jsonl", "text", None, None, None, images=request)
        return ident.apply(d)

    before = doc()
    assert before["doc_id"] == before["doc_version"] == doc()["doc_id"]  # stable while nothing changes
    (tmp_path / "fig.png").write_bytes(png((2, 2, 2)))  # the same path, other bytes
    after = doc()
    assert after["doc_version"] != before["doc_version"] and after["doc_id"] != before["doc_id"]
    monkeypatch.chdir(tmp_path)  # the driver's edit check reads the row as the stream does, its images too
    assert current_versions(spec, ident, str(src)) == ({after["doc_id"]: after["doc_version"]}, set())
    text_only = DocIdentity.for_job(load_job(_job(tmp_path, vlm, [{"name": "t", "prompt": "{{ text }}"}])))
    assert text_only.apply(after)["doc_version"] == text_only.apply(before)["doc_version"]


# ------------------------------------------------------------------ OpenAI batch lines
def _line(url, n=1):
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is it?"}] + [{"type": "image_url", "image_url": {"url": url}}] * n}]}


def test_a_batch_lines_image_url_is_read_or_is_its_dead_letter(tmp_path, served):
    from connectors.openai_batch import CHAT_URL, InvalidRequest, translate

    root, url = served
    req = translate(CHAT_URL, _line(f"{url}/red.png"), "m")
    assert req["messages"][0]["content"][1] == {"type": "image", "data": (root / "red.png").read_bytes()}
    (tmp_path / "here.png").write_bytes(png((3, 3, 3)))
    req = translate(CHAT_URL, _line("here.png"), "m", images={"base": str(tmp_path)})
    assert req["messages"][0]["content"][1]["data"] == png((3, 3, 3))
    for bad, code, why in ((f"{url}/nowhere.png", "BadImage", "cannot read it .*404"),
                           (f"{url}/notes.txt", "BadImage", "not a PNG, JPEG or WebP image"),
                           ("http://127.0.0.1:9/x.png", "BadImage", "cannot read it .*Connect call failed")):
        with pytest.raises(InvalidRequest, match=r"body.messages\[0\].content\[1\].image_url.url .*" + why) as e:
            translate(CHAT_URL, _line(bad), "m", images={"max_images": 2})
        assert e.value.code == code
    with pytest.raises(InvalidRequest, match=r"would be image 3 of the document, over input.max_images=2") as e:
        translate(CHAT_URL, _line(f"{url}/red.png", 3), "m", images={"max_images": 2})
    assert e.value.code == "ImageBudgetExceeded"


# ------------------------------------------------------------------ prompts
def _rows_file(tmp_path, served) -> str:
    """Three rows: two images (a data URL and a loopback URL), one image (a path), no image."""
    root, url = served
    rows = [{"id": "two", "text": "A red square and a dark one.", "fig": [data_url(png((20, 20, 20), (64, 48))),
                                                                            f"{url}/red.png"]},
            {"id": "one", "text": "A blue square.", "fig": str(root / "blue.jpg")},
            {"id": "none", "text": "No picture here.", "fig": None}]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(src)


COLUMN_TASKS = [
    {"name": "all", "prompt": "{{ images }}Describe these.", "max_tokens": 6, "images": {"column": "fig"}},
    {"name": "second", "prompt": "{{ text }} Look: {{ image(2) }} What is it?", "max_tokens": 6,
     "images": {"column": "fig"}},
    {"name": "text", "prompt": "{{ text }}\n\nSummarize.", "max_tokens": 6}]


def _stage_rows(tmp_path, vlm, served):
    from connectors.parse import parse_file
    from dlbatch.prompts.multimodal import parse_request
    from dlbatch.prompts.stage import PromptStage

    spec = load_job(_job(tmp_path, vlm, COLUMN_TASKS, path=_rows_file(tmp_path, served)), ["input.id_field=id"])
    stage = PromptStage(spec, max_model_len=2048)
    docs = parse_file({"url": spec.input.path}, "jsonl", "text", "id", None, None, images=parse_request(spec))
    return stage, {(r["doc_id"], r["task"]): r for d in docs for r in stage.process(d)}


def test_row_images_are_placed_and_counted_by_the_models_processor(tmp_path, vlm, served):
    from transformers import AutoProcessor

    from dlbatch.records import prompt_length

    stage, rows = _stage_rows(tmp_path, vlm, served)
    image_id = stage.tok.encode("<image>", add_special_tokens=False)[0]
    per = AutoProcessor.from_pretrained(vlm)._get_num_multimodal_tokens(image_sizes=[(48, 64), (90, 120)])
    every, second = rows[("two", "all")], rows[("two", "second")]
    assert every["images"] == [png((20, 20, 20), (64, 48)), (served[0] / "red.png").read_bytes()]
    assert list(every["prompt_ids"]).count(image_id) == 2 and every["image_tokens"] == sum(per["num_image_tokens"])
    assert prompt_length(every) == len(every["prompt_ids"]) - 2 + every["image_tokens"]
    shown = stage.tok.decode(list(second["prompt_ids"]), skip_special_tokens=False)
    assert "A red square and a dark one. Look: <image> What is it?" in shown
    assert second["images"] == [every["images"][1]] and second["image_tokens"] == per["num_image_tokens"][1]
    assert every["prefix_salt"] != second["prefix_salt"]
    # a row with one image: image(2) is that task's dead letter, its other tasks run
    assert rows[("one", "second")]["error"] == ("task 'second': prompt template failed to render: ValueError: image(2): "
                                              "this document's column 'fig' holds 1 images (image(1) is the first)")
    assert rows[("one", "all")]["error"] is None and len(rows[("one", "all")]["images"]) == 1
    assert rows[("none", "all")]["images"] is None and rows[("none", "text")]["error"] is None
    assert rows[("two", "text")]["images"] is None and image_id not in rows[("two", "text")]["prompt_ids"]


def test_a_template_placing_no_image_gets_the_rows_images_first(tmp_path, vlm, served):
    from connectors.parse import parse_file
    from dlbatch.prompts.multimodal import parse_request
    from dlbatch.prompts.stage import PromptStage

    spec = load_job(_job(tmp_path, vlm, [{"name": "q", "prompt": "{{ text }} Which colour?", "max_tokens": 4,
                                          "images": {"column": "fig"}}], path=_rows_file(tmp_path, served)))
    stage = PromptStage(spec, max_model_len=2048)
    (doc, *_) = parse_file({"url": spec.input.path}, "jsonl", "text", "id", None, None, images=parse_request(spec))
    (row,) = stage.process(doc)
    assert stage.tok.decode(list(row["prompt_ids"]), skip_special_tokens=False).startswith(
        "<|im_start|>User:<image><image>A red square")


# ------------------------------------------------------------------ on vLLM
def _batch_line_rows(tmp_path, vlm, url):
    from connectors.listing import read_document_file
    from dlbatch.prompts.stage import PromptStage

    line = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {**_line(url), "model": vlm}}
    src = tmp_path / "batch.jsonl"
    src.write_text(json.dumps(line) + "\n")
    job = {"name": "b", "pipeline": "papers", "input": {"format": "openai_batch", "path": str(src)},
           "output": {"path": str(tmp_path / "bout")},
           "model": {"name": vlm, "backend": "vllm", "dtype": "float32", "max_model_len": 2048}}
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(job))
    stage = PromptStage(load_job(str(tmp_path / "b.yaml")), max_model_len=2048)
    return [r for doc in read_document_file(str(src), "openai_batch") for r in stage.process(doc)]


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_the_engine_counts_row_images_and_answers_a_url_batch_line(tmp_path, vlm, served):
    """The rows' image prompts and an OpenAI batch line whose image is a loopback http URL, in
    vLLM's engine: answered, each prompt's length (placeholders expanded) ours."""
    from dlbatch.records import prompt_length, request_id, request_inputs
    from tests.test_multimodal import ENGINE_COUNT

    _, by = _stage_rows(tmp_path, vlm, served)
    rows = [r for r in by.values() if r["error"] is None]
    line = _batch_line_rows(tmp_path, vlm, f"{served[1]}/red.png")
    assert line[0]["error"] is None and len(line[0]["images"]) == 1
    rows += line
    items = [{"request_id": request_id(r), "token_ids": list(r["prompt_ids"]), "max_tokens": r["max_tokens"],
              "temperature": 0.0, "seed": 0, **request_inputs(r)} for r in rows]
    blob = tmp_path / "io.pkl"
    blob.write_bytes(pickle.dumps((vlm, items)))
    r = subprocess.run([sys.executable, "-c", ENGINE_COUNT, str(blob)], env={**os.environ, "PYTHONPATH": REPO},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = pickle.loads(blob.read_bytes())
    for row in rows:
        got = res[request_id(row)]
        assert isinstance(got, dict), got
        assert got["prompt_tokens"] == prompt_length(row), (row["doc_id"], row["task"])
        assert got["output_tokens"] > 0


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_a_jsonl_job_with_an_image_column_runs_on_vllm(tmp_path, vlm, served, raytmp):
    """`dlbatch run` over a JSONL whose rows name their images (a data URL, a loopback URL, a
    path; one URL that is not there): every task of the good rows committed, each row's
    prompt_tokens (the engine's count) the prompt stage's, the bad row's dead letter naming
    the column and the URL."""
    from dlbatch.output.parquet_store import ParquetStore
    from dlbatch.records import prompt_length
    from tests.helpers.jobs import output_rows, start_run

    src = _rows_file(tmp_path, served)
    with open(src, "a") as f:
        f.write(json.dumps({"id": "bad", "text": "Gone.", "fig": f"{served[1]}/gone.png"}) + "\n")
    tasks = [COLUMN_TASKS[0], {**COLUMN_TASKS[1], "prompt": "{{ text }} Look: {{ image(1) }} What is it?"},
             COLUMN_TASKS[2]]
    job = _job(tmp_path, vlm, tasks, path=src)
    extra = ["input.id_field=id", "model.engine_args.enforce_eager=true"]
    out = str(tmp_path / "run")
    with open(tmp_path / "run.log", "wb") as logf:
        rc = start_run(job, out, extra, raytmp, logf).wait(timeout=900)
    assert rc == 0, (tmp_path / "run.log").read_text()[-3000:]
    (tmp_path / "stage").mkdir()
    _, ours = _stage_rows(tmp_path / "stage", vlm, served)  # the same rows' prompts, built here
    rows = {(r["doc_id"], r["task"]): r for r in output_rows(out)}
    assert set(rows) == {(d, t) for d in ("two", "one") for t in ("all", "second", "text")} | {
        ("none", "all"), ("none", "text")}
    assert [rows[("two", t)]["images"] for t in ("all", "second", "text")] == [2, 1, 0]
    assert all(r["output_tokens"] > 0 for r in rows.values())
    for key in (("two", "all"), ("one", "all"), ("one", "text")):
        assert rows[key]["prompt_tokens"] == prompt_length(ours[key])  # counted as the engine counts it
    errors = {(e["doc_id"], e.get("task")): e for e in ParquetStore(out).errors().to_pylist()}
    bad = errors[next(k for k in errors if k[0] == "bad")]
    assert bad["error_type"] == "BadImage" and f"image column 'fig' value '{served[1]}/gone.png'" in bad["error"]
    assert {k[0] for k in errors} == {"bad", "none"}  # the row without images: image(1) has none to place


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_validate_shows_each_rows_images_and_their_tokens(tmp_path, vlm, served, capsys, monkeypatch):
    """`dlbatch validate` on a JSONL job with an image column: each image task's image count and
    tokens per sampled row (a relative path read from the directory validate runs in), and a
    row whose image is not there named as a dead letter."""
    from dlbatch.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "here.png").write_bytes(png((7, 7, 7), (120, 90)))
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "a", "text": "Two.", "fig": ["here.png", f"{served[1]}/red.png"]},
        {"id": "b", "text": "Gone.", "fig": "gone.png"}]))
    job = _job(tmp_path, vlm, COLUMN_TASKS, path=str(src), input={"format": "jsonl", "path": str(src),
                                                                     "id_field": "id"})
    rc = main(["validate", job, "--docs", "2"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "task all: " in out and ", 2 images (" in out
    assert "images per task in the 1 sampled documents (count, tokens):" in out
    line = next(x for x in out.splitlines() if x.strip().startswith(f"{src}#line1"))
    m = re.search(r": all 2 \((\d+)\), second 1 \((\d+)\)$", line)  # the image tasks; both images 120x90
    assert m and int(m.group(1)) == 2 * int(m.group(2)) > 0, line
    assert f"{src}#line2: would be a dead letter: BadImage: image column 'fig' value 'gone.png'" in out
