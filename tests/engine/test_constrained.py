"""Constrained decoding (engine/constraint.py): every output of a JSON-schema, regex or
choices request matches its constraint, greedy and sampled, on the bundled model and on a
tiny random model (whose unconstrained output is noise); PD (prefill -> decode) gives the
same tokens as colocated generation."""
from __future__ import annotations

import json
import re

import pytest
import torch

from tests.helpers.tiny_models import make_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number"},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "score", "member", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{1,3}(\.[0-9]{1,2})? (kg|g)"
CHOICES = ["positive", "negative", "neutral"]
N = 32


def _c(kind, spec):
    from dlbatch.engine.constraint import Constraint

    return Constraint(kind, spec)


# ---- plain objects ------------------------------------------------------------------------
def test_constraint_validation_and_key():
    from dlbatch.engine.constraint import Constraint

    a = Constraint("json_schema", {"type": "object", "properties": {"a": {"type": "string"}}})
    b = Constraint.from_dict({"kind": "json_schema", "spec": json.dumps(a.spec)})
    assert a == b and a.key() == b.key() and hash(a) == hash(b)
    assert Constraint.from_dict(a.to_dict()) == a
    assert json.loads(json.dumps(Constraint("choices", ["x", "y"]).to_dict())) == {"kind": "choices", "spec": ["x", "y"]}
    with pytest.raises(ValueError, match="kind must be one of"):
        Constraint("yaml", "x")
    with pytest.raises(ValueError, match="non-empty list"):
        Constraint("choices", [])
    with pytest.raises(ValueError, match="list of strings"):
        Constraint("choices", "abc")
    with pytest.raises(ValueError, match="not valid JSON"):
        Constraint("json_schema", "{not json")
    with pytest.raises(ValueError, match="kind"):
        Constraint.from_dict({"type": "regex"})


def test_sampling_params_carry_the_constraint():
    from dlbatch import SamplingParams

    p = SamplingParams(constraint={"kind": "regex", "spec": "a+"})
    assert p.constraint == _c("regex", "a+")
    assert p.key() != SamplingParams().key()
    assert p.key() == SamplingParams(constraint=_c("regex", "a+")).key()


def test_apply_bitmask_sets_forbidden_tokens_to_minus_inf():
    from dlbatch.engine.constraint import apply_bitmask

    logits = torch.zeros(3, 70)
    mask = torch.zeros(2, 2, dtype=torch.int32)  # 64 tokens wide: tokens 64.. are forbidden
    mask[0, 0] = 0b101  # tokens 0 and 2
    mask[1, 1] = 1 << 3  # token 35
    apply_bitmask(logits, mask, [0, 2])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[1]).all()  # row 1 is not constrained
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [35]


# ---- the bundled model ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    from dlbatch import LLM

    return LLM("smollm2-135m-instruct", dtype="float32", max_model_len=1024)


def _prompts(n):
    topics = ["a chemist", "a pilot", "a farmer", "a poet", "a judge", "a nurse", "a baker", "a coder"]
    return [f"Describe {topics[i % len(topics)]} number {i} as a JSON object." for i in range(n)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llm, temperature):
    import jsonschema

    from dlbatch import SamplingParams

    sp = SamplingParams(max_tokens=160, temperature=temperature, seed=7, constraint=_c("json_schema", SCHEMA))
    outs = llm.generate(_prompts(N), sp)
    done = [o for o in outs if o.finish_reason == "stop"]
    assert len(done) >= N * 3 // 4, [o.text for o in outs]  # a few sampled ones may run out of tokens
    for o in done:
        jsonschema.validate(json.loads(o.text), SCHEMA)
    for o in outs:
        if o.finish_reason == "length":
            assert len(o.token_ids) == 160


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_and_choices_outputs_match(llm, temperature):
    from dlbatch import SamplingParams

    prompts = [f"Item {i}: how heavy is a {w}?" for i, w in enumerate(["cat", "brick", "coin", "book"] * (N // 4))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=temperature, seed=1,
                                                constraint=_c("regex", REGEX)))
    assert all(o.finish_reason == "stop" and re.fullmatch(REGEX, o.text) for o in outs), [o.text for o in outs]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=temperature, seed=1,
                                                constraint=_c("choices", CHOICES)))
    assert all(o.finish_reason == "stop" and o.text in CHOICES for o in outs), [o.text for o in outs]


def test_mixed_batch_free_rows_unchanged(llm):
    """Constrained and free requests in one batch: the free ones give exactly what they
    give alone (the mask touches only constrained rows)."""
    from dlbatch import SamplingParams

    prompts = _prompts(8)
    free = SamplingParams(max_tokens=12)
    alone = llm.generate(prompts, free)
    mixed = llm.generate(prompts, [free if i % 2 else SamplingParams(max_tokens=12, constraint=_c("choices", CHOICES))
                                   for i in range(8)])
    for i in range(1, 8, 2):
        assert mixed[i].token_ids == alone[i].token_ids
    assert all(mixed[i].text in CHOICES for i in range(0, 8, 2))


def test_max_tokens_cuts_json_with_length(llm):
    from dlbatch import SamplingParams

    o = llm.generate(_prompts(1), SamplingParams(max_tokens=5, constraint=_c("json_schema", SCHEMA)))[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(o.text)


def test_compiled_once_per_engine(llm):
    from dlbatch import SamplingParams

    comp = llm.engine.constraints
    before = comp.compiles
    c = {"kind": "regex", "spec": "[a-c]{3}x"}
    llm.generate(_prompts(4), SamplingParams(max_tokens=8, constraint=c))
    llm.generate(_prompts(4), SamplingParams(max_tokens=8, constraint=c))
    assert comp.compiles == before + 1


def test_bad_constraint_fails_its_request_clearly(llm):
    from dlbatch import SamplingParams
    from dlbatch.engine.constraint import ConstraintError

    with pytest.raises(ConstraintError, match="regex constraint cannot be compiled"):
        llm.generate(["hi"], SamplingParams(max_tokens=4, constraint=_c("regex", "(unclosed")))
    with pytest.raises(ConstraintError, match="grammar constraint cannot be compiled"):
        llm.generate(["hi"], SamplingParams(max_tokens=4, constraint=_c("grammar", "start: undefined_rule")))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_pd_equals_colocated_constrained(llm, temperature):
    from dlbatch import SamplingParams

    prompts = _prompts(6)
    params = [SamplingParams(max_tokens=120, temperature=temperature, seed=11 + i,
                             constraint=_c("json_schema", SCHEMA) if i % 2 else _c("choices", CHOICES))
              for i in range(6)]
    ref = llm.generate(prompts, params)
    pre = llm.prefill(prompts, params)
    out = llm.decode(pre)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert [o.text for o in out] == [o.text for o in ref]


# ---- a tiny random model: unconstrained it emits noise ----------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dlbatch import LLM

    path = str(tmp_path_factory.mktemp("tiny") / "llama")
    make_tiny_model("llama", path)
    return LLM(path, dtype="float32", max_model_len=512, chat=False)


def _tiny_text(llm, ids):
    """The tiny tokenizer is WordLevel over single characters with no decoder (its decode
    joins tokens with spaces): the generated string is the tokens concatenated."""
    eos = llm.engine.eos_ids
    return "".join(llm.tokenizer.tk.id_to_token(t) for t in ids if t not in eos)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tiny_random_model_obeys_constraints(tiny, temperature):
    import jsonschema

    from dlbatch import SamplingParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {
        "type": "boolean"}, "maxItems": 3}}, "required": ["a", "b"], "additionalProperties": False}
    prompts = [[5 + (i * 7 + j) % 90 for j in range(6 + i % 5)] for i in range(N)]
    outs = tiny.generate(prompts, SamplingParams(max_tokens=60, temperature=temperature, seed=3,
                                                 constraint=_c("json_schema", schema)))
    done = [o for o in outs if o.finish_reason == "stop"]
    assert len(done) >= N // 2
    for o in done:
        jsonschema.validate(json.loads(_tiny_text(tiny, o.token_ids)), schema)
    outs = tiny.generate(prompts, SamplingParams(max_tokens=12, temperature=temperature, seed=3,
                                                 constraint=_c("regex", "[a-f]{2,4}-[0-9]")))
    assert all(re.fullmatch("[a-f]{2,4}-[0-9]", _tiny_text(tiny, o.token_ids)) for o in outs)
    outs = tiny.generate(prompts, SamplingParams(max_tokens=12, temperature=temperature, seed=3,
                                                 constraint=_c("choices", ["yes", "no", "maybe"])))
    assert all(_tiny_text(tiny, o.token_ids) in ("yes", "no", "maybe") for o in outs)
    assert all(o.finish_reason == "stop" for o in outs)


def test_tiny_pd_equals_colocated(tiny):
    from dlbatch import SamplingParams

    prompts = [[5 + (i * 3 + j) % 90 for j in range(10)] for i in range(8)]
    params = [SamplingParams(max_tokens=30, temperature=0.8, seed=i, constraint=_c("regex", "[a-z]{3,8}@[a-z]{2,5}"))
              for i in range(8)]
    ref = tiny.generate(prompts, params)
    out = tiny.decode(tiny.prefill(prompts, params))
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
