"""Images in prompts: a task's page images and figure crops (or an OpenAI batch line's image
parts: `MultimodalPrompts.chat_prompt`), placed in its chat message and encoded by the model's
own processor (docs/multimodal.md).

A document's images arrive from the parse stage as compressed bytes with their labels
(`connectors.images`: ``kind``, ``label``, ``page``, ``caption``, ``dpi``, ``format``, ``width``,
``height``, ``data``, ``digest``; a row's column images, `connectors.image_columns`, are of
kind ``column`` with their ``column``). For a task with ``images:``, `MultimodalPrompts`:

- gives its template the image variables (`variables`): of a PDF, ``page_images`` (the
  task's pages and the document's scanned pages, in page order), ``page_image(n)``,
  ``figures`` (every figure and table crop, each followed by its caption) and
  ``figure("Figure 3")`` (that crop and its caption); of a PDF or a row, ``images`` (all of
  the task's images: a row's of the task's ``column``) and ``image(n)`` (the n-th, 1-based);
  each image is a marker in the rendered text (`MARK`), never the bytes;
- splits the rendered prompt at the markers into a chat message's content parts, text and
  ``{"type": "image"}``; a template that places no image gets the task's images first (its
  pages, then its figures with their captions), so the tasks of a document share them as
  prefix;
- renders the chat through the model's processor's chat template (``model.chat_template``
  when set; the system prompt and template kwargs as for text prompts) and encodes it with
  the job's tokenizer: one placeholder token per image, which the engine's processor
  expands into the image's tokens (vLLM's multimodal processor);
- counts each image's tokens as the model's processor counts them
  (``_get_num_multimodal_tokens`` from the image's size: nothing is decoded; a processor
  without it runs on the decoded images here, in the prompt stage, never in the driver).

`Encoded.length` is the prompt's length in the engine: ``len(ids) - images + image_tokens``.
The long-input policy counts it (`fit`): ``skip`` dead-letters a prompt that does not fit,
naming the image tokens; ``truncate``/``middle`` cut the text, and when the images alone do
not fit drop them from the end, a page at a time.

Plain object over the job's tokenizer and the model's processor: no Ray, no engine. The
processor is loaded (transformers) the first time an image prompt is encoded.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from dlbatch.prompts.templates import IMAGE_VARIABLES

MARK, END = "\ue000", "\ue001"  # private-use characters around an image's index in a rendered prompt
_MARKER = re.compile(MARK + r"(\d+)" + END)


@dataclass(frozen=True)
class ImageRef:
    """One image of a prompt: its compressed bytes and what identifies and sizes it."""

    data: bytes
    digest: str
    width: int
    height: int
    label: str = ""


@dataclass
class Encoded:
    """A prompt's token ids (one placeholder per image) and its images, in prompt order."""

    ids: list[int]
    images: list[ImageRef] = field(default_factory=list)
    image_tokens: int = 0  # tokens the images take in the engine (their placeholders expanded)

    @property
    def length(self) -> int:
        return len(self.ids) - len(self.images) + self.image_tokens


def parse_request(spec) -> dict | None:
    """What the parse stage makes of the job's tasks' ``images:``, None when no task asks for
    images: ``renders``, a PDF's (`connectors.images.render_images`' request), and
    ``columns``, a row's image columns (`connectors.image_columns.column_images`), with
    ``base``, the directory relative image paths are read from (this process's: the job's
    data paths are found from where it runs, docs/jobs.md), the per-document budget and the
    seconds an http(s) image may take."""
    import os

    renders, columns = [], []
    for t in spec.tasks:
        if t.images is not None and t.images.column is not None:
            if t.images.column not in columns:
                columns.append(t.images.column)
        elif t.images is not None:
            r = t.images.model_dump(exclude={"column"})
            if r not in renders:
                renders.append(r)
    if not renders and not columns:
        return None
    return {"renders": renders, "columns": columns, "base": os.getcwd(), "max_images": spec.input.max_images,
            "max_pixels": spec.input.max_image_pixels, "timeout_s": spec.input.parse_timeout_s}


def has_images(spec) -> bool:
    """Whether the job's rows carry images (its output gets the ``images`` and ``image_tokens`` columns)."""
    return any(t.images is not None for t in spec.tasks)


def result_fields(spec) -> list:
    """The extra result columns of a job whose rows carry images: ``images`` (how many the
    prompt held) and ``image_tokens`` (the tokens they took; ``prompt_tokens`` counts them)."""
    if not has_images(spec):
        return []
    import pyarrow as pa

    return [pa.field("images", pa.int64()), pa.field("image_tokens", pa.int64())]


def image_references(source: str) -> list[str]:
    """The image variables a template reads (none for a template that does not parse: its
    task's template check names the syntax error)."""
    from jinja2 import TemplateSyntaxError, meta

    from dlbatch.prompts.templates import _ENV

    try:
        used = meta.find_undeclared_variables(_ENV.parse(source))
    except TemplateSyntaxError:
        return []
    return [v for v in IMAGE_VARIABLES if v in used]


def marker(i: int) -> str:
    return f"{MARK}{i}{END}"


def _for_task(images: list[dict], want) -> list[int]:
    """Indices of ``images`` rendered for a task's ``images:`` (its dpi and format)."""
    return [i for i, im in enumerate(images) if im["dpi"] == want.dpi and im["format"] == want.format]


def variables(images: list[dict], want, task: str, doc_pages: int) -> dict:
    """The image variables of task ``task`` (its ``images:`` is ``want``) over the images of a
    document of ``doc_pages`` pages; ``_default`` is what a template placing none gets first,
    and ``images`` / ``image(n)`` all of the task's images / the n-th of them (1-based)."""
    if want.column is not None:
        mine = [i for i, im in enumerate(images) if im["kind"] == "column" and im.get("column") == want.column]
        return {**_pdf_variables([], want, task, doc_pages), **_listed(images, mine, f"column {want.column!r}")}
    return _pdf_variables(images, want, task, doc_pages)


def _listed(images: list[dict], mine: list[int], where: str) -> dict:
    """``images``, ``image(n)`` and ``_default`` over the task's images ``mine`` (indices)."""
    def image(n):
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(mine):
            raise ValueError(f"image({n!r}): this document's {where} holds {len(mine)} images (image(1) is the first)")
        return marker(mine[n - 1])

    everything = "".join(marker(i) for i in mine)
    return {"images": everything, "image": image, "_default": everything}


def _pdf_variables(images: list[dict], want, task: str, doc_pages: int) -> dict:
    """A PDF task's variables: its pages and scanned pages, then its figures with their captions."""
    from connectors.images import selected_pages

    mine = _for_task(images, want)
    pages = {images[i]["page"]: i for i in mine if images[i]["kind"] == "page"}
    scanned = {im["page"]: i for i, im in enumerate(images) if im["kind"] == "page" and im.get("textless")}
    wanted = set(selected_pages(want.pages, doc_pages))
    own = {p: i for p, i in pages.items() if p in wanted}
    page_list = [i for _, i in sorted({**scanned, **own}.items())]
    figs = [i for i in mine if images[i]["kind"] in ("figure", "table")] if want.figures else []

    def page_image(n):
        i = {**scanned, **pages}.get(int(n))
        if i is None:
            raise ValueError(f"page {n} was not rendered (images.pages is {want.pages!r}; "
                             f"the document has {max([0] + [im['page'] for im in images])} pages rendered)")
        return marker(i)

    def figure(label):
        want_label = " ".join(str(label).split()).lower().replace("fig.", "figure")
        for i in figs:
            if images[i]["label"].lower() == want_label:
                return f"{marker(i)}\n{images[i]['caption']}\n"
        raise ValueError(f"no {label!r} in this document (found: "
                         f"{', '.join(images[i]['label'] for i in figs) or 'no captioned figures or tables'})")

    return {"page_images": "".join(marker(i) for i in page_list), "page_image": page_image,
            "figures": "".join(f"{marker(i)}\n{images[i]['caption']}\n\n" for i in figs), "figure": figure,
            **_listed(images, page_list + figs, "rendered pages and figures"),
            "_default": "".join(marker(i) for i in page_list)
            + "".join(f"{marker(i)}\n{images[i]['caption']}\n\n" for i in figs)}


def content_parts(text: str, images: list[dict]) -> tuple[list[dict], list[ImageRef]]:
    """A rendered prompt with markers -> chat content parts and the images they place."""
    parts, refs, at = [], [], 0
    for m in _MARKER.finditer(text):
        if m.start() > at:
            parts.append({"type": "text", "text": text[at:m.start()]})
        im = images[int(m.group(1))]
        parts.append({"type": "image"})
        refs.append(ImageRef(bytes(im["data"]), im["digest"], int(im["width"]), int(im["height"]), im["label"]))
        at = m.end()
    if at < len(text):
        parts.append({"type": "text", "text": text[at:]})
    return parts, refs


class MultimodalPrompts:
    """Encodes the prompts that hold images: the chat through the model's processor, each
    image's tokens as the processor counts them."""

    def __init__(self, tokenizer, model, tasks, model_dir: str, template: str | None = None):
        """``model``: the job's model section (``system``, ``chat_template_kwargs``); ``tasks``:
        the job's tasks; ``model_dir``: the model's local folder (its processor's files);
        ``template``: ``model.chat_template``'s text (None: the processor's)."""
        self.tok, self.model, self.tasks, self.dir, self.template = tokenizer, model, list(tasks), model_dir, template
        self._processor = None

    @classmethod
    def for_job(cls, spec, tokenizer) -> "MultimodalPrompts":
        from dlbatch.engine.loader import model_dir

        template = None
        if spec.model.chat_template is not None:
            with open(spec.model.chat_template, encoding="utf-8") as f:
                template = f.read()
        _, path = model_dir(spec.model.ref)
        return cls(tokenizer, spec.model, spec.tasks, path, template)

    @property
    def processor(self):
        if self._processor is None:
            from transformers import AutoProcessor

            try:
                self._processor = AutoProcessor.from_pretrained(self.dir)
            except Exception as e:
                raise ValueError(f"the model at {self.dir} has no image processor transformers can load "
                                 f"({type(e).__name__}: {e}); image inputs need a vision-language model") from None
            if getattr(self._processor, "image_processor", None) is None:
                raise ValueError(f"the model at {self.dir} has no image processor: image inputs need a "
                                 "vision-language model")
        return self._processor

    def task_prompt(self, task, render, ctx: dict, images: list[dict], doc_pages: int, text=None,
                    drop: int = 0) -> Encoded:
        """Task ``task``'s prompt over a document's ``images``: ``render(context)`` its template
        with the image variables added to ``ctx``; ``text``: (text, text_without_references)
        to render instead of the document's (a cut); ``drop``: images left out from the end."""
        names = variables(images, task.images, task.name, doc_pages)
        c = {**ctx, **{v: names[v] for v in IMAGE_VARIABLES}}
        if text is not None:
            c.update(text=text[0], text_without_references=text[1])
        rendered = render(c)
        if MARK not in rendered:  # the template places no image: the task's images come first
            rendered = names["_default"] + rendered
        parts, refs = drop_images(*content_parts(rendered, images), drop)
        return self.encode(task, parts, refs)

    def encode(self, task, parts: list[dict], refs: list[ImageRef]) -> Encoded:
        """A user message of content ``parts`` (its images ``refs``) for ``task`` (a TaskSpec, or
        None: an OpenAI batch line's own messages in ``parts``) -> its `Encoded` prompt."""
        messages = parts if task is None else [{"role": "user", "content": parts}]
        system = (task.system if task is not None and task.system is not None else self.model.system)
        if system and not any(m["role"] in ("system", "developer") for m in messages):
            messages = [{"role": "system", "content": system}] + messages
        kwargs = {**self.model.chat_template_kwargs, **(task.chat_template_kwargs if task is not None else {})}
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  **({"chat_template": self.template} if self.template else {}),
                                                  **kwargs)
        ids = self.tok.encode(text, add_special_tokens=False)
        placed = sum(1 for t in ids if t == self._image_token_id())
        if placed != len(refs):
            raise ValueError(f"the model's chat template placed {placed} image placeholders for {len(refs)} images")
        return Encoded(ids, list(refs), sum(self.image_tokens(refs, text)))

    def chat_prompt(self, messages: list[dict]) -> Encoded:
        """An OpenAI batch line's messages (connectors/openai_batch.py), whose content parts hold
        images as ``{"type": "image", "data": bytes}`` -> its `Encoded` prompt, the images in
        message order."""
        out, refs = [], []
        for m in messages:
            if isinstance(m["content"], list):
                parts = []
                for p in m["content"]:
                    if p["type"] == "image":
                        refs.append(image_ref(p["data"], f"image {len(refs) + 1}"))
                        p = {"type": "image"}
                    parts.append(p)
                m = {**m, "content": parts}
            out.append(m)
        return self.encode(None, out, refs)

    def _image_token_id(self) -> int:
        p = self.processor
        tid = getattr(p, "image_token_id", None)
        if tid is None:
            tid = self.tok.encode(p.image_token, add_special_tokens=False)[0]
        return int(tid)

    def image_tokens(self, refs: list[ImageRef], text: str = "") -> list[int]:
        """Each image's tokens in the engine (the tokens its placeholder becomes), as the
        model's processor counts them from the image's size."""
        if not refs:
            return []
        p = self.processor
        try:
            counts = p._get_num_multimodal_tokens(image_sizes=[(r.height, r.width) for r in refs])
            return [int(n) for n in counts["num_image_tokens"]]
        except (AttributeError, NotImplementedError, KeyError, TypeError):  # a processor without transformers' size rule
            return self._counted_by_processing(refs)

    def _counted_by_processing(self, refs: list[ImageRef]) -> list[int]:
        """A processor without a size rule: each image processed alone (decoded here, in the
        prompt stage), its prompt's growth counted."""
        import io

        from PIL import Image

        p, out = self.processor, []
        for r in refs:
            image = Image.open(io.BytesIO(r.data)).convert("RGB")
            out.append(len(p(text=[p.image_token], images=[image], add_special_tokens=False)["input_ids"][0]))
        return out


def image_ref(data: bytes, label: str) -> ImageRef:
    """Compressed image bytes -> an `ImageRef`: its size read from the header (PIL opens
    lazily: no pixel is decoded), its digest the sha256 of the bytes. ValueError naming
    ``label`` when the bytes are not an image PIL reads."""
    import hashlib
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            width, height = im.size
    except Exception as e:
        raise ValueError(f"{label} is not an image: {type(e).__name__}: {e}") from None
    return ImageRef(bytes(data), hashlib.sha256(data).hexdigest(), int(width), int(height), label)


def drop_images(parts: list[dict], refs: list[ImageRef], n: int) -> tuple[list[dict], list[ImageRef]]:
    """The content parts and images less the last ``n`` images (a prompt cut by page)."""
    if n <= 0:
        return parts, refs
    keep = len(refs) - n
    out, seen = [], 0
    for p in parts:
        if p["type"] == "image":
            seen += 1
            if seen > keep:
                continue
        out.append(p)
    return out, refs[:keep]


class LongInput(ValueError):
    """An image prompt that does not fit the context even without text and images."""


def fit(encode, doc_tokens: int, budget: int, what: str):
    """The longest prompt within ``budget`` tokens: ``encode(text_tokens, dropped_images)``
    gives the prompt with the document's text cut to that many tokens and its last images
    dropped. Images are dropped (from the end) only while the prompt without any text does
    not fit; then the text is cut. -> (Encoded, text tokens kept, images dropped); raises
    ValueError (a ``LongInput``) when nothing fits, naming ``what`` and the counts."""
    enc, drop = encode(0, 0), 0
    first = enc
    while enc.length > budget and drop < len(first.images):
        drop += 1
        enc = encode(0, drop)
    if enc.length > budget:
        raise LongInput(f"{what}: the prompt without the document's text is {enc.length} tokens "
                         f"({first.image_tokens} of them for {len(first.images)} images) with no image left, "
                         f"over the {budget} tokens max_model_len leaves")
    n = min(doc_tokens, budget - enc.length)
    while True:
        enc = encode(n, drop)
        if enc.length <= budget or n <= 0:
            return enc, max(n, 0), drop
        n -= max(8, n // 50)
