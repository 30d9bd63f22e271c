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
