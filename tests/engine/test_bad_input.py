"""Bad input gets a clear error naming the value."""
from __future__ import annotations

import json
import struct

import pytest

from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    make_tiny_model("llama", path)
    return path


def test_unknown_model_name():
    from dlbatch import LLM
    from dlbatch.engine.loader import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        LLM("no-such-model")


def test_directory_without_config(tmp_path):
    from dlbatch import LLM

    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def test_pickled_weights_refused(tmp_path, tiny_path):
    import shutil

    from dlbatch import LLM

    d = tmp_path / "m"
    shutil.copytree(tiny_path, d)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ValueError, match="pickled"):
        LLM(str(d))


def test_unsupported_architecture_in_config(tmp_path, tiny_path):
    import shutil

    from dlbatch import LLM

    d = tmp_path / "m"
    shutil.copytree(tiny_path, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="gpt_neox"):
        LLM(str(d))


def _write_gguf(path, arch: str) -> None:
    """A minimal valid GGUF v3 header with general.architecture=arch and no tensors."""
    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<Q", len(b)) + b
    kv = s("general.architecture") + struct.pack("<I", 8) + s(arch)
    path.write_bytes(b"GGUF" + struct.pack("<I", 3) + struct.pack("<Q", 0) + struct.pack("<Q", 1) + kv)


def test_gguf_of_unsupported_architecture(tmp_path):
    from dlbatch import LLM

    p = tmp_path / "phi.gguf"
    _write_gguf(p, "phi2")
    with pytest.raises(ValueError, match="phi2"):
        LLM(str(p))


def test_sampling_params_validation():
    from dlbatch import SamplingParams

    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"max_tokens must be a positive integer, got {bad}"):
            SamplingParams(max_tokens=bad)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_empty_and_too_long_prompts(tiny_path):
    from dlbatch import LLM, SamplingParams

    llm = LLM(tiny_path, dtype="float32", max_model_len=64, chat=False)
    with pytest.raises(ValueError, match="prompt 0: empty prompt"):
        llm.generate([""], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"prompt of 70 tokens \+ max_tokens 8 exceeds max_model_len 64"):
        llm.generate([[5] * 70], SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[10**6]], SamplingParams(max_tokens=4))
    out = llm.generate([[5] * 70], SamplingParams(max_tokens=8, truncate_prompt=True))[0]
    assert out.truncated and out.prompt_tokens == 56 and len(out.token_ids) == 8
    # the engine is still usable after the errors
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


def test_bad_engine_options(tiny_path):
    from dlbatch import LLM

    with pytest.raises(ValueError, match="dtype 'fp8'"):
        LLM(tiny_path, dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(tiny_path, kv_cache_memory="lots")
    with pytest.raises(ValueError, match="max_model_len 100000 exceeds"):
        LLM(tiny_path, max_model_len=100000)


def test_stop_strings_and_seeded_sampling(tiny_path):
    from dlbatch import LLM, SamplingParams

    llm = LLM(tiny_path, dtype="float32", max_model_len=128, chat=False)
    p = [[7, 8, 9, 10]]
    full = llm.generate(p, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert len(full.text) > 3
    stop = full.text[2:4]
    cut = llm.generate(p, SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and full.text.startswith(cut.text)
    sp = SamplingParams(max_tokens=10, temperature=1.0, seed=123, ignore_eos=True)
    a = llm.generate(p, sp)[0].token_ids
    b = llm.generate(p * 3, [sp, SamplingParams(max_tokens=5, temperature=0.7, seed=1), sp])
    assert b[0].token_ids == a and b[2].token_ids == a
    other = llm.generate(p, SamplingParams(max_tokens=10, temperature=1.0, seed=124, ignore_eos=True))[0].token_ids
    assert other != a


def test_hf_directory_from_fsspec_url(tiny_path):
    """Weights, config and tokenizer read through fsspec (memory:// here, s3:// alike)."""
    import os

    import fsspec

    from dlbatch import LLM, SamplingParams

    fs = fsspec.filesystem("memory")
    for name in os.listdir(tiny_path):
        with open(os.path.join(tiny_path, name), "rb") as f:
            fs.pipe_file(f"/tinyllama/{name}", f.read())
    local = LLM(tiny_path, dtype="float32", max_model_len=64, chat=False)
    remote = LLM("memory://tinyllama", dtype="float32", max_model_len=64, chat=False)
    assert remote.fingerprint == local.fingerprint
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    assert remote.generate([[5, 6, 7]], sp)[0].token_ids == local.generate([[5, 6, 7]], sp)[0].token_ids
