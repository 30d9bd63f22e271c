"""One way from a task's prompt to token ids: a chunked task's map and reduce prompts go
through the chat template, the system prompt and the template kwargs exactly as an
unchunked prompt of a task does (dlbatch/prompts/encoder.py). No Ray, no model: the
bundled model's tokenizer and a tiny chat template whose output shows what it was given."""
from __future__ import annotations

import pytest

from dlbatch.driver.document import Document
from dlbatch.jobspec import parse_job
from dlbatch.prompts.map_reduce import MapReduce
from tests.helpers.stage import prompt_stage

# every message with its role, then what the kwargs asked for: <no_think> when thinking is off,
# the task's style when it gives one
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}"
            "{% if style is defined %}[style={{ style }}]{% endif %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SYSTEM = "You read scientific papers closely."
PARA = ("Paragraph {i} reports that perovskite absorbers lose efficiency under heat, humidity and light, and "
        "that encapsulation slows the loss by a factor the authors measure. ")


@pytest.fixture
def spec(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    tasks = [{"name": "notes", "prompt": "{{ text }}\n\nSummarize the paper.", "max_tokens": 16,
              "long_inputs": "chunk", "chat_template_kwargs": {"style": "terse"}},
             {"name": "field", "prompt": "Which field is the paper \"{{ title }}\" in?", "max_tokens": 8,
              "chat_template_kwargs": {"style": "terse"}},
             {"name": "own", "prompt": "{{ text }}\n\nList its keywords.", "max_tokens": 8, "long_inputs": "chunk",
              "system": "Answer in keywords only."}]
    return parse_job({"name": "t", "pipeline": "papers",
                      "model": {"name": "smollm2-135m-instruct", "max_model_len": 768, "system": SYSTEM,
                                "chat_template": str(tmp_path / "chat.jinja"),
                                "chat_template_kwargs": {"enable_thinking": False}},
                      "chunking": {"map_max_tokens": 24, "overlap_tokens": 16}, "tasks": tasks})


def _doc(n_paras: int = 24) -> dict:
    return {"doc_id": "long1", "source": "long1.pdf", "title": "Stability of perovskite cells", "pages": 12,
            "text": "\n\n".join(PARA.format(i=i) * 2 for i in range(n_paras))}


def _head(prompt: str) -> str:
    """What the template put before the user's message."""
    return prompt.split("<|user|>", 1)[0]


def _tail(prompt: str) -> str:
    """What the template put after the user's message."""
    return prompt.rsplit("<|end|>", 1)[1]


def test_chunked_prompts_go_through_the_template_the_system_prompt_and_the_kwargs(spec):
    stage = prompt_stage(spec, map_reduce=True)
    rows = stage.process(_doc())
    assert not any(r["error"] for r in rows)
    tok = stage.tok
    (field,) = [r for r in rows if r["task"] == "field"]
    plain = tok.decode(field["prompt_ids"])
    assert plain.startswith(f"<|system|>{SYSTEM}<|end|>\n<|user|>Which field")
    assert _tail(plain) == "\n<no_think>[style=terse]<|assistant|>"
    maps = [r for r in rows if r["long_input_policy"] == "chunk"]
    assert {r["task"] for r in maps} == {"notes", "own"} and len(maps) == 2 * maps[0]["chunk_count"]
    for r in maps:
        text = tok.decode(r["prompt_ids"])
        if r["task"] == "notes":  # the job's system prompt, the model's kwargs and the task's, as `field` has
            assert _head(text) == _head(plain) and _tail(text) == _tail(plain)
        else:  # the task's own system prompt, the model's kwargs only
            assert _head(text) == "<|system|>Answer in keywords only.<|end|>\n"
            assert _tail(text) == "\n<no_think><|assistant|>"
    # the reduce prompts the driver builds when the maps are done: the same template, system and kwargs
    mr = MapReduce(spec, tok)
    doc = Document("long1")
    for r in rows:
        doc.add_request(MapReduce.request_row(r))
    doc.results = {t: {"output": f"a note on {t}", "output_tokens": 5, "finish_reason": "stop"} for t in doc.rows}
    reduces = mr.more_requests(doc)
    assert {r["task"].split("#", 1)[0] for r in reduces} == {"notes", "own"}
    for r in reduces:
        text = tok.decode(r["prompt_ids"])
        assert "a note on notes#map:notes:0:0" in text or "a note on own#map:own:0:0" in text
        if r["task"].startswith("notes#"):
            assert _head(text) == _head(plain) and _tail(text) == _tail(plain)
        else:
            assert _head(text) == "<|system|>Answer in keywords only.<|end|>\n"
            assert _tail(text) == "\n<no_think><|assistant|>"


def test_the_encoder_by_task_index_or_name_for_a_prompt_or_a_chat(spec):
    from dlbatch.prompts.encoder import PromptEncoder

    stage = prompt_stage(spec)
    enc, tok = PromptEncoder.for_job(spec, stage.tok), stage.tok
    assert enc.chat and enc.encode(1, "Q?") == enc.encode("field", "Q?")
    assert tok.decode(enc.encode("own", "Q?")) == ("<|system|>Answer in keywords only.<|end|>\n<|user|>Q?<|end|>\n"
                                                   "<no_think><|assistant|>")
    chat = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "Q?"}]  # its own system message wins
    assert tok.decode(enc.encode("notes", chat)) == ("<|system|>Mine.<|end|>\n<|user|>Q?<|end|>\n"
                                                     "<no_think>[style=terse]<|assistant|>")
    with pytest.raises(KeyError, match="'nope' is not a task of this job"):
        enc.encode("nope", "Q?")
    raw = spec.model_copy(update={"tasks": [t.model_copy(update={"raw": True}) for t in spec.tasks]})
    assert PromptEncoder.for_job(raw, tok).encode(0, "Q?") == tok.encode("Q?")  # raw: as is, special tokens added
    plain = spec.model_copy(update={"model": spec.model.model_copy(update={"chat": False})})
    with pytest.raises(ValueError, match="gives messages, but the model has no chat template"):
        PromptEncoder.for_job(plain, tok).encode(0, chat)


def test_a_chunk_plan_rebuilt_by_an_encoder_that_disagrees_is_refused(spec):
    import json

    from dlbatch.prompts.encoder import PromptEncoder
    from dlbatch.prompts.longdoc import ChunkPlan

    stage = prompt_stage(spec, map_reduce=True)
    row = next(r for r in stage.process(_doc()) if r["chunk_plan"])
    state = json.loads(row["chunk_plan"])
    assert state["settings"]["chat"] is True
    tasks = [spec.tasks[0], spec.tasks[2]]
    plan = ChunkPlan.from_state(state, _doc(), tasks, stage.encoder)
    assert plan.spans == [tuple(s) for s in state["spans"]]
    plain = spec.model_copy(update={"model": spec.model.model_copy(update={"chat": False})})
    with pytest.raises(ValueError, match="built with chat=True, but this encoder has chat=False"):
        ChunkPlan.from_state(state, _doc(), tasks, PromptEncoder.for_job(plain, stage.tok))
