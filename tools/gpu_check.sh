#!/usr/bin/env bash
# The GPU check: one command on a lent device machine (docs/GPU.md), under 8 minutes, that writes
# $OUT/gpu_check.md (the table), $OUT/results.json (the raw rows) and $OUT/gpu_check.log.
#
#   tools/gpu_check.sh             # on the device: CUDA, bf16, random-weights models of the embedded
#                                  # shape and a 1B-class shape, built there (no weights travel)
#   tools/gpu_check.sh --rehearse  # here: the same steps on CPU at small sizes, in a fresh venv with
#                                  # the device's transformers (5.17.0) and none of its missing packages
#
# Needs .gpu/tokenizer (the embedded tokenizer's files): `python -m tools.gpu_check prepare` writes it
# here (the rehearsal does so first), and the device call carries .gpu. Every step has its own time
# limit, cut to what is left of the whole budget (GPU_CHECK_BUDGET_S); a failing step is marked in
# the table and the next one runs.
#
# The rehearsal's torch is this machine's offline wheel, 2.13.0+cpu for Python 3.11 (REHEARSE_PYTHON):
# it keeps the rehearsal small; torch 2.11 on Python 3.12 (pyenv) is the Space line's, tested by .ci/run.
# transformers, the piece whose line changes the engine's calls, is the device's exact version.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=device
case "${1:-}" in
  --rehearse) mode=rehearse ;;
  --rehearse-venv) mode=venv ;;
  "") ;;
  *) echo "usage: tools/gpu_check.sh [--rehearse | --rehearse-venv]" >&2; exit 2 ;;
esac

# The rehearsal's venv: the device's packages at its versions where this machine has them, nothing
# else. Made once (CI makes it at install time: --rehearse-venv) and reused while it holds 5.17.0.
venv=${GPU_CHECK_VENV:-/tmp/radix-gpu-rehearse-venv}
make_venv() {
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c \
      "import transformers, torch, sys; sys.exit(transformers.__version__ != '5.17.0')" 2>/dev/null; then
    echo "rehearsal venv ready: $venv"
    return 0
  fi
  rm -rf "$venv" && ${REHEARSE_PYTHON:-python3.11} -m venv "$venv" && "$venv/bin/pip" install -q \
    torch==2.13.0 transformers==5.17.0 tokenizers==0.23.2 huggingface_hub==1.33.0 safetensors==0.8.0 \
    accelerate==1.15.0 numpy jinja2 pytest hypothesis httpx prometheus-client msgpack psutil tqdm
}
if [ "$mode" = venv ]; then
  make_venv
  exit $?
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false RADIX_TOKENIZER_DIR="$PWD/.gpu/tokenizer"
out=${OUT:-out/gpu_check_$mode}
mkdir -p "$out"
log="$out/gpu_check.log"
: > "$log"
work=$(mktemp -d /tmp/radix-gpu-check.XXXXXX)
trap 'rm -rf "$work"' EXIT
start=$SECONDS

# step NAME LIMIT_S COMMAND...: run it under its limit (cut to the budget left), log it, record its exit.
step() {
  local name=$1 limit=$2 left rc t0
  shift 2
  left=$((budget_s - (SECONDS - start)))
  if ((left < 15)); then
    echo "=== $name: skipped, ${left}s of the budget left" | tee -a "$log"
    printf '%s\t125\t0\n' "$name" >>"$work/steps.tsv"
    return
  fi
  ((limit > left)) && limit=$left
  echo "=== $name (limit ${limit}s, $((SECONDS - start))s in): $*" | tee -a "$log"
  t0=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$work/steps.tsv"
  echo "=== $name: exit $rc after $((SECONDS - t0))s" | tee -a "$log"
}

if [ "$mode" = rehearse ]; then
  budget_s=${GPU_CHECK_BUDGET_S:-900}
  step prepare 120 "${PYTHON:-python3}" -m tools.gpu_check prepare
  export -f make_venv
  export venv
  step venv 400 bash -c make_venv
  PY=$venv/bin/python
  dev=cpu dtype=float32
  sizes=256,1024 repeats=1 greedy=4 turn_tokens=8
  serve=(--streams 1,8 --requests 8 --max-new-tokens 8 --system-tokens 256 --max-batch 8 --budget-mb 256)
  shapes=(embedded)
else
  budget_s=${GPU_CHECK_BUDGET_S:-450}
  PY=${PYTHON:-python3}
  [ -f .gpu/tokenizer/tokenizer_config.json ] || {
    echo "no .gpu/tokenizer: run 'python -m tools.gpu_check prepare' where the embedded model is, carry .gpu" | tee -a "$log"
    exit 1
  }
  if compgen -G ".gpu/wheels/*.whl" >/dev/null; then  # tools.gpu_check.WHEELS (none today)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" .gpu/wheels/*.whl
    export PYTHONPATH="$work/site"
  fi
  dev=cuda dtype=bfloat16
  sizes=256,1024,4096,8000 repeats=3 greedy=16 turn_tokens=96
  serve=(--streams 1,8,64 --requests 64 --max-new-tokens 32 --system-tokens 2048 --max-batch 64 --budget-mb 1024)
  shapes=(embedded 1b)
fi

step env 60 "$PY" -m tools.gpu_check env --work "$work" --mode "$mode"
step imports 60 "$PY" -m tools.gpu_check imports
step cuda_tests 150 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/engine/test_cuda.py --junitxml="$work/cuda_tests.xml"
step engine_tests 150 "$PY" -m pytest -q -p no:cacheprovider tests/engine/test_exact_reuse.py \
  tests/engine/test_transformers_lines.py tests/engine/test_decoder_stack.py --junitxml="$work/engine_tests.xml"
for shape in "${shapes[@]}"; do
  model="$work/model_$shape"
  step "model_$shape" 150 "$PY" -m tools.gpu_check model --shape "$shape" --out "$model" --device "$dev"
  step "bench_$shape" 150 "$PY" -m tools.bench --model "$model" --device "$dev" --dtype "$dtype" --sizes "$sizes" \
    --repeats "$repeats" --greedy-tokens "$greedy" --json "$work/bench_$shape.json"
  step "serve_$shape" 180 "$PY" -m tools.serve_bench --model "$model" --device "$dev" --dtype "$dtype" \
    --engines batched "${serve[@]}" --json "$work/serve_$shape.json"
  # ZeroGPU: a visitor turn's call body (engine/zerogpu/turn_call.py) on this device, against the plain engine.
  step "zerogpu_turn_$shape" 90 "$PY" -m tools.gpu_check zerogpu-turn --model "$model" --device "$dev" \
    --dtype "$dtype" --new-tokens "$turn_tokens" --json "$work/zerogpu_turn_$shape.json"
  [ "$shape" = embedded ] || rm -rf "$model"
done
if [ "$mode" = device ]; then  # ZeroGPU's model, SmolLM2-1.7B's shape: a visitor turn's call body on this GPU
  model="$work/model_1.7b"
  step model_1.7b 120 "$PY" -m tools.gpu_check model --shape 1.7b --out "$model" --device "$dev"
  step zerogpu_turn_1.7b 90 "$PY" -m tools.gpu_check zerogpu-turn --model "$model" --device "$dev" \
    --dtype "$dtype" --new-tokens "$turn_tokens" --json "$work/zerogpu_turn_1.7b.json"
  rm -rf "$model"
fi
# transformers' generate_batch on the same workload, last: a peer that hangs costs only its own row.
step serve_embedded_hf 120 "$PY" -m tools.serve_bench --model "$work/model_embedded" --device "$dev" --dtype "$dtype" \
  --engines hf "${serve[@]}" --json "$work/serve_embedded_hf.json"
"${PYTHON:-python3}" -m tools.gpu_check table --work "$work" --out "$out/gpu_check.md" 2>&1 | tee -a "$log"
echo "done in $((SECONDS - start))s: $out/gpu_check.md, $out/results.json, $log" | tee -a "$log"
