"""Map-reduce planning for documents longer than the context (``long_inputs: chunk``).

A ``ChunkPlan`` is a plain object: no Ray, no engine. The driver asks it for requests,
runs them, and reports each output back; the plan answers with the requests that became
ready. Life of one document with K tasks::

    plan = ChunkPlan(doc, tasks, encoder, max_model_len=4096)
    reqs = plan.map_requests()              # chunk-major: chunk 0's K map prompts, then chunk 1's...
    for each finished request r with output o:
        new = plan.on_done(r.key, o)        # [] while maps/groups are pending; then reduce requests
    plan.done -> True once every task has its final answer; plan.final(task) -> str

Chunking. The document's token sequence is the concatenation of its paragraphs'
encodings (each paragraph after the first carries its "\\n\\n" separator), so every chunk is
an exact token range ``[start, end)`` of that sequence. A window holds at most
``chunk_tokens`` tokens; it ends at a paragraph boundary in its second half (a section
heading preferred), else at the token limit. The next window starts ``overlap_tokens``
before the previous end. Invariant (tested): the chunks cover ``[0, n)`` in order and two
neighbours share exactly ``min(overlap_tokens, ...)`` tokens, nothing is skipped.

Map. Every chunk gets one map prompt per task (``map_prompt``, rendered with the chunk
as ``text``; it starts with the chunk so the K tasks of a chunk share it as prefix).

Prompts. Map and reduce prompts are a task's prompts: they go to token ids through the
job's `dlbatch.prompts.encoder.PromptEncoder`, with the task's chat template, system
prompt and template kwargs, exactly as an unchunked prompt of the task does; the budgets
below are measured on those ids.

Reduce. When all chunks of a task are mapped, its notes (the map outputs, in chunk
order) go into ``reduce_prompt``. If that prompt plus the task's ``max_tokens`` fits in
``max_model_len`` it is the task's final request. Otherwise the notes are packed in order
into groups that fit, each group is reduced to intermediate notes (``final`` false in the
template, output bounded by ``map_max_tokens``), and the next level reduces those:
recursively until one request fits. The constructor checks that two notes always fit in
one group, so every level at least halves the number of notes.

State. ``to_state()`` is JSON-serialisable (chunk spans, outputs, pending groups);
``ChunkPlan.from_state(state, doc, tasks, encoder)`` rebuilds the plan with an encoder of
the same job. The document text is not part of the state: only ``map_requests`` needs it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from dlbatch.prompts.templates import TemplateError, _ENV, _render, document_context

DEFAULT_MAP_PROMPT = (
    "{{ text }}\n\n"
    "The text above is part {{ chunk_index }} of {{ chunk_count }} of the document \"{{ title }}\". "
    "Write short notes on this part: everything in it that helps with this task.\n"
    "Task: {{ instruction }}"
)
DEFAULT_REDUCE_PROMPT = (
    "Notes on the {{ count }} parts of the document \"{{ title }}\", in order:\n\n{{ notes }}\n\n"
    "{% if final %}Using these notes, do this task for the whole document.\nTask: {{ instruction }}"
    "{% else %}Merge these notes into shorter notes that keep everything that helps with this task.\n"
    "Task: {{ instruction }}{% endif %}"
)
MAP_VARIABLES = ("text", "title", "doc_id", "source", "pages", "task", "instruction", "chunk_index", "chunk_count")
REDUCE_VARIABLES = ("notes", "count", "title", "doc_id", "source", "pages", "task", "instruction", "level",
                    "final")


def plan_key(kind: str, task: str, level: int, index: int) -> str:
    """A plan request's key, unique within its document: ``map:<task>:0:<chunk>`` or
    ``reduce:<task>:<level>:<group>`` (a request's ``part``, `dlbatch.records.RequestKey`)."""
    return f"{kind}:{task}:{level}:{index}"


@dataclasses.dataclass
class LongRequest:
    """One request of a plan. ``key`` is unique within the document."""
    doc_id: str
    task: str
    task_index: int
    kind: str               # "map" | "reduce"
    level: int              # 0 for maps; 1.. for reduce levels
    index: int              # chunk index (maps) or group index (reduces)
    prompt_ids: list[int]
    max_tokens: int
    final: bool = False     # the task's answer

    @property
    def key(self) -> str:
        return plan_key(self.kind, self.task, self.level, self.index)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "key": self.key}


def _task_fields(t: Any) -> tuple[str, str, int]:
    if isinstance(t, Mapping):
        return t["name"], t["prompt"], int(t.get("max_tokens", 128))
    return t.name, t.prompt, int(t.max_tokens)


def _compile(name: str, source: str, allowed: Sequence[str]):
    from dlbatch.prompts.templates import validate_template

    return validate_template(name, source, allowed)


def split_pieces(text: str) -> list[str]:
    """Paragraphs, each after the first with its leading "\\n\\n"; ''.join(pieces) == text."""
    paras = text.split("\n\n")
    return [paras[0]] + ["\n\n" + p for p in paras[1:]]


def chunk_spans(piece_lens: Sequence[int], chunk_tokens: int, overlap_tokens: int,
                preferred: set[int] = frozenset()) -> list[tuple[int, int]]:
    """Token windows ``[start, end)`` over pieces of the given token lengths (see module doc).
    ``preferred``: piece indices that start a section (a cut just before them is preferred)."""
    if chunk_tokens < 2 or not 0 <= overlap_tokens <= chunk_tokens // 4:
        raise ValueError(f"need chunk_tokens >= 2 and 0 <= overlap_tokens <= chunk_tokens / 4, got "
                         f"chunk_tokens={chunk_tokens}, overlap_tokens={overlap_tokens}")
    bounds = [0]
    for n in piece_lens:
        bounds.append(bounds[-1] + n)
    total = bounds[-1]
    best_of = {b: (i in preferred) for i, b in enumerate(bounds[:-1])}
    spans: list[tuple[int, int]] = []
    start = 0
    while True:
        limit = start + chunk_tokens
        if limit >= total:
            spans.append((start, total))
            return spans
        cands = [b for b in bounds if start + chunk_tokens // 2 <= b <= limit]
        heads = [b for b in cands if best_of.get(b)]
        end = max(heads) if heads else (max(cands) if cands else limit)
        spans.append((start, end))
        start = end - overlap_tokens


class ChunkPlan:
    """Map-reduce plan of one document over its tasks (see the module docstring)."""

    def __init__(self, doc: Mapping[str, Any], tasks: Sequence[Any], encoder, max_model_len: int,
                 chunk_tokens: int | None = None, overlap_tokens: int = 128,
                 map_prompt: str = DEFAULT_MAP_PROMPT, reduce_prompt: str = DEFAULT_REDUCE_PROMPT,
                 map_max_tokens: int = 256, _spans: list | None = None):
        """``tasks``: the chunked tasks (job tasks, or mappings with name, prompt, max_tokens);
        ``encoder``: the job's `dlbatch.prompts.encoder.PromptEncoder`, which knows them by name."""
        self.doc = dict(doc)
        self.doc_id = str(doc.get("doc_id", ""))
        self.tasks = [_task_fields(t) for t in tasks]
        self.enc, self.tok, self.limit = encoder, encoder.tok, int(max_model_len)
        self.overlap_tokens, self.map_max_tokens = int(overlap_tokens), int(map_max_tokens)
        self.map_src, self.reduce_src = map_prompt, reduce_prompt
        self.map_tpl = _compile("map_prompt", map_prompt, MAP_VARIABLES)
        self.reduce_tpl = _compile("reduce_prompt", reduce_prompt, REDUCE_VARIABLES)
        self.instructions = {name: self._instruction(name, prompt) for name, prompt, _ in self.tasks}
        self.chunk_tokens = self._check_budget(chunk_tokens)
        self.pieces = split_pieces(self.doc.get("text") or "")
        self.piece_ids = [self.tok.encode(p, add_special_tokens=False) for p in self.pieces]
        self.ids = [i for ids in self.piece_ids for i in ids]
        if _spans is not None:
            self.spans = [tuple(s) for s in _spans]
        else:
            headings = {s.get("heading") for s in self.doc.get("sections") or ()} | {"References"}
            preferred = {i for i, p in enumerate(self.pieces) if p.strip() in headings}
            self.spans = chunk_spans([len(x) for x in self.piece_ids], self.chunk_tokens, self.overlap_tokens,
                                     preferred)
        self.maps: dict[str, dict[int, str]] = {name: {} for name, _, _ in self.tasks}
        self.groups: dict[str, dict[int, list[list[int]]]] = {name: {} for name, _, _ in self.tasks}
        self.reduced: dict[str, dict[int, dict[int, str]]] = {name: {} for name, _, _ in self.tasks}
        self.final_level: dict[str, int] = {}
        self.finals: dict[str, str] = {}

    # ------------------------------------------------------------------ budgets

    def _instruction(self, name: str, prompt: str) -> str:
        """The task's prompt with an empty document: what the task asks."""
        render = _ENV.from_string(prompt)
        ctx = document_context({**{k: self.doc.get(k) for k in ("title", "doc_id", "source", "pages")},
                                "text": ""})
        return _render(name, render, ctx).strip()

    def _map_overhead(self) -> int:
        return max(len(self.enc.encode(name, self._map_text(name, "", 10**3, 10**3))) for name, _, _ in self.tasks)

    def _check_budget(self, chunk_tokens: int | None) -> int:
        room = self.limit - self._map_overhead() - self.map_max_tokens - 8
        if chunk_tokens is None:
            chunk_tokens = room
        if chunk_tokens > room or chunk_tokens < 64:
            raise ValueError(f"chunk_tokens {chunk_tokens} does not fit: max_model_len {self.limit} leaves "
                             f"{room} tokens for a chunk after the map prompt and map_max_tokens "
                             f"{self.map_max_tokens} (and a chunk needs at least 64)")
        worst = self.tok.decode([self.tok.encode(" note", add_special_tokens=False)[-1]] * self.map_max_tokens)
        # every task's: a task's system prompt and template kwargs make its reduce prompts longer
        two_notes = max(len(self._reduce_ids(name, [worst] * 2, 1, final=False)) for name, _, _ in self.tasks)
        if two_notes + self.map_max_tokens > self.limit:
            raise ValueError(f"map_max_tokens {self.map_max_tokens} is too large for max_model_len {self.limit}: "
                             "two notes must fit in one reduce prompt")
        return chunk_tokens

    # ------------------------------------------------------------------ map

    @property
    def num_chunks(self) -> int:
        return len(self.spans)

    def chunk_text(self, i: int) -> str:
        a, b = self.spans[i]
        return self.tok.decode(self.ids[a:b])

    def _map_text(self, task: str, text: str, i: int, n: int) -> str:
        ctx = {k: self.doc.get(k) for k in ("title", "doc_id", "source", "pages")}
        ctx.update(text=text, task=task, instruction=self.instructions.get(task, ""), chunk_index=i + 1,
                   chunk_count=n, title=self.doc.get("title") or "")
        return _render(task, self.map_tpl, ctx)

    def map_requests(self) -> list[LongRequest]:
        if not self.ids:
            raise ValueError(f"document {self.doc_id!r}: no text to chunk")
        out = []
        for i in range(self.num_chunks):
            text = self.chunk_text(i)
            for k, (name, _, _) in enumerate(self.tasks):
                out.append(LongRequest(self.doc_id, name, k, "map", 0, i,
                                       self.enc.encode(name, self._map_text(name, text, i, self.num_chunks)),
                                       self.map_max_tokens))
        return out

    # ------------------------------------------------------------------ reduce

    def _reduce_ids(self, task: str, notes: Sequence[str], level: int, final: bool) -> list[int]:
        joined = "\n\n".join(f"Part {i + 1}:\n{n.strip()}" for i, n in enumerate(notes))
        ctx = {k: self.doc.get(k) for k in ("doc_id", "source", "pages")}
        ctx.update(notes=joined, count=len(notes), title=self.doc.get("title") or "", task=task,
                   instruction=self.instructions.get(task, ""), level=level, final=final)
        return self.enc.encode(task, _render(task, self.reduce_tpl, ctx))

    def _task(self, name: str) -> tuple[int, int]:
        for k, (n, _, max_tokens) in enumerate(self.tasks):
            if n == name:
                return k, max_tokens
        raise KeyError(f"task {name!r} is not a task of this plan")

    def _clip(self, note: str) -> str:
        """A note longer than map_max_tokens tokens (the engine never returns one) is cut
        to that: the budget check in __init__ then guarantees two notes per group."""
        ids = self.tok.encode(note, add_special_tokens=False)
        return note if len(ids) <= self.map_max_tokens else self.tok.decode(ids[:self.map_max_tokens])

    def _reduce_level(self, task: str, notes: list[str], level: int) -> list[LongRequest]:
        k, max_tokens = self._task(task)
        notes = [self._clip(n) for n in notes]
        ids = self._reduce_ids(task, notes, level, final=True)
        if len(ids) + max_tokens <= self.limit:
            self.groups[task][level] = [list(range(len(notes)))]
            self.final_level[task] = level
            return [LongRequest(self.doc_id, task, k, "reduce", level, 0, ids, max_tokens, final=True)]
        groups: list[list[int]] = [[]]
        for i in range(len(notes)):
            trial = groups[-1] + [i]
            fits = len(self._reduce_ids(task, [notes[j] for j in trial], level, False)) + self.map_max_tokens \
                <= self.limit
            if groups[-1] and not fits:
                groups.append([i])
            else:
                groups[-1] = trial
        self.groups[task][level] = groups
        reqs = []
        for g, members in enumerate(groups):
            group_notes = [notes[j] for j in members]
            ids = self._reduce_ids(task, group_notes, level, final=False)
            reqs.append(LongRequest(self.doc_id, task, k, "reduce", level, g, ids, self.map_max_tokens))
        return reqs

    def on_map_done(self, task: str, chunk_index: int, output: str) -> list[LongRequest]:
        """Record one map output; the task's first reduce level once all its chunks are mapped."""
        self._task(task)
        if not 0 <= chunk_index < self.num_chunks:
            raise ValueError(f"chunk_index {chunk_index} out of range (0..{self.num_chunks - 1})")
        self.maps[task][chunk_index] = output
        if len(self.maps[task]) < self.num_chunks or self.groups[task]:
            return []
        return self._reduce_level(task, [self.maps[task][i] for i in range(self.num_chunks)], 1)

    def on_reduce_done(self, task: str, level: int, group: int, output: str) -> list[LongRequest]:
        """Record one reduce output; the next level once all groups of this level are done.
        A final reduce sets ``final(task)`` and returns []."""
        groups = self.groups[task].get(level)
        if groups is None or not 0 <= group < len(groups):
            raise ValueError(f"task {task!r}: no reduce group {group} at level {level}")
        if self.final_level.get(task) == level:
            self.finals[task] = output
            return []
        self.reduced[task].setdefault(level, {})[group] = output
        done = self.reduced[task][level]
        if len(done) < len(groups) or level + 1 in self.groups[task]:
            return []
        return self._reduce_level(task, [done[g] for g in range(len(groups))], level + 1)

    def on_done(self, key: str, output: str) -> list[LongRequest]:
        """``on_map_done`` / ``on_reduce_done`` by a request's ``key``."""
        kind, task, level, index = key.split(":")
        if kind == "map":
            return self.on_map_done(task, int(index), output)
        if kind == "reduce":
            return self.on_reduce_done(task, int(level), int(index), output)
        raise ValueError(f"not a plan request key: {key!r}")

    # ------------------------------------------------------------------ results and state

    @property
    def done(self) -> bool:
        return len(self.finals) == len(self.tasks)

    def final(self, task: str) -> str | None:
        return self.finals.get(task)

    def final_key(self, task: str) -> str:
        """The key of the task's final reduce request (its answer)."""
        return plan_key("reduce", task, self.final_level[task], 0)

    def summary(self) -> dict:
        """What a result row records about the chunking."""
        return {"chunks": self.num_chunks, "doc_tokens": len(self.ids),
                "chunk_tokens": [b - a for a, b in self.spans],
                "reduce_levels": {t: max(g) if g else 0 for t, g in self.groups.items()}}

    def to_state(self) -> dict:
        return {"doc_id": self.doc_id, "spans": [list(s) for s in self.spans],
                "settings": {"max_model_len": self.limit, "chat": self.enc.chat, "chunk_tokens": self.chunk_tokens,
                             "overlap_tokens": self.overlap_tokens, "map_prompt": self.map_src,
                             "reduce_prompt": self.reduce_src, "map_max_tokens": self.map_max_tokens},
                "maps": {t: {str(i): o for i, o in m.items()} for t, m in self.maps.items()},
                "groups": {t: {str(l): g for l, g in lv.items()} for t, lv in self.groups.items()},
                "reduced": {t: {str(l): {str(g): o for g, o in d.items()} for l, d in lv.items()}
                            for t, lv in self.reduced.items()},
                "final_level": dict(self.final_level), "finals": dict(self.finals)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], doc: Mapping[str, Any], tasks: Sequence[Any],
                   encoder) -> "ChunkPlan":
        """The plan ``to_state`` saved. Its ``chat`` setting records whether its prompts went
        through the chat template: ``encoder`` must agree, or the reduce prompts would be
        built unlike the maps whose budgets the spans were cut for."""
        settings = dict(state["settings"])
        chat = settings.pop("chat", encoder.chat)
        if bool(chat) != encoder.chat:
            raise ValueError(f"document {state.get('doc_id')!r}: its chunk plan was built with chat={chat}, "
                             f"but this encoder has chat={encoder.chat}")
        plan = cls(doc, tasks, encoder, _spans=state["spans"], **settings)
        plan.maps = {t: {int(i): o for i, o in m.items()} for t, m in state["maps"].items()}
        plan.groups = {t: {int(l): g for l, g in lv.items()} for t, lv in state["groups"].items()}
        plan.reduced = {t: {int(l): {int(g): o for g, o in d.items()} for l, d in lv.items()}
                        for t, lv in state["reduced"].items()}
        plan.final_level = {t: int(l) for t, l in state["final_level"].items()}
        plan.finals = dict(state["finals"])
        return plan


__all__ = ["ChunkPlan", "LongRequest", "chunk_spans", "plan_key", "split_pieces", "DEFAULT_MAP_PROMPT",
           "DEFAULT_REDUCE_PROMPT", "TemplateError"]
