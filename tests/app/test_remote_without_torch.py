"""Remote mode loads none of the local core: a fresh process imports what ``app.py --backend`` imports,
builds the ``RemoteEngine``, the page's Blocks and the HTTP routes (without launching), and says which
modules it loaded. ``tests/test_layering.py`` checks the same on the import graph; this is the proof
by running it.

The import step loads neither torch nor transformers. The tokenizer is a transformers one, and since
transformers 5 its classes import torch themselves; so the build step may load torch, but no module
of this repository that uses it: not the local engine, the pool, the cache, the scheduler or the model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The local core, and its torch-free parts remote mode may load (the packages' __init__ files import nothing).
LOCAL_CORE = ("engine.engine", "engine.tier_setup", "engine.kvcache", "engine.scheduler", "engine.model")
TORCH_FREE = {"engine.kvcache", "engine.kvcache.radix_tree", "engine.kvcache.eviction", "engine.kvcache.chunks", "engine.scheduler",
              "engine.scheduler.config", "engine.model", "engine.model.hub"}

CHILD = """
import json, sys
import app
import components.demo, server.metrics, server.openai_api, server.remote.engine
imported = {name: name in sys.modules for name in ("torch", "transformers")}
from engine.model.hub import load_tokenizer
from server.remote.engine import RemoteEngine
args = app.parse_args(["--backend", "http://127.0.0.1:9", "--isolate"])
engine = RemoteEngine(args.backend, "m", load_tokenizer(args.model), isolation=args.isolate,
                      max_queue=args.max_queue)  # never contacted: nothing is sent in this test
demo = app.build_app(engine, args.max_queue)
routes = app.server_routes(engine)
engine.close()
ours = sorted(m for m in sys.modules if m.split(".")[0] in ("engine", "server", "components", "app"))
print(json.dumps({"imported": imported, "modules": ours, "routes": len(routes)}))
"""


def _is(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_remote_mode_loads_no_torch_model_code():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"})
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["imported"] == {"torch": False, "transformers": False}, report["imported"]
    modules = set(report["modules"])
    assert {"server.remote.engine", "components.demo", "engine.facade"} <= modules  # it did build them
    core = sorted(m for m in modules if _is(m, LOCAL_CORE) and m not in TORCH_FREE)
    assert not core, core
    assert report["routes"] >= 1  # /metrics
