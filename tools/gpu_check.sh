#!/usr/bin/env bash
# The CUDA check, for the day a GPU is lent: the CUDA-marked tests, the prefill bench and the
# serving bench (short and long shared prefix), in bf16, within about 10 minutes. Run from the
# repository root after the README's install (a CUDA build of torch is needed on that machine:
#   pip install torch==2.13.0 --index-url <the CUDA wheel index of your registry>).
# Writes everything to ${OUT:-out}/gpu_check.txt as it goes.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False PYTHONUNBUFFERED=1
out=${OUT:-out}; mkdir -p "$out"; log="$out/gpu_check.txt"; : > "$log"
PY=${PYTHON:-python}
run() { echo "+ $*" | tee -a "$log"; timeout "$1" "${@:2}" 2>&1 | tee -a "$log"; }
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee -a "$log"
run 180 "$PY" -m pytest -q -m cuda tests/engine/test_cuda.py
run 180 "$PY" -m tools.bench --device cuda --dtype bfloat16 --sizes 256,1024,4096,8000 --repeats 3
run 150 "$PY" -m tools.serve_bench --device cuda --dtype bfloat16 --streams 1,8,16 --engines one,batched,hf
run 150 "$PY" -m tools.serve_bench --device cuda --dtype bfloat16 --streams 16 --engines batched,hf --system-tokens 2300
echo "done: $log"
