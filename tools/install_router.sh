#!/usr/bin/env bash
# Install vLLM's router (PyPI's vllm-router, a prebuilt Rust wheel, abi3) into a virtual environment of
# its own: the router that tools/fleet puts in front of several replicas, and that the `fleet` tests drive.
#
# Its own venv, so that its pins (fastapi, uvicorn, aiohttp, ...) never move the app's. No Rust needed.
# Idempotent: a venv whose vllm-router already reports this version is left as it is.
#
# Usage: tools/install_router.sh [VENV]      (default: $RADIX_ROUTER_VENV or .venv-router in the repo root)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${RADIX_ROUTER_VENV:-.venv-router}}
VERSION=0.1.17
PY=${PYTHON:-python3}

installed() {
  [ -x "$VENV/bin/vllm-router" ] &&
    [ "$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-router"))' 2>/dev/null)" = "$VERSION" ]
}

if installed; then
  echo "vllm-router $VERSION already installed in $VENV"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$VENV/bin/python" -m pip install -q "vllm-router==$VERSION"
installed && "$VENV/bin/vllm-router" --help >/dev/null && echo "vllm-router $VERSION installed in $VENV"
