"""An engine on the CPU keeps freed activation memory in the process (glibc mallopt,
dlbatch/engine/device.py: keep_freed_memory): prefills page-fault far less than with malloc
left alone (DLBATCH_MALLOPT=0), with the same tokens."""
import json
import os
import subprocess
import sys

import pytest

from dlbatch.engine.device import keep_freed_memory

SCRIPT = r"""
import json, resource, sys
import torch
from dlbatch.engine.device import keep_freed_memory
from dlbatch.engine.llm import LLM
from dlbatch.engine.sampling_params import SamplingParams
llm = LLM(sys.argv[1], dtype="float32", max_model_len=1200, chat=False, num_kv_blocks=200, num_threads=1)
sp = SamplingParams(max_tokens=3, ignore_eos=True)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(5, 40000, (n,), generator=g).tolist() for n in (400, 1000, 900, 1100)]
llm.generate([prompts[0]], sp)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
out = [o.token_ids for o in llm.generate(prompts[1:], sp)]
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0, "tokens": out,
                  "kept": keep_freed_memory()}))
"""


def _run(model, setting):
    env = {**os.environ, "DLBATCH_MALLOPT": setting}
    out = subprocess.run([sys.executable, "-c", SCRIPT, model], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not keep_freed_memory(), reason="not glibc (or DLBATCH_MALLOPT=0): malloc is left alone")
def test_engine_keeps_freed_memory_and_faults_less(sample_model):
    kept, alone = _run(sample_model, "1"), _run(sample_model, "0")
    assert kept["kept"] and not alone["kept"]
    assert kept["tokens"] == alone["tokens"]
    assert kept["faults"] * 4 < alone["faults"], (kept["faults"], alone["faults"])


def test_prefault_backs_every_page_of_the_kv_cache_and_keeps_its_bytes(tmp_path):
    """The benches' prefault (ModelRunner.prefault_kv_cache) page-faults the lazily mapped
    cache in once, and changes no byte of what the engine already wrote there."""
    import resource

    import torch

    from dlbatch.engine.llm import LLM
    from dlbatch.engine.sampling_params import SamplingParams
    from tests.helpers.tiny_models import make_tiny_model

    path = str(tmp_path / "m")
    make_tiny_model("llama", path)
    llm = LLM(path, dtype="float32", max_model_len=256, chat=False, num_kv_blocks=8192)
    runner = llm.engine.runner
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    want = [o.token_ids for o in llm.generate([[5, 6, 7, 8] * 20], sp)]
    before = runner.kv_cache.clone()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    nbytes = runner.prefault_kv_cache()
    f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    runner.prefault_kv_cache()
    f2 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert nbytes == runner.kv_cache.numel() * 4 and nbytes >= 64 << 20
    assert torch.equal(runner.kv_cache, before)
    assert f1 - f0 >= nbytes // (4 << 20), (f1 - f0, nbytes)  # at least one fault per 2 MiB huge page, half used
    assert f2 - f1 < (f1 - f0) / 4, (f1 - f0, f2 - f1)  # the second pass finds the pages there
    assert [o.token_ids for o in llm.generate([[5, 6, 7, 8] * 20], sp)] == want
