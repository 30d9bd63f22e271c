"""The driver's side of ``long_inputs: chunk``: map requests in, reduce requests out, one
final row per task.

`PromptStage` turns a document too long for the context into the map rows of a
`dlbatch.prompts.longdoc.ChunkPlan` (one per chunk and chunked task; the plan's state rides on
every row as JSON). Each map row is a request of its own, named ``<task>#<key>`` (a
`dlbatch.records.RequestKey` whose ``part`` is the plan's key), so the dispatcher routes,
batches, retries and blames it like any other request. `MapReduce` is the `Dispatcher`'s
``more_requests`` hook: when every request of a document is done it feeds their outputs to
the document's plan and returns the reduce requests that became ready (the next level of a
recursive reduce, or the task's final one); the document completes when the plan asks for
nothing more, and `output_rows` then gives one row per original task with the final answer
(`dlbatch.records.result_row`). The plan is rebuilt from its state with the job's
`dlbatch.prompts.encoder.PromptEncoder`, so reduce prompts are built as the stage built the maps.

Invariants. A document is committed only when every task has its final answer, all in
one part, so a run killed between map and reduce commits nothing of it and the rerun
redoes its chunks; a partial reduce is never written. Plain object: no Ray, no engine.
"""
from __future__ import annotations

import json
import logging

from dlbatch.prompts.longdoc import ChunkPlan, plan_key
from dlbatch.prompts.sampling import task_sampling
from dlbatch.prompts.stage import derive_seed, request_marks
from dlbatch.records import RequestKey, base_task, result_row

log = logging.getLogger("dlbatch.run")


def is_chunk_row(row: dict) -> bool:
    return bool(row.get("chunk_plan"))


def is_note(doc_id: str, name: str) -> bool:
    """Whether a request name is a chunked task's map or reduce request (it has a ``part``)."""
    return RequestKey.parse(doc_id, name).part is not None


class MapReduce:
    def __init__(self, spec, tokenizer):
        from dlbatch.prompts.encoder import PromptEncoder

        self.spec = spec
        self.encoder = PromptEncoder.for_job(spec, tokenizer)  # the prompt stage's, rebuilt from the same job
        self.plans: dict = {}  # doc id -> ChunkPlan, while the document is open
        self.fed: dict[str, set] = {}  # doc id -> request names already given to its plan
        self.index = {t.name: k for k, t in enumerate(spec.tasks)}
        self.chunk_tokens: list[int] = []  # token length of every chunk of the documents completed

    @staticmethod
    def request_row(row: dict) -> dict:
        """A map row from the prompt stage as a request of its own (unique name per chunk)."""
        if not is_chunk_row(row) or is_note(row["doc_id"], row["task"]):
            return row
        part = plan_key("map", row["task"], 0, row["chunk_index"])
        return {**row, "task": RequestKey(row["doc_id"], row["task"], part).name}

    def _plan(self, doc):
        plan = self.plans.get(doc.doc_id)
        if plan is None:
            first = next(r for r in doc.rows.values() if is_chunk_row(r))
            state = json.loads(first["chunk_plan"])
            tasks = sorted({base_task(t) for t, r in doc.rows.items() if is_chunk_row(r)}, key=self.index.get)
            ctx = {"doc_id": doc.doc_id, "title": first.get("title") or "", "source": first.get("source"),
                   "pages": first.get("pages") or 0, "text": ""}
            plan = ChunkPlan.from_state(state, ctx, [self.spec.tasks[self.index[t]] for t in tasks],
                                      self.encoder)
            self.plans[doc.doc_id] = plan
            self.fed[doc.doc_id] = set()
        return plan

    def more_requests(self, doc) -> list[dict]:
        """The Dispatcher's hook: every request of ``doc`` is done; what comes next."""
        if not any(is_chunk_row(r) for r in doc.rows.values()):
            return []
        plan = self._plan(doc)
        fed = self.fed[doc.doc_id]
        new = []
        for name, row in doc.rows.items():
            if not is_chunk_row(row) or name in fed:
                continue
            fed.add(name)
            res = doc.results.get(name) or {}
            new += plan.on_done(RequestKey.parse(doc.doc_id, name).part, res.get("output", ""))
        first = next(r for r in doc.rows.values() if is_chunk_row(r))
        if new:
            log.info("document %s: %d reduce requests (level %s) after its %d chunks", doc.doc_id, len(new),
                     "/".join(sorted({str(r.level) for r in new})), plan.num_chunks)
        return [{**first, "task": RequestKey(doc.doc_id, r.task, r.key).name, "task_index": r.task_index,
                 "prompt_ids": r.prompt_ids, "max_tokens": r.max_tokens, "chunk_index": None,
                 "seed": derive_seed(task_sampling(self.spec, r.task).seed, doc.doc_id, f"{r.task}/{r.key}"),
                 **request_marks(self.spec.tasks[self.index[r.task]].adapter)}  # the task's adapter, not first's
                for r in new]

    def output_rows(self, doc, model: str, extra=None) -> list[dict]:
        """The document's result rows: its plain tasks as `Document.output_rows` gives them,
        and one row per chunked task with the final answer. A chunked task's row counts the
        tokens of all its map and reduce requests and the final request's finish reason."""
        rows = [r for r in doc.output_rows(model, extra) if not is_note(doc.doc_id, r["task"])]
        plan = self.plans.pop(doc.doc_id, None)
        self.fed.pop(doc.doc_id, None)
        if plan is None:
            return rows
        self.chunk_tokens += plan.summary()["chunk_tokens"]
        for name, _, _ in plan.tasks:
            reqs = [r for t, r in doc.rows.items() if base_task(t) == name and is_note(doc.doc_id, t)]
            results = [doc.results[r["task"]] for r in reqs]
            final = doc.results[RequestKey(doc.doc_id, name, plan.final_key(name)).name]
            first = reqs[0]
            rows.append(result_row(first, final, model, task=name, extra=extra, output=plan.final(name) or "",
                                   prompt_tokens=sum(len(r["prompt_ids"]) for r in reqs),
                                   output_tokens=sum(x.get("output_tokens", 0) for x in results), truncated=False,
                                   long_input_policy="chunk", kept_tokens=first.get("doc_tokens"),
                                   chunks=plan.num_chunks))
        order = {t.name: k for k, t in enumerate(self.spec.tasks)}
        return sorted(rows, key=lambda r: order.get(r["task"], 0))
