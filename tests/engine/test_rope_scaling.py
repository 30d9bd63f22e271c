"""Long-context RoPE kinds against transformers (fp32 logits) on tiny random models, at
positions beyond the original context: YaRN (Qwen2.5 / Qwen3 long-context configs) and
dynamic NTK. Llama 3.1 scaling is covered by test_parity.py (arch llama3_rope)."""
from __future__ import annotations

import random

import pytest
import torch

from tests.helpers.parity import ATOL, full_logits
from tests.helpers.tiny_models import VOCAB, make_tiny_model

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
CASES = {
    # name: (arch, config overrides, engine max_model_len, prompt length)
    "qwen2_yarn": ("qwen2", {"max_position_embeddings": 256, "rope_scaling": dict(YARN)}, 256, 200),
    "qwen3_yarn": ("qwen3", {"max_position_embeddings": 256, "rope_scaling": dict(YARN)}, 256, 230),
    "qwen2_yarn_legacy_type_mscale": ("qwen2", {"max_position_embeddings": 256, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0,
        "mscale": 0.707, "mscale_all_dim": 1.0}}, 256, 180),
    # dynamic NTK: transformers recomputes the base for the current length (here = max_model_len)
    "llama_dynamic": ("llama", {"max_position_embeddings": 64,
                                "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, 160, 160),
}


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_long_rope_logits_match_transformers(case, tmp_path):
    from dlbatch import LLM

    arch, overrides, max_len, n = CASES[case]
    hf = make_tiny_model(arch, str(tmp_path), overrides=overrides)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=max_len, chat=False, enable_prefix_caching=False)
    assert llm.engine.model.config.rope.kind == overrides["rope_scaling"].get("rope_type", "yarn")
    ids = _ids(n, seed=3)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    # dynamic: transformers' base is that of this n-token forward (n = max_model_len); the
    # engine takes at most n - 1 prompt tokens, whose logits are causal, so compare those
    m = n - 1 if n == max_len else n
    ours = full_logits(llm, ids[:m])
    torch.testing.assert_close(ours, ref[:m], atol=ATOL, rtol=1e-4, msg=f"{case}: logits differ")
    # the scaling matters at these positions: plain RoPE gives other logits there
    plain = make_tiny_model(arch, str(tmp_path / "plain"), overrides={**overrides, "rope_scaling": None,
                                                                        "max_position_embeddings": max_len})
    with torch.no_grad():
        unscaled = plain(torch.tensor([ids])).logits[0].float()
    assert (unscaled[-20:] - ref[-20:]).abs().max() > 10 * ATOL


def test_dynamic_ntk_deviation_is_only_between_lengths(tmp_path):
    """Documented deviation: our dynamic base is fixed for max_model_len. A sequence of
    another length beyond max_position_embeddings gets transformers' base for its own length,
    so logits differ; with max_model_len <= max_position_embeddings both are plain RoPE."""
    from dlbatch import LLM

    arch, overrides, _, _ = CASES["llama_dynamic"]
    hf = make_tiny_model(arch, str(tmp_path), overrides=overrides)
    ids = _ids(100, seed=4)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    long_engine = LLM(str(tmp_path), dtype="float32", max_model_len=160, chat=False, enable_prefix_caching=False)
    assert (full_logits(long_engine, ids) - ref).abs().max() > 10 * ATOL
    short_ids = ids[:60]
    with torch.no_grad():
        short_ref = hf(torch.tensor([short_ids])).logits[0].float()
    short_engine = LLM(str(tmp_path), dtype="float32", max_model_len=64, chat=False, enable_prefix_caching=False)
    torch.testing.assert_close(full_logits(short_engine, short_ids), short_ref, atol=ATOL, rtol=1e-4)


def test_context_limit_and_bad_factor():
    from dlbatch.engine.config import ModelConfig, ModelConfigError

    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 4096}
    dyn = ModelConfig.from_hf({**base, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    assert dyn.context_limit == 8192
    yarn = ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 1024}})
    assert yarn.context_limit == 4096 and yarn.rope.original_max_position == 1024
    with pytest.raises(ModelConfigError, match="factor must be >= 1"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 0.5}})
    with pytest.raises(ModelConfigError, match="longrope"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
