"""The prompt stage: a document -> its K task requests (rendered, chat-templated,
tokenized), with the long-input policy applied.

`PromptStage` is a callable class over Arrow batches, so Ray Data runs it in its actors
(``map_batches``) and unit tests call ``process(doc)`` directly, without Ray. A document's
rows stay together and start with the document, so its tasks share it as prefix.

No document fails the batch: whatever raises while a document's prompts are built (a task's
template, the tokenizer, the long-input policy, a bug) becomes an error row for that
document or task, which the driver dead-letters, and the other documents of the batch go on.
Strings Arrow cannot encode (lone surrogates) are repaired before anything else, as the
parse stage does (`connectors.repair`: ids escaped, text replaced), so the ids the skip set
holds and the ids of the rows are the same on every run.
"""
from __future__ import annotations

import hashlib
import json
import logging

from connectors.images import unpack_images
from connectors.parse import STRUCTURE_KEYS
from connectors.repair import repair_row, repair_text
from dlbatch.prompts.hooks import Skip, apply_preprocess
from dlbatch.prompts.multimodal import LongInput, fit
from dlbatch.prompts.sampling import expand_samples, task_sampling

log = logging.getLogger("dlbatch.prompts.stage")

MIDDLE_MARK = "\n\n[...]\n\n"   # where ``long_inputs: middle`` dropped the middle of a document


def derive_seed(job_seed: int, doc_id: str, task: str) -> int:
    """Per-(document, task) seed: resumes and retries sample the same tokens."""
    h = hashlib.sha256(f"{job_seed}:{doc_id}:{task}".encode()).digest()
    return int.from_bytes(h[:4], "little")


class PromptStage:
    """map_batches: documents -> K request rows each (all of a document's rows in the same
    output batch, document first so the tasks share it as prefix)."""

    def __init__(self, spec, skip_doc_ids=None, map_reduce: bool = False, *, max_model_len: int,
                 preprocess=None, image_read: dict | None = None):
        """``spec``: the validated job (`dlbatch.jobspec.JobSpec`; pickled to Ray Data's actors);
        ``max_model_len``: the run's context length, resolved once with the workers' own
        (`dlbatch.driver.config.RunConfig`): a request's prompt + max_tokens fit in it;
        ``preprocess``: the pipeline's hook on each document's template context
        (dlbatch/prompts/hooks.py), or None; ``image_read``: how OpenAI batch lines' image URLs
        are read (`BatchLinePrompts`), from the driver: its directory and sealed storage options."""
        from dlbatch.engine.loader import load_tokenizer
        from dlbatch.prompts.encoder import PromptEncoder
        from dlbatch.prompts.skip import SkipSet
        from dlbatch.prompts.templates import compile_messages, compile_task_templates

        self.spec = spec
        m = self.spec.model
        self.tok, self.max_model_len = load_tokenizer(m.ref), int(max_model_len)
        self.encoder = PromptEncoder.for_job(spec, self.tok)  # every prompt's way to token ids
        # one renderer per task: a task whose prompt cannot be rendered for a document fails alone
        self.renders = [compile_task_templates([t]) if t.prompt is not None else None for t in self.spec.tasks]
        self.chats = [compile_messages(t.name, t.messages) if t.messages is not None else None for t in self.spec.tasks]
        self.keep = bool(self.spec.output.keep_columns)  # request rows carry the input's columns
        from dlbatch.prompts.templates import reads_row

        self.preprocess = preprocess
        # else a row's columns stay packed (a hook may read them: then they are unpacked)
        self.reads_row = preprocess is not None or any(reads_row(t.source) for t in self.spec.tasks)
        self.map_reduce = map_reduce   # True: `chunk` documents become ChunkPlan map rows
        from dlbatch.prompts.multimodal import MultimodalPrompts, has_images

        # image prompts (tasks with images:) through the model's processor, loaded at the first image
        self.mm = MultimodalPrompts.for_job(spec, self.tok) if has_images(spec) else None
        self.batch = BatchLinePrompts(spec, self.tok, self.encoder, self.max_model_len, image_read)  # openai_batch
        # ids not to redo: a SkipSet (8 bytes per id) from the driver, or any iterable of ids
        self.skip = skip_doc_ids if isinstance(skip_doc_ids, SkipSet) else SkipSet(skip_doc_ids or ())
        from dlbatch.prompts.doc_identity import DocIdentity

        self.identity = DocIdentity.for_job(spec, preprocess)  # a table row's id and version

    def _render(self, k: int, ctx: dict):
        """Task k's prompt text, or its chat (a list of messages) for a ``messages`` task."""
        if self.chats[k] is not None:
            return self.chats[k](ctx)
        return self.renders[k](ctx)[0]

    def __call__(self, batch):
        import pyarrow as pa

        rows = batch.to_pylist() if hasattr(batch, "to_pylist") else batch
        out: list[dict] = []
        for doc in rows:
            doc = self.identity.apply(repair_row(doc))
            if doc["doc_id"] in self.skip:
                continue
            out.extend(self._guarded(doc))
        try:
            return pa.Table.from_pylist(out, schema=request_schema())
        except UnicodeError:  # a string made here (a task name, a message) Arrow cannot encode
            return pa.Table.from_pylist([repair_row(r) for r in out], schema=request_schema())

    def process(self, doc: dict) -> list[dict]:
        """A document's request rows (see `_process`); never raises for a document."""
        return self._guarded(self.identity.apply(repair_row(doc)))

    def _guarded(self, doc: dict) -> list[dict]:
        try:
            return self._process(doc)
        except Exception as e:  # noqa: BLE001 - the document's dead letter, not the batch's failure
            log.warning("prompt building failed for %s: %s: %s", doc.get("doc_id"), type(e).__name__, e)
            base = {"doc_id": str(doc.get("doc_id")), "source": str(doc.get("source")), "title": doc.get("title"),
                    "pages": doc.get("pages"), "doc_version": doc.get("doc_version"),
                    "text": doc.get("text") if self.spec.output.include_text else None}
            return [self._error(base, "prompt", type(e).__name__, f"prompt building failed: {e}"[:500])]

    def _process(self, doc: dict) -> list[dict]:
        """A document's request rows, one per task. A task whose prompt cannot be rendered
        becomes an error row naming the task (the other tasks go on); if every task fails,
        or the document itself is bad, one error row for the document (task None). Tasks
        whose prompt does not fit (prompt + max_tokens > max_model_len) follow their policy
        (the task's ``long_inputs``, else the job's): ``skip`` dead-letters the document;
        ``truncate`` / ``middle`` cut the document (head / head and tail) the same way for
        every task of that policy, so they keep sharing it as prefix; ``chunk`` plans a
        map-reduce (dlbatch/prompts/longdoc.py)."""
        spec = self.spec
        base = {"doc_id": doc["doc_id"], "source": doc["source"], "title": doc.get("title"),
                "pages": doc.get("pages"), "doc_version": doc.get("doc_version"),
                "text": doc.get("text") if spec.output.include_text else None,
                "columns": doc.get("columns") if self.keep else None}
        if doc.get("error"):
            return [self._error(base, "parse", doc.get("error_type") or "ParseError", doc["error"])]
        if spec.input.format == "openai_batch":
            return self.batch.rows(base, doc)
        images = unpack_images(doc.get("images")) if self.mm is not None else []
        if not (doc.get("text") or "").strip() and not images:
            return [self._error(base, "parse", "EmptyDocument", "document has no text")]
        tasks = spec.tasks
        limit = self.max_model_len
        try:
            ctx = self._context(doc)
        except Exception as e:
            return [self._error(base, "prompt", type(e).__name__, str(e)[:500])]
        if self.preprocess is not None:
            try:
                ctx = apply_preprocess(self.preprocess, ctx)
            except Skip as e:
                return [self._error(base, "preprocess", "Skipped", f"skipped by the pipeline's preprocess: {e}"[:500])]
            except Exception as e:  # the hook failed on this document: its dead letter
                return [self._error(base, "preprocess", type(e).__name__, f"preprocess failed: {e}"[:500])]
        ids, mm, errors = self._encode_tasks(ctx, images, doc)
        if not ids:
            e = next(iter(errors.values()))
            return [self._error(base, "prompt", type(e).__name__, str(e)[:500])]
        marks: dict[int, dict] = {k: {} for k in ids}
        try:
            by_policy = self._over_limit(ids, mm, errors)
            if not ids:
                e = next(iter(errors.values()))
                return [self._error(base, "prompt", "LongInput", str(e)[:500])]
            if "skip" in by_policy:
                k = by_policy["skip"][0]
                return [self._error(base, "prompt", "LongInput", f"task {tasks[k].name!r}: prompt of "
                                    f"{_length(ids, mm, k)} tokens + max_tokens {tasks[k].max_tokens} exceeds "
                                    f"max_model_len {limit}")]
            self._cut_to_fit(by_policy, ctx, doc, images, (ids, mm, marks, errors))
            map_rows = self._chunk(base, doc, ctx, [tasks[k] for k in by_policy.get("chunk", [])])
        except Exception as e:
            return [self._error(base, "prompt", type(e).__name__, str(e)[:500])]
        if isinstance(map_rows, dict):  # an error row
            return [map_rows]
        chunked = set(by_policy.get("chunk", []))
        out = []
        for k, t in enumerate(tasks):
            if k in errors:
                e = errors[k]
                out.append({**self._error(base, "prompt", type(e).__name__, str(e)[:500]), "task": t.name,
                            "task_index": k})
            elif k not in chunked:
                out.append({**base, "task": t.name, "task_index": k, "prompt_ids": ids[k], "max_tokens": t.max_tokens,
                            "truncated": bool(marks[k]),
                            "seed": derive_seed(task_sampling(spec, t.name).seed, doc["doc_id"], t.name),
                            "stage": None, "error_type": None, "error": None, **_NO_MARK, **marks[k],
                            **request_marks(t.adapter, mm.get(k))})
        return expand_samples(spec, out) + map_rows

    def _cut_to_fit(self, by_policy: dict, ctx: dict, doc: dict, images: list[dict], state) -> None:
        """The ``truncate`` / ``middle`` tasks of ``by_policy`` cut to fit, in place in
        ``state`` (ids, image prompts, marks, errors): text tasks share one cut document per
        policy; an image task is cut by text, then by page, or fails alone."""
        ids, mm, marks, errors = state
        for policy in ("truncate", "middle"):
            text_ks = [k for k in by_policy.get(policy, []) if k not in mm]
            if text_ks:
                cut_ids, mark = self._truncate(ctx, text_ks, self.max_model_len, policy)
                for k, i in cut_ids.items():
                    ids[k], marks[k] = i, mark
            for k in (k for k in by_policy.get(policy, []) if k in mm):
                try:
                    mm[k], marks[k] = self._image_task(k, ctx, images, doc, policy)
                    ids[k] = mm[k].ids
                except LongInput as e:
                    errors[k] = e
                    ids.pop(k)

    def _encode_tasks(self, ctx: dict, images: list[dict], doc: dict):
        """Every task's prompt: ({task index: token ids}, {task index: `Encoded` image prompt},
        {task index: its exception}). A document without text (scanned pages only) reaches
        the tasks with images alone."""
        ids, mm, errors = {}, {}, {}
        empty = not (doc.get("text") or "").strip()
        for k, t in enumerate(self.spec.tasks):
            try:
                if t.images is not None:
                    mm[k], _ = self._image_task(k, ctx, images, doc)
                    ids[k] = mm[k].ids
                elif empty:
                    errors[k] = EmptyDocument(f"task {t.name!r}: the document has no text layer; its scanned pages "
                                              "reach the tasks with images: only")
                else:
                    ids[k] = self.encoder.encode(k, self._render(k, ctx))
            except Exception as e:
                errors[k] = e
        return ids, mm, errors

    def _over_limit(self, ids: dict, mm: dict, errors: dict) -> dict[str, list[int]]:
        """The tasks whose prompt + max_tokens do not fit, by long-input policy (image tokens
        counted); a chat that does not fit is its task's error (a chat is not cut). Tasks in
        ``errors`` leave ``ids``."""
        tasks, limit, by_policy = self.spec.tasks, self.max_model_len, {}
        for k in list(ids):
            n = _length(ids, mm, k)
            if n > limit - tasks[k].max_tokens:
                if tasks[k].messages is not None:
                    errors[k] = ValueError(f"LongInput: task {tasks[k].name!r}: the chat is {n} tokens, "
                                           f"+ max_tokens {tasks[k].max_tokens} exceeds max_model_len {limit}")
                    continue
                by_policy.setdefault(tasks[k].long_inputs or self.spec.long_inputs, []).append(k)
        for k in errors:
            ids.pop(k, None)
        return by_policy

    def _image_task(self, k: int, ctx: dict, images: list[dict], doc: dict, policy: str | None = None):
        """Task k's image prompt (`dlbatch.prompts.multimodal`) and its long-input marks: as
        rendered (``policy`` None), or fitted to the context by ``policy`` (truncate, middle)."""
        from dlbatch.prompts.templates import document_context

        t, pages = self.spec.tasks[k], int(doc.get("pages") or 0)
        render = lambda c: self._render(k, c)  # noqa: E731
        if policy is None:
            return self.mm.task_prompt(t, render, ctx, images, pages), {}
        text_ids = self.tok.encode(ctx["text"], add_special_tokens=False)
        body = document_context(ctx)["text_without_references"]
        body_ids = text_ids if body == ctx["text"] else self.tok.encode(body, add_special_tokens=False)
        cut = lambda n: (self._cut(text_ids, n, policy), self._cut(body_ids, n, policy))  # noqa: E731
        enc, kept, _ = fit(lambda n, drop: self.mm.task_prompt(t, render, ctx, images, pages, cut(n), drop),
                           len(text_ids), self.max_model_len - t.max_tokens, f"task {t.name!r}")
        return enc, {"long_input_policy": policy, "doc_tokens": len(text_ids), "kept_tokens": kept}

    def _context(self, doc: dict) -> dict:
        from connectors.columns import unpack

        row = unpack(doc.get("columns")) if self.reads_row else {}
        if doc.get("columns") is not None and self.reads_row:
            row[self.spec.input.text_field] = doc["text"]
        ctx = {"text": doc["text"], "title": doc.get("title") or "", "doc_id": doc["doc_id"],
               "source": doc["source"], "pages": doc.get("pages") or 0, "row": row}
        structure = doc.get("structure")
        if isinstance(structure, str):
            structure = json.loads(structure)
        ctx.update({k: (structure or {}).get(k) for k in STRUCTURE_KEYS if k in (structure or {})}
                   or {k: doc[k] for k in STRUCTURE_KEYS if k in doc})
        return ctx

    def _chunk(self, base: dict, doc: dict, ctx: dict, tasks) -> list[dict] | dict:
        """Map rows of a ChunkPlan for the tasks that chunk (none: []); an error row when this
        runner has no map-reduce driver."""
        if not tasks:
            return []
        if not self.map_reduce:
            return self._error(base, "prompt", "LongInput",
                               f"task {tasks[0].name!r}: long_inputs 'chunk' needs the map-reduce driver, which "
                               "this runner does not have; use truncate, middle or skip")
        from dlbatch.prompts.longdoc import ChunkPlan

        c, spec = self.spec.chunking, self.spec
        plan = ChunkPlan(ctx, tasks, self.encoder, max_model_len=self.max_model_len,
                         chunk_tokens=c.chunk_tokens, overlap_tokens=c.overlap_tokens, map_prompt=c.map_prompt,
                         reduce_prompt=c.reduce_prompt, map_max_tokens=c.map_max_tokens)
        state = json.dumps(plan.to_state())
        index = {t.name: k for k, t in enumerate(spec.tasks)}
        return [{**base, "task": r.task, "task_index": index[r.task], "prompt_ids": r.prompt_ids,
                 "max_tokens": r.max_tokens, "truncated": False,
                 "seed": derive_seed(task_sampling(spec, r.task).seed, doc["doc_id"], f"{r.task}/{r.key}"),
                 "stage": None, "error_type": None, "error": None, "long_input_policy": "chunk",
                 "doc_tokens": len(plan.ids), "kept_tokens": len(plan.ids), "chunk_index": r.index,
                 "chunk_count": plan.num_chunks, "chunk_plan": state,
                 **request_marks(spec.tasks[index[r.task]].adapter)}
                for r in plan.map_requests()]

    def _truncate(self, ctx: dict, ks: list[int], limit: int, policy: str = "truncate"):
        """Cut the document so every task of ``ks`` fits: its head (``truncate``) or its
        head and tail around MIDDLE_MARK (``middle``). The same cut for all of them keeps
        their shared prefix. Returns ({task index: prompt ids}, the row marks)."""
        from dlbatch.prompts.templates import document_context

        tasks = self.spec.tasks
        text_ids = self.tok.encode(ctx["text"], add_special_tokens=False)
        body = document_context(ctx)["text_without_references"]
        body_ids = text_ids if body == ctx["text"] else self.tok.encode(body, add_special_tokens=False)
        empty = {k: self.encoder.encode(k, self._render(k, {**ctx, "text": "", "text_without_references": ""}))
                 for k in ks}
        budget = min(limit - tasks[k].max_tokens - len(empty[k]) for k in ks) - 8
        if budget <= 0:
            raise ValueError(f"the task prompts alone need more than max_model_len {limit} tokens")
        n = min(len(text_ids), budget)
        while True:
            cut = {"text": self._cut(text_ids, n, policy), "text_without_references": self._cut(body_ids, n, policy)}
            ids = {k: self.encoder.encode(k, self._render(k, {**ctx, **cut})) for k in ks}
            if all(len(ids[k]) <= limit - tasks[k].max_tokens for k in ks) or n <= 0:
                return ids, {"long_input_policy": policy, "doc_tokens": len(text_ids), "kept_tokens": n}
            n -= max(8, n // 50)

    def _cut(self, ids: list[int], n: int, policy: str) -> str:
        if n >= len(ids):
            return self.tok.decode(ids)
        if policy == "middle":
            head = n // 2
            return self.tok.decode(ids[:head]) + MIDDLE_MARK + self.tok.decode(ids[len(ids) - (n - head):])
        return self.tok.decode(ids[:n])

    @staticmethod
    def _error(base: dict, stage: str, etype: str, msg: str) -> dict:
        return {**base, "task": None, "task_index": -1, "prompt_ids": [], "max_tokens": 0, "truncated": False,
                "seed": 0, "stage": stage, "error_type": etype, "error": repair_text(msg), **_NO_MARK}



class BatchLinePrompts:
    """The request rows of OpenAI batch lines (`PromptStage` of an ``openai_batch`` input):
    each line's body is its prompt. Owns the model's image processor for lines with image
    parts, loaded at the first such line."""

    def __init__(self, spec, tok, encoder, max_model_len: int, image_read: dict | None = None):
        """``image_read``: overrides of how image URLs are read (`connectors.image_columns.
        read_image_url`'s keywords) and bounded; by default relative paths from this process's
        directory, the job's input storage options where a URL's scheme is the input's, at
        most input.max_file_bytes bytes and input.parse_timeout_s seconds an image, and
        input.max_images / max_image_pixels a line."""
        import os

        self.spec, self.tok, self.encoder, self.max_model_len = spec, tok, encoder, max_model_len
        self.mm = None  # MultimodalPrompts, once a line holds an image
        inp = spec.input
        self.image_read = {"base": os.getcwd(), "storage_options": dict(inp.storage_options), "input_url": inp.path,
                           "max_bytes": inp.max_file_bytes, "max_images": inp.max_images,
                           "max_pixels": inp.max_image_pixels, "timeout_s": inp.parse_timeout_s, **(image_read or {})}

    def rows(self, base: dict, doc: dict) -> list[dict]:
        """An OpenAI batch request line (connectors/openai_batch.py) -> its request row(s): one
        row of the implicit task (n rows for n samples), the prompt ids from the chat template
        (chat: the body's messages, ``model.system`` first when they have no system message)
        or the raw prompt text (completions: encoded as a raw prompt is, special tokens
        added), ``max_tokens`` the body's (none: CHAT_DEFAULT_MAX_TOKENS or what the context
        leaves if less, for chat; the task's 16, as the API's, for completions), the seed the
        body's else the derived one, and the body's sampling as the row's own (``sampling``).
        A body `translate` refuses, or one that does not fit max_model_len (``LongInput``),
        is that line's dead letter, naming the key or the sizes."""
        from connectors.columns import unpack
        from connectors.openai_batch import BAD_REQUEST, CHAT_DEFAULT_MAX_TOKENS, TASK, InvalidRequest, translate

        cols = unpack(doc.get("columns"))
        try:
            req = translate(cols.get("url"), json.loads(cols.get("body") or "null"), self.spec.model.served_names,
                            tuple(self.spec.model.adapters), self.image_read)
        except InvalidRequest as e:
            return [PromptStage._error(base, "prompt", e.code, str(e)[:500])]
        enc = None  # the chat's images, if any, through the model's processor
        if req["chat"] and any(isinstance(m["content"], list) for m in req["messages"]):
            try:
                enc = self._images(req["messages"])
            except ValueError as e:
                return [PromptStage._error(base, "prompt", BAD_REQUEST, str(e)[:500])]
            ids, length = enc.ids, enc.length
        else:
            ids = self.encoder.encode(0, req["messages"]) if req["chat"] else self.tok.encode(req["prompt"])
            length = len(ids)
        limit, task = self.max_model_len, self.spec.tasks[0]
        max_tokens = req["max_tokens"]
        if max_tokens is None:
            max_tokens = min(CHAT_DEFAULT_MAX_TOKENS, limit - length) if req["chat"] else task.max_tokens
        if max_tokens < 1 or length + max_tokens > limit:
            return [PromptStage._error(base, "prompt", "LongInput",
                                f"the {'chat' if req['chat'] else 'prompt'} is {length} tokens"
                                + (f" ({enc.image_tokens} of them for {len(enc.images)} images)" if enc else "")
                                + f", + max_tokens {max_tokens} exceeds max_model_len {limit}")]
        seed = req["seed"] if req["seed"] is not None else derive_seed(task_sampling(self.spec, TASK).seed,
                                                                       doc["doc_id"], TASK)
        row = {**base, "task": TASK, "task_index": 0, "prompt_ids": ids, "max_tokens": max_tokens, "truncated": False,
               "seed": seed, "stage": None, "error_type": None, "error": None, **_NO_MARK,
               "sampling": json.dumps(req["sampling"], sort_keys=True) if req["sampling"] else None,
               **request_marks(req["adapter"], enc)}
        return expand_samples(self.spec, [row])

    def _images(self, messages: list[dict]):
        """An OpenAI batch chat with image parts -> its `Encoded` prompt (the model's processor
        loaded at the first such line); ValueError naming why it cannot run: a backend without
        image inputs, a model without an image processor, an image that is not one."""
        from dlbatch.prompts.multimodal import MultimodalPrompts

        self.spec.model.check_features(images=True)
        if self.mm is None:
            self.mm = MultimodalPrompts.for_job(self.spec, self.tok)
        return self.mm.chat_prompt(messages)


class EmptyDocument(ValueError):
    """A task's document has nothing the task reads (no text layer, and the task asks for no images)."""


def _length(ids: dict, mm: dict, k: int) -> int:
    """Task k's prompt length in the engine: its token ids, its images' tokens for their placeholders."""
    return mm[k].length if k in mm else len(ids[k])


_NO_MARK = {"long_input_policy": None, "doc_tokens": None, "kept_tokens": None, "chunk_index": None,
            "chunk_count": None, "chunk_plan": None}


def request_marks(adapter: str | None, images=None) -> dict:
    """A request row's adapter and images (docs/adapters.md, docs/multimodal.md): ``images``
    an `dlbatch.prompts.multimodal.Encoded` prompt's (compressed bytes in prompt order, the
    tokens they take in the engine), and the prefix salt of both (`dlbatch.records.prefix_salt`)."""
    from dlbatch.records import prefix_salt

    marks = {"adapter": adapter, "images": None, "image_tokens": None, "prefix_salt": prefix_salt(adapter)}
    if images is not None and images.images:
        marks.update(images=[i.data for i in images.images], image_tokens=images.image_tokens,
                     prefix_salt=prefix_salt(adapter, [i.digest for i in images.images]))
    return marks


def request_schema():
    import pyarrow as pa

    return pa.schema([("doc_id", pa.string()), ("source", pa.string()), ("title", pa.string()),
                      ("pages", pa.int64()), ("task", pa.string()), ("task_index", pa.int64()),
                      ("prompt_ids", pa.list_(pa.int64())), ("max_tokens", pa.int64()), ("truncated", pa.bool_()),
                      ("seed", pa.int64()), ("text", pa.string()), ("stage", pa.string()),
                      ("error_type", pa.string()), ("error", pa.string()),
                      ("long_input_policy", pa.string()), ("doc_tokens", pa.int64()), ("kept_tokens", pa.int64()),
                      ("chunk_index", pa.int64()), ("chunk_count", pa.int64()), ("chunk_plan", pa.string()),
                      ("columns", pa.binary()), ("sampling", pa.string()), ("doc_version", pa.string()),
                      # a LoRA adapter's name, the images (compressed bytes) and the tokens they take
                      ("adapter", pa.string()), ("images", pa.list_(pa.binary())), ("image_tokens", pa.int64()),
                      ("prefix_salt", pa.string())])
