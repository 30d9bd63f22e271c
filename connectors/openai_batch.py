"""OpenAI Batch API request files (``input.format: openai_batch``): the reader and the
translation of a request body into what the prompt stage builds.

A request file is JSON Lines, one request a line::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": ..., "messages": [...]}}

Invariants:

* one row per non-blank line, good or error, in line order; ``source`` is ``<path>#line<N>``
  (1-based) as `connectors.text_sources.read_jsonl` names it;
* ``doc_id`` is the line's ``custom_id`` whenever the line has a non-empty string one (good
  rows always do); a line without one is an error row whose id is the hash of its bytes;
* custom_ids are unique across the job's request files: listing refuses files where one
  repeats (`check_custom_ids`, `DuplicateCustomId` naming both lines), as the Batch API
  refuses such a file at upload, so no result line and error line ever share an ``id``. (A
  file changed after listing still cannot run one twice: `connectors.listing.read_document_file`
  turns a repeated id into a ``DuplicateId`` dead letter, `connectors.records.DuplicateIds`);
* a line over ``input.max_line_bytes`` is never held: it is a ``LineTooLong`` error row;
* a good row's ``columns`` (`connectors.columns.pack`) hold exactly ``custom_id``, ``url``
  and ``body`` (the body as JSON text), so the block types do not depend on the bodies;
  its ``text`` is the chat's message contents, one per line, or the completion prompt;
* the reader checks the line's envelope only (JSON object, ``custom_id``, ``method`` POST,
  ``url`` one of `URLS`, ``body`` an object); the body is checked by `translate`, which the
  prompt stage calls with the job's model name: every problem of a body raises
  `InvalidRequest` naming the body key, and becomes that line's dead letter, never the job's;
* a user message's ``image_url`` parts become its images, compressed bytes the prompt stage
  hands the model's processor: a data: URL decoded, any other URL (http(s), s3, a path)
  read with fsspec, each checked and within the line's image budget (docs/multimodal.md).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Iterator

from .records import DECODE_ERROR, MALFORMED_JSON, MISSING_FIELD, error_row, ok_row
from .text_sources import MAX_LINE_BYTES

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)
BAD_REQUEST = "InvalidRequest"
TASK = "response"  # the implicit task of an openai_batch job: one request row per line
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the API's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 1024  # chat without max_tokens: this, or what the context leaves if less

# body keys that do not change the output: accepted and ignored (stream and friends must be off)
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options", "safety_identifier",
           "prompt_cache_key"}
OFF_WHEN = {"stream": (False,), "echo": (False,), "best_of": (1,), "suffix": ("",), "tool_choice": ("none",)}
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "presence_penalty",
          "frequency_penalty", "top_k", "min_p", "repetition_penalty"}
CHAT_KEYS = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format"}
COMPLETION_KEYS = COMMON | {"prompt", "logprobs"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class InvalidRequest(ValueError):
    """A request body the job cannot run as asked; ``code`` is its dead letter's error_type
    (``ModelMismatch``, ``UnsupportedParameter`` or ``InvalidRequest``)."""

    def __init__(self, message: str, code: str = BAD_REQUEST):
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------ reading


def read_openai_batch(path: str, fs, max_line_bytes: int | None = MAX_LINE_BYTES, part=None) -> Iterator[dict]:
    """One row per non-blank line of an OpenAI batch request file (see the module docstring),
    or of a byte-range part of it (`connectors.part.Part`; its lines keep their numbers)."""
    from .columns import pack
    from .part import WHOLE
    from .text_sources import jsonl_lines, line_too_long

    for line in jsonl_lines(fs, path, max_line_bytes, part or WHOLE):
        if line.raw is None:
            yield line_too_long(line, max_line_bytes)
            continue
        number, raw, source = line.number, line.raw, line.source
        row = _line_row(raw, source, number)
        if not row["error"]:
            rec = json.loads(raw)
            row["columns"] = pack({"custom_id": rec["custom_id"], "url": rec["url"],
                                   "body": json.dumps(rec["body"], ensure_ascii=False)})
        yield row


def _line_row(raw: bytes, source: str, number: int) -> dict:
    def bad(kind: str, msg: str, doc_id: str | None = None) -> dict:
        return error_row(source=source, raw=raw, doc_id=doc_id, error_type=kind, error=f"line {number}: {msg}")

    try:
        rec = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return bad(DECODE_ERROR, f"not valid UTF-8 at byte {e.start}")
    except json.JSONDecodeError as e:
        return bad(MALFORMED_JSON, f"invalid JSON: {e.msg} (column {e.colno})")
    if not isinstance(rec, dict):
        return bad(MALFORMED_JSON, f"a request line is a JSON object, got a JSON {type(rec).__name__}")
    cid = rec.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return bad(MISSING_FIELD, f"custom_id is missing or not a non-empty string (got {_short(cid)})")
    extra = sorted(set(rec) - {"custom_id", "method", "url", "body"})
    if extra:
        return bad(BAD_REQUEST, f"unknown key(s) {', '.join(extra)} in the request line", cid)
    if rec.get("method") != "POST":
        return bad(BAD_REQUEST, f"method must be 'POST', got {_short(rec.get('method'))}", cid)
    if rec.get("url") not in URLS:
        return bad(BAD_REQUEST, f"url {_short(rec.get('url'))} is not supported (supported: {', '.join(URLS)})", cid)
    body = rec.get("body")
    if not isinstance(body, dict):
        return bad(BAD_REQUEST, f"body must be a JSON object, got {_short(body)}", cid)
    return ok_row(doc_id=cid, source=source, text=_body_text(rec["url"], body))


def _body_text(url: str, body: dict) -> str:
    """The document text of a body: the messages' contents (chat) or the prompt; '' when the
    body has neither in a usable shape (`translate` names the problem)."""
    if url == CHAT_URL:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        texts = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts: their text parts
                content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            texts.append(content if isinstance(content, str) else "")
        return "\n".join(texts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else ""


def custom_ids(path: str, fs, lines: set[int], max_line_bytes: int | None = MAX_LINE_BYTES) -> dict[int, str]:
    """{line number: custom_id} of the given lines of a request file (lines without a string
    custom_id left out): what the exporter names the dead letters of lines by. A line over
    ``max_line_bytes`` is not parsed: its custom_id is read when the line starts with it."""
    from .text_sources import jsonl_lines

    out: dict[int, str] = {}
    if not lines:
        return out
    last = max(lines)
    for line in jsonl_lines(fs, path, max_line_bytes):
        if line.number > last:
            break
        if line.number in lines:
            cid = line_custom_id(line)
            if cid is not None:
                out[line.number] = cid
    return out


_LEADING_CUSTOM_ID = re.compile(rb'^\s*\{\s*"custom_id"\s*:\s*("(?:[^"\\]|\\.)*")')


def line_custom_id(line) -> str | None:
    """A request line's custom_id (a `connectors.text_sources.Line`): parsed from the line, or,
    for a line over the cap, read from its first bytes when the line starts with it."""
    try:
        if line.raw is not None:
            cid = json.loads(line.raw).get("custom_id")
        else:
            m = _LEADING_CUSTOM_ID.match(line.head)
            cid = json.loads(m.group(1)) if m else None
    except (ValueError, AttributeError):
        return None
    return cid if isinstance(cid, str) and cid else None


class DuplicateCustomId(ValueError):
    """Request files whose custom_ids repeat: the Batch API refuses such a file at upload."""


def check_custom_ids(files, max_line_bytes: int | None = MAX_LINE_BYTES) -> None:
    """Raise `DuplicateCustomId` naming the lines when a custom_id is on two lines of the job's
    request files (``files``: ``(url, filesystem, path)`` of each; one file or two): each line
    must have its own, as the Batch API requires within a batch, so that every result and
    error line answers exactly one request."""
    from .text_sources import jsonl_lines

    first: dict[str, str] = {}
    repeats: list[str] = []
    for url, fs, path in files:
        for line in jsonl_lines(fs, path, max_line_bytes):
            cid = line_custom_id(line)
            if cid is None:
                continue
            where = f"{url} line {line.number}"
            if cid in first:
                repeats.append(f"custom_id {_short(cid)} is on {first[cid]} and {where}")
            else:
                first[cid] = where
    if repeats:
        more = f" (and {len(repeats) - 3} more repeats)" if len(repeats) > 3 else ""
        raise DuplicateCustomId("; ".join(repeats[:3]) + more + ": a batch's custom_ids must be unique (the Batch "
                                "API refuses such a file at upload); give each request line its own")


# ------------------------------------------------------------------ a body -> a request


def translate(url: str, body: Any, model: str | tuple[str, ...], adapters=(), images: dict | None = None) -> dict:
    """A request body -> ``{"chat": bool, "messages" (chat) | "prompt" (completions),
    "max_tokens": int | None (None: the body sets none), "seed": int | None, "sampling": {...},
    "adapter": str | None}``. ``body.model`` is the job's ``model`` or, as vLLM's server takes
    it, the name of one of the job's LoRA ``adapters`` (then ``adapter`` is that name).

    ``sampling`` holds the request row's own sampling (`dlbatch.prompts.sampling.row_sampling`):
    temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty,
    stop (a list), n, logprobs (top-k per token; chat: top_logprobs when logprobs is true,
    completions: the integer) and constraint ({"kind": "json_schema", "spec": schema}).
    Keys the body leaves out (or sets to null) are the job's ``sampling``. ``model``: the name
    (or names: ``model.name`` and ``model.served_model_name``) a body may give. Raises
    `InvalidRequest` naming the body key: a model other than those (``ModelMismatch``), a key
    that would change the output and is not honoured (``UnsupportedParameter``), a bad value.
    ``images``: how the line's image URLs are read and bounded (`_content_parts`)."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"body must be a JSON object, got {_short(body)}")
    chat = url == CHAT_URL
    if url not in URLS:
        raise InvalidRequest(f"url {_short(url)} is not supported (supported: {', '.join(URLS)})")
    given = {k: v for k, v in body.items() if v is not None}
    got = given.get("model")
    names = (model,) if isinstance(model, str) else tuple(model)
    if got not in names and got not in adapters:
        also = f" nor one of its adapters ({', '.join(adapters)})" if adapters else ""
        raise InvalidRequest(f"body.model {_short(got)} is not this job's model ({', '.join(map(repr, names))}){also}; "
                             "a batch file runs on the job's model: name it in model.served_model_name (dlbatch batch "
                             "--served-model-name), or set body.model", "ModelMismatch")
    allowed = CHAT_KEYS if chat else COMPLETION_KEYS
    for k in given:
        if k in allowed or k in IGNORED:
            continue
        if k in OFF_WHEN:
            if any(given[k] == v and type(given[k]) is type(v) for v in OFF_WHEN[k]):
                continue
            raise InvalidRequest(f"body.{k} {_short(given[k])} is not supported (only {OFF_WHEN[k][0]!r})",
                                 "UnsupportedParameter")
        raise InvalidRequest(f"body.{k} is not supported by this batch engine ({url}); remove it", "UnsupportedParameter")
    out: dict[str, Any] = {"chat": chat, "max_tokens": None, "seed": None, "adapter": got if got not in names else None}
    if chat:
        out["messages"] = _messages(given.get("messages"), images)
    else:
        out["prompt"] = _prompt(given.get("prompt"))
    smp: dict[str, Any] = {}
    mt = {k: _int(given, k, 1) for k in ("max_tokens", "max_completion_tokens") if k in given}
    if len(set(mt.values())) > 1:
        raise InvalidRequest(f"body.max_tokens {mt['max_tokens']} and body.max_completion_tokens "
                             f"{mt['max_completion_tokens']} differ; give one")
    if mt:
        out["max_tokens"] = next(iter(mt.values()))
    for k, lo, hi, lo_open in (("temperature", 0.0, 2.0, False), ("top_p", 0.0, 1.0, True),
                               ("presence_penalty", -2.0, 2.0, False), ("frequency_penalty", -2.0, 2.0, False),
                               ("min_p", 0.0, 1.0, False), ("repetition_penalty", 0.0, math.inf, True)):
        if k in given:
            smp[k] = _number(given, k, lo, hi, lo_open)
    if "top_k" in given:
        v = _int(given, "top_k", -1)
        smp["top_k"] = max(v, 0)  # vLLM's -1 (off) is our 0
    if "seed" in given:
        out["seed"] = _int(given, "seed", -(2 ** 63)) % (2 ** 32)
    if "stop" in given:
        stop = given["stop"]
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not 1 <= len(stop) <= 4 or any(not isinstance(s, str) or not s for s in stop):
            raise InvalidRequest(f"body.stop must be a non-empty string or a list of 1 to 4 of them, got "
                                 f"{_short(given['stop'])}")
        smp["stop"] = stop
    if "n" in given:
        smp["n"] = _int(given, "n", 1, 128)
    if chat:
        want = given.get("logprobs", False)
        if not isinstance(want, bool):
            raise InvalidRequest(f"body.logprobs must be true or false for {CHAT_URL}, got {_short(want)}")
        if "top_logprobs" in given:
            if not want:
                raise InvalidRequest("body.top_logprobs needs body.logprobs: true")
            smp["logprobs"] = _int(given, "top_logprobs", 0, 20)
        elif want:
            smp["logprobs"] = 0
        if "response_format" in given:
            c = _response_format(given["response_format"])
            if c is not None:
                smp["constraint"] = c
    elif "logprobs" in given:
        smp["logprobs"] = _int(given, "logprobs", 0, 20)
    out["sampling"] = smp
    return out


def _messages(messages: Any, images: dict | None = None) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest(f"body.messages must be a non-empty list of messages, got {_short(messages)}")
    from .images import ImageBudget

    out, budget = [], ImageBudget.from_options(images)
    for i, m in enumerate(messages):
        where = f"body.messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(f"{where} must be an object, got {_short(m)}")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"{where}.role {_short(role)} is not supported (supported: {', '.join(ROLES)})",
                                 "UnsupportedParameter" if isinstance(role, str) else BAD_REQUEST)
        extra = sorted(k for k, v in m.items() if k not in ("role", "content", "name") and v is not None)
        if extra:
            raise InvalidRequest(f"{where}.{extra[0]} is not supported", "UnsupportedParameter")
        content = m.get("content")
        if isinstance(content, list):
            content = _content_parts(content, where, ROLES[role], images, budget)
        if not isinstance(content, (str, list)):
            raise InvalidRequest(f"{where}.content must be a string or a list of content parts, got {_short(content)}")
        out.append({"role": ROLES[role], "content": content})
    return out


def _content_parts(content: list, where: str, role: str, images: dict | None = None,
                   budget=None) -> str | list[dict]:
    """A message's content parts -> its text (text parts only), or, with images, the parts:
    ``{"type": "text", "text"}`` and ``{"type": "image", "data": bytes}`` (an ``image_url``
    part's image as compressed bytes: a data URL decoded, any other URL read with fsspec,
    `connectors.image_columns.read_image_url` with the keywords ``images`` gives; each
    checked and charged to the line's ``budget``, `connectors.images.ImageBudget`:
    docs/multimodal.md). An image that cannot be read or is not one: ``BadImage``."""

    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            if role != "user":
                raise InvalidRequest(f"{at}: image parts go in user messages, not {role}")
            img = part.get("image_url")
            url = img.get("url") if isinstance(img, dict) else None
            if not isinstance(url, str):
                raise InvalidRequest(f"{at}.image_url.url must be a string, got {_short(url)}")
            if img.get("detail", "auto") != "auto":
                raise InvalidRequest(f"{at}.image_url.detail {_short(img['detail'])} is not supported (only "
                                     "'auto': the model's processor sizes the image)", "UnsupportedParameter")
            parts.append({"type": "image", "data": _image(url, f"{at}.image_url.url", images, budget)})
        else:
            raise InvalidRequest(f"{at}.type {_short(kind)} is not supported (text and image_url parts)",
                                 "UnsupportedParameter")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _image(url: str, at: str, images: dict | None, budget) -> bytes:
    """An image part's compressed bytes (`_content_parts`); `InvalidRequest` naming ``at``."""
    from .image_columns import BAD_IMAGE, READ_KEYS, checked_image, read_image_url
    from .images import IMAGE_BUDGET, ImageBudgetExceeded, data_url_image

    if url.startswith("data:"):
        try:
            data = data_url_image(url)
        except ValueError as e:
            raise InvalidRequest(f"{at}: {e}") from None
    else:
        read = {k: v for k, v in (images or {}).items() if k in READ_KEYS}
        try:
            data = read_image_url(url, **read)
        except ValueError as e:
            raise InvalidRequest(f"{at} {_short(url)}: {e}", BAD_IMAGE) from None
    try:
        fmt, width, height = checked_image(data)
        if budget is not None:
            budget.charge(f"image {_short(url, 40)} ({width}x{height})", width * height)
    except ImageBudgetExceeded as e:
        raise InvalidRequest(f"{at}: {e}", IMAGE_BUDGET) from None
    except ValueError as e:
        raise InvalidRequest(f"{at} {_short(url)}: {e}", BAD_IMAGE) from None
    return data


def _prompt(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise InvalidRequest("body.prompt must be one string here (a list of prompts or token ids is not supported; "
                             "one prompt per line)", "UnsupportedParameter")
    if not isinstance(prompt, str) or not prompt:
        raise InvalidRequest(f"body.prompt must be a non-empty string, got {_short(prompt)}")
    return prompt


def _response_format(rf: Any) -> dict | None:
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"kind": "json_schema", "spec": {"type": "object"}}
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest("body.response_format.json_schema.schema must be a JSON Schema object, got "
                                 f"{_short(schema)}")
        import jsonschema

        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as e:
            raise InvalidRequest(f"body.response_format.json_schema.schema is not a valid JSON Schema: {e.message}")
        return {"kind": "json_schema", "spec": schema}
    raise InvalidRequest(f"body.response_format.type {_short(kind)} is not supported (text, json_object, json_schema)",
                         "UnsupportedParameter")


def _int(body: dict, key: str, lo: int, hi: int | None = None) -> int:
    v = body[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        where = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidRequest(f"body.{key} must be an integer {where}, got {_short(v)}")
    return v


def _number(body: dict, key: str, lo: float, hi: float, lo_open: bool) -> float:
    v = body[key]
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v <= hi and (
        v > lo if lo_open else v >= lo)
    if not ok:
        raise InvalidRequest(f"body.{key} must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {_short(v)}")
    return float(v)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def line_hash(custom_id: str | None, source: str) -> str:
    """A stable 24-hex-digit hash of a line (its custom_id, else its source): the ids of its
    output lines, identical on every run."""
    import hashlib

    key = f"openai_batch:{custom_id if custom_id is not None else '#' + source}"
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:24]
