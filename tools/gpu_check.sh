#!/usr/bin/env bash
# The one GPU check (docs/accelerators.md): `pytest -m gpu` (CUDA op parity, whole-model
# greedy vs fp32 reference, CUDA graphs on/off, PD on one device) then
# `dlbatch bench engine --device cuda` on random Llama-3.2-1B-shaped weights, then (when
# `vllm` imports) our engine and vLLM side by side on those weights with the roofline
# (`bench engine --backend vllm`), then one summary. Needs nothing from the network; bounded
# to 11 minutes (pytest 200 s, bench 260 s, vLLM side by side 200 s).
# Exit status: 0 all tests passed and the bench ran, 1 otherwise, 3 no CUDA device.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
OUT="${GPU_CHECK_OUT:-out/gpu_check}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu-check: no CUDA device visible to $PY"; exit 3
fi
"$PY" -c "import torch; print('gpu-check on', torch.cuda.get_device_name(0), '| torch', torch.__version__)"

t0=$(date +%s)
timeout 200 "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider -o addopts="" -rs \
  --junitxml "$OUT/pytest.xml" 2>&1 | tee "$OUT/pytest.log"
test_rc=${PIPESTATUS[0]}
t1=$(date +%s)
timeout 260 "$PY" -m dlbatch.cli bench engine --device cuda --model llama-1b-random --dtype bfloat16 \
  --prefill-lens 2048,8192 --decode-batches 1,32,128 --decode-context 1024 --decode-tokens 64 \
  --repeats 3 --budget-s 40 --json "$OUT/bench_engine.json" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
t2=$(date +%s)
if "$PY" -c "import vllm" >/dev/null 2>&1; then
  timeout 200 "$PY" -m dlbatch.cli bench engine --backend vllm --device cuda --model llama-1b-random --dtype bfloat16 \
    --prefill-lens 2048,8192 --decode-batches 1,32,128 --decode-context 1024 --decode-tokens 64 --repeats 3 \
    --json "$OUT/bench_vllm.json" 2>&1 | tee "$OUT/bench_vllm.log"
  echo "vLLM side by side: rc ${PIPESTATUS[0]} (table above; $OUT/bench_vllm.json)"
else
  echo "vLLM side by side: skipped (vllm does not import in $PY)"
fi

"$PY" - "$OUT" "$test_rc" "$bench_rc" "$((t1 - t0))" "$((t2 - t1))" <<'PYEOF'
import json, os, re, sys
out, test_rc, bench_rc, t_test, t_bench = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
log = open(os.path.join(out, "pytest.log")).read().strip().splitlines()
tail = next((l for l in reversed(log) if re.search(r"passed|failed|skipped|error", l)), "no pytest summary")
print("\n==================== gpu-check summary ====================")
print(f"pytest -m gpu: {tail}  (rc {test_rc}, {t_test} s)")
path = os.path.join(out, "bench_engine.json")
if bench_rc == 0 and os.path.exists(path):
    r = json.load(open(path))
    pct = lambda v: "n/a" if v is None else f"{v:.1%}"
    for p in r.get("prefill", []):
        print(f"prefill {p['tokens']:>5} tokens: MFU {pct(p.get('ours_frac_peak'))}")
    for d in r.get("decode", []):
        print(f"decode batch {d['batch']:>3}: HBM fraction {pct(d.get('ours_frac_bw'))}")
    for k, v in r.items():
        if "overhead" in k:
            print(f"{k}: {v}")
    for t in r.get("targets", []):
        met = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        print(f"target {t['target']}: {t['value']} ({met})")
else:
    print(f"bench engine failed (rc {bench_rc}, {t_bench} s): see {out}/bench.log")
print(f"files: {out}/")
sys.exit(0 if test_rc == 0 and bench_rc == 0 else 1)
PYEOF
