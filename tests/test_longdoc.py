"""dlbatch.prompts.longdoc.ChunkPlan: chunk boundaries, map -> reduce order, recursive reduce,
serialisable state; driven without Ray or a model (real SmolLM2 tokenizer)."""
from __future__ import annotations

import json
import random

import pytest

from connectors.pdf import extract_pdf
from dlbatch.prompts.longdoc import ChunkPlan, chunk_spans, split_pieces
from tests.helpers.pdfs import PAPERS_DIR

TASKS = [{"name": "summary", "prompt": "{{ text }}\n\nSummarize this paper in three sentences.", "max_tokens": 128},
         {"name": "keywords", "prompt": "{{ text }}\n\nList five keywords of this paper.", "max_tokens": 32}]


@pytest.fixture(scope="module")
def tok():
    from dlbatch.engine.loader import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def _enc(tok, chat: bool):
    """The encoder of a job with TASKS on the bundled model, its chat template on or off."""
    from dlbatch.jobspec.model import ModelSpec
    from dlbatch.jobspec.tasks import TaskSpec
    from dlbatch.prompts.encoder import PromptEncoder

    return PromptEncoder(tok, ModelSpec(chat=chat), [TaskSpec(**t) for t in TASKS])


@pytest.fixture(scope="module")
def paper():
    data = (PAPERS_DIR / "long_context_batch_serving.pdf").read_bytes()
    return extract_pdf(data, "long_context_batch_serving.pdf")


def _check_cover(spans, total, overlap):
    assert spans[0][0] == 0 and spans[-1][1] == total
    for (a0, b0), (a1, b1) in zip(spans, spans[1:]):
        assert a0 < a1 < b1 and a1 <= b0           # in order, no gap
        assert b0 - a1 == overlap                   # shared tokens: exactly the declared overlap


@pytest.mark.parametrize("seed", range(5))
def test_chunk_spans_cover_everything_with_declared_overlap(seed):
    rng = random.Random(seed)
    lens = [rng.choice([rng.randint(1, 40), rng.randint(100, 900)]) for _ in range(rng.randint(1, 60))]
    overlap = rng.choice([0, 16, 50])
    spans = chunk_spans(lens, 400, overlap, preferred={i for i in range(len(lens)) if i % 7 == 0})
    _check_cover(spans, sum(lens), overlap)
    assert all(b - a <= 400 for a, b in spans)


def test_chunk_spans_prefer_paragraph_and_section_boundaries():
    lens = [100] * 10
    bounds = {100 * i for i in range(11)}
    spans = chunk_spans(lens, 350, 0)
    assert all(b in bounds for _, b in spans)     # whole paragraphs when they fit
    spans = chunk_spans(lens, 350, 0, preferred={2})
    assert spans[0] == (0, 200)                   # a section starts at piece 2: cut there (>= half full)
    with pytest.raises(ValueError, match="overlap_tokens"):
        chunk_spans(lens, 100, 50)


def test_plan_chunks_the_long_sample_losslessly(tok, paper):
    plan = ChunkPlan(paper, TASKS, _enc(tok, True), max_model_len=4096, overlap_tokens=64)
    assert "".join(split_pieces(paper["text"])) == paper["text"]
    assert len(plan.ids) > 15000 and plan.num_chunks >= 4
    _check_cover(plan.spans, len(plan.ids), 64)
    # the chunks, less the overlaps, are the document's tokens
    rebuilt = plan.ids[plan.spans[0][0]:plan.spans[0][1]]
    for a, b in plan.spans[1:]:
        rebuilt += plan.ids[a + 64:b]
    assert rebuilt == plan.ids
    reqs = plan.map_requests()
    assert [(r.index, r.task) for r in reqs] == [(i, t["name"]) for i in range(plan.num_chunks) for t in TASKS]
    for r in reqs:
        assert len(r.prompt_ids) + r.max_tokens <= 4096 and r.kind == "map" and not r.final
    # the K tasks' map prompts of one chunk share the chunk as prefix
    for i in range(plan.num_chunks):
        a, b = reqs[2 * i].prompt_ids, reqs[2 * i + 1].prompt_ids
        common = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common >= plan.spans[i][1] - plan.spans[i][0] - 2
    assert plan.summary()["chunks"] == plan.num_chunks


def _drive(plan, note_words: int):
    """Run the plan to the end with fake outputs; returns the order of request kinds/levels."""
    queue = plan.map_requests()
    seen = []
    while queue:
        r = queue.pop(0)
        assert len(r.prompt_ids) + r.max_tokens <= plan.limit, r.key
        seen.append((r.task, r.kind, r.level, r.index, r.final))
        out = f"final {r.task}" if r.final else " ".join(f"note{r.level}-{r.index}-{w}" for w in range(note_words))
        queue.extend(plan.on_done(r.key, out))
    return seen


def test_map_then_single_reduce(tok, paper):
    plan = ChunkPlan(paper, TASKS, _enc(tok, True), max_model_len=4096, map_max_tokens=128)
    seen = _drive(plan, note_words=20)
    assert plan.done and plan.final("summary") == "final summary" and plan.final("keywords") == "final keywords"
    for task in ("summary", "keywords"):
        mine = [s for s in seen if s[0] == task]
        assert [s[1] for s in mine] == ["map"] * plan.num_chunks + ["reduce"]   # reduce waits for every map
        assert mine[-1][4] is True
    assert plan.summary()["reduce_levels"] == {"summary": 1, "keywords": 1}


def test_recursive_reduce_when_notes_do_not_fit(tok, paper):
    plan = ChunkPlan(paper, TASKS[:1], _enc(tok, False), max_model_len=1024, map_max_tokens=200,
                     overlap_tokens=0)
    assert plan.num_chunks > 20
    seen = _drive(plan, note_words=60)   # ~150 tokens a note: many notes cannot share one prompt
    assert plan.done
    levels = [s[2] for s in seen if s[1] == "reduce"]
    assert max(levels) >= 2 and levels == sorted(levels)
    assert [s for s in seen if s[4]] == [seen[-1]]           # exactly one final, the last request
    per_level = {lv: levels.count(lv) for lv in set(levels)}
    for lv in range(1, max(levels)):
        assert per_level[lv + 1] < per_level[lv]           # every level shrinks


def test_state_round_trip_mid_way(tok, paper):
    kwargs = dict(max_model_len=1024, map_max_tokens=200, overlap_tokens=0)
    a = ChunkPlan(paper, TASKS[:1], _enc(tok, False), **kwargs)
    maps = a.map_requests()
    for r in maps[:-1]:
        assert a.on_done(r.key, "words " * 80) == []
    state = json.loads(json.dumps(a.to_state()))
    b = ChunkPlan.from_state(state, paper, TASKS[:1], _enc(tok, False))
    assert b.spans == a.spans
    ra, rb = a.on_done(maps[-1].key, "words " * 80), b.on_done(maps[-1].key, "words " * 80)
    assert [r.to_dict() for r in ra] == [r.to_dict() for r in rb] and len(ra) >= 2


def test_bad_settings_are_named(tok, paper):
    with pytest.raises(ValueError, match="chunk_tokens 5000 does not fit"):
        ChunkPlan(paper, TASKS, _enc(tok, False), max_model_len=4096, chunk_tokens=5000)
    with pytest.raises(ValueError, match="map_max_tokens 2000 is too large"):
        ChunkPlan(paper, TASKS, _enc(tok, False), max_model_len=4096, map_max_tokens=2000, chunk_tokens=1000)
    plan = ChunkPlan(paper, TASKS, _enc(tok, False), max_model_len=4096)
    with pytest.raises(ValueError, match="no reduce group"):
        plan.on_done("reduce:summary:1:0", "x")


# ------------------------------------------------------------------ PromptStage policies

def _stage(tmp_path, monkeypatch, map_reduce=False, **job):
    from dlbatch.jobspec import parse_job
    from tests.helpers.stage import prompt_stage

    monkeypatch.chdir(tmp_path)
    spec = {"name": "t", "pipeline": "papers", "model": {"name": "smollm2-135m-instruct", "max_model_len": 2048},
            "tasks": TASKS, **job}
    return prompt_stage(parse_job(spec), map_reduce=map_reduce)


@pytest.fixture(scope="module")
def doc_row():
    from connectors.parse import parse_file

    (row,) = parse_file({"url": str(PAPERS_DIR / "tidal_array_wakes.pdf")}, "pdf", "text", None, None, None)
    return row


def _fits(rows, limit=2048):
    for r in rows:
        assert len(r["prompt_ids"]) + r["max_tokens"] <= limit


def test_truncate_and_middle_mark_rows(tmp_path, monkeypatch, tok, doc_row):
    from dlbatch.prompts.stage import MIDDLE_MARK

    for policy in ("truncate", "middle"):
        rows = _stage(tmp_path, monkeypatch, long_inputs=policy).process(doc_row)
        assert [r["task"] for r in rows] == ["summary", "keywords"]
        _fits(rows)
        for r in rows:
            assert r["truncated"] is True and r["long_input_policy"] == policy and r["error"] is None
            assert 1000 < r["kept_tokens"] < r["doc_tokens"] and r["doc_tokens"] > 8000
        prompt = tok.decode(rows[0]["prompt_ids"])
        tail = " ".join(doc_row["text"].split()[-12:])
        if policy == "middle":
            assert MIDDLE_MARK.strip() in prompt and tail in prompt
        else:
            assert MIDDLE_MARK.strip() not in prompt and tail not in prompt
        a, b = rows[0]["prompt_ids"], rows[1]["prompt_ids"]
        shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        assert shared > rows[0]["kept_tokens"] - 10     # the cut document is the shared prefix


def test_per_task_policy_and_structure_variables(tmp_path, monkeypatch, tok, doc_row):
    tasks = [{"name": "abstract_only", "prompt": "{{ abstract }}\n\n{{ section('Conclusion') }}\n\nSummarize.",
              "max_tokens": 64, "long_inputs": "skip"},
             {"name": "whole", "prompt": "{{ text_without_references }}\n\nSummarize.", "max_tokens": 64}]
    rows = _stage(tmp_path, monkeypatch, long_inputs="middle", tasks=tasks).process(doc_row)
    assert [r["task"] for r in rows] == ["abstract_only", "whole"]
    short, whole = rows
    assert short["truncated"] is False and short["long_input_policy"] is None  # it fits: no policy applies
    assert len(short["prompt_ids"]) < 1500
    text = tok.decode(short["prompt_ids"])
    assert "7 Conclusion" not in text and "[1]" not in text
    assert whole["long_input_policy"] == "middle" and "[1]" not in tok.decode(whole["prompt_ids"])
    # the same skip policy on a task that does not fit dead-letters the document
    tasks[1]["long_inputs"] = "skip"
    (err,) = _stage(tmp_path, monkeypatch, tasks=tasks).process(doc_row)
    assert err["error_type"] == "LongInput" and "'whole'" in err["error"] and err["task"] is None


def test_chunk_policy_rows(tmp_path, monkeypatch, tok, doc_row):
    (err,) = _stage(tmp_path, monkeypatch, long_inputs="chunk").process(doc_row)
    assert err["error_type"] == "LongInput" and "map-reduce driver" in err["error"]
    rows = _stage(tmp_path, monkeypatch, map_reduce=True, long_inputs="chunk",
                  chunking={"overlap_tokens": 32, "map_max_tokens": 128}).process(doc_row)
    _fits(rows)
    n = rows[0]["chunk_count"]
    assert n >= 6 and len(rows) == 2 * n
    assert [(r["chunk_index"], r["task"]) for r in rows] == [(i, t["name"]) for i in range(n) for t in TASKS]
    assert all(r["long_input_policy"] == "chunk" and r["truncated"] is False for r in rows)
    assert len({r["seed"] for r in rows}) == len(rows)
    plan = ChunkPlan.from_state(json.loads(rows[0]["chunk_plan"]), doc_row, TASKS, _enc(tok, True))
    assert plan.num_chunks == n and plan.spans[-1][1] == rows[0]["doc_tokens"]
