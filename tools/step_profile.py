"""Where a decode step's milliseconds go, and a cold prefill's (issue 48).

    python -m tools.step_profile [--dtype float32] [--rows 1,8,16] [--prefix 2300] [--prefill 2048]
    RADIX_ISA=avx2 python -m tools.step_profile      # the AVX2 build, on an AVX-512 machine too

Loads the embedded model, prefills a shared prefix of ``--prefix`` tokens and behind it one
question of 40 tokens per row, then times a decode step of each row count (the median of 15) and
the same step taken apart, each part called on its own over the same tensors (median of 10):

- ``linears``: the seven linears of every layer (our kernel, the step's shapes);
- ``norms, rotary, SiLU, KV writes``: the rest of the fused layer calls (``pre`` and ``post``);
- ``attention``: the exact kernel over every row's keys (the shared prefix and each row's own);
- ``final norm, LM head``: ``FusedLayers.tail``;
- ``plan``: building the forward's ``ExactPlan`` in Python;
- ``sampler``: greedy choice over the rows' logits;
- ``Python, embedding, rest``: the step less the parts.

Beside the step: its limit (``tools.measure``: the weights and the shared prefix's KV once and each
row's own KV at the read bandwidth, or its FLOPs at the FMA rate, both measured in this run) and the step's multiple of it;
under it issue 48's estimate, the same reading and then the linears' FLOPs at half the FMA rate, one after the other.
With ``--prefill N``: a cold prefill of N tokens in the scheduler's 256-token chunks, its FLOPs
and its share of the FMA rate. The exact forward only (the default on a CPU with our kernels).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from tools.measure import machine_header, machine_limits, model_cost, offline_env

QUESTION = 40


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


class Profile:
    """A runner (the embedded model's, from ``main``), a pool with the shared prefix and one question per row."""

    def __init__(self, runner, prefix: int, rows: int) -> None:
        from engine.kvcache.kv_pool import KVPool
        from engine.model.paged_attention import PagedSegment

        self.runner = r = runner
        if not r.runs_exact:
            raise SystemExit("the exact forward does not run here (RADIX_EXACT=0, no C compiler, or no AVX2)")
        self.pool = KVPool(r.num_layers, r.num_kv_heads, r.head_dim, r.dtype, r.device, 512 * 2**20)
        gen = torch.Generator().manual_seed(0)
        self.prefix = prefix
        ids = torch.randint(100, 20000, (prefix,), generator=gen).tolist()
        self.shared = list(range(prefix))
        for s in range(0, prefix, 256):
            r.forward_paged(self.pool, [PagedSegment(ids[s:s + 256], s, self.shared)])
        self.tables, base = [], prefix
        for _ in range(rows):
            table = self.shared + list(range(base, base + QUESTION + 1))
            base += QUESTION + 1
            question = torch.randint(100, 20000, (QUESTION,), generator=gen).tolist()
            r.forward_paged(self.pool, [PagedSegment(question, prefix, table)])
            self.tables.append(table)

    def step(self, rows: int) -> dict[str, float]:
        """The step of ``rows`` decode rows and its parts, in ms."""
        from engine.model import native_linear
        from engine.model.attention import exact
        from engine.model.paged_attention import PagedSegment

        r, pool = self.runner, self.pool
        stack, fused = r.stack, r.stack.fused
        segments = [PagedSegment([1234], self.prefix + QUESTION, t) for t in self.tables[:rows]]
        out: dict[str, float] = {"step": _median_ms(lambda: r.forward_paged(pool, segments), 15)}
        first = stack.layers[0]
        groups = r.query_groups * r.num_kv_heads

        def plan_call():
            plan = exact.ExactPlan(segments, r.device)
            return plan, plan.call(pool.k[first.index], groups, first.scaling)

        out["plan"] = _median_ms(plan_call, 10)
        plan, call = plan_call()
        emb = stack.embed(torch.tensor([plan.ids]))
        cos, sin = stack.rotary(emb, torch.tensor([plan.positions]))
        cos, sin = cos[0].float().contiguous(), sin[0].float().contiguous()
        h, write = emb[0].float().contiguous(), plan.write_index.contiguous()
        layers = list(enumerate(stack.layers))
        pre = _median_ms(lambda: [fused.pre(i, h, cos, sin, pool.k[m.index], pool.v[m.index], write)
                                  for i, m in layers], 10)
        q = fused.pre(0, h, cos, sin, pool.k[0], pool.v[0], write).to(r.dtype).contiguous()
        out["attention"] = _median_ms(lambda: [call.attend(q, pool.k[m.index], pool.v[m.index]) for _, m in layers],
                                      10)
        a = call.attend(q, pool.k[0], pool.v[0]).contiguous()
        work = h.clone()
        post = _median_ms(lambda: [fused.post(i, work, a) for i, _ in layers], 10)
        kernel = native_linear.kernel()
        mods = [(m.self_attn, m.mlp) for m in r.model.model.layers[: len(layers)]]
        mats = [getattr(part, n).weight.detach() for attn, mlp in mods
                for part, n in ((attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"), (attn, "o_proj"),
                                (mlp, "gate_proj"), (mlp, "up_proj"), (mlp, "down_proj"))]
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in mats}
        out["linears"] = _median_ms(lambda: [kernel.run(xs[w.shape[1]], w, None) for w in mats], 10)
        out["norms, rotary, SiLU, KV writes"] = max(0.0, pre + post - out["linears"])
        out["final norm, LM head"] = _median_ms(lambda: fused.tail.logits(h), 10)
        logits = fused.tail.logits(h).float()
        out["sampler"] = _median_ms(lambda: logits.argmax(-1).tolist(), 10)
        parts = sum(v for k, v in out.items() if k != "step")
        out["Python, embedding, rest"] = max(0.0, out["step"] - parts)
        return out

    def cold_prefill(self, tokens: int) -> float:
        """Seconds for ``tokens`` new tokens from an empty cache, in 256-token chunks (best of 2)."""
        from engine.kvcache.kv_pool import KVPool
        from engine.model.paged_attention import PagedSegment

        r = self.runner
        pool = KVPool(r.num_layers, r.num_kv_heads, r.head_dim, r.dtype, r.device, tokens * r.kv_bytes_per_token)
        slots = pool.alloc(tokens)
        ids = torch.randint(100, 20000, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
        best = float("inf")
        for _ in range(2):
            t = time.perf_counter()
            for s in range(0, tokens, 256):
                r.forward_paged(pool, [PagedSegment(ids[s:s + 256], s, slots)])
            best = min(best, time.perf_counter() - t)
        return best


ORDER = ("linears", "norms, rotary, SiLU, KV writes", "attention", "final norm, LM head", "plan", "sampler",
         "Python, embedding, rest")


def format_table(steps: dict[int, dict[str, float]], limit: dict[int, float],
                 serial: dict[int, float] | None = None) -> str:
    """The parts of each row count's step (``Profile.step``) beside its limit in ms, as markdown, and
    (given) issue 48's serial estimate (``ModelCost.serial_seconds``)."""
    rows = sorted(steps)
    lines = ["| ms per step | " + " | ".join(f"{n} row{'s' * (n > 1)}" for n in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    lines += [f"| {part} | " + " | ".join(f"{steps[n][part]:.1f}" for n in rows) + " |" for part in ORDER]
    lines.append("| **step** | " + " | ".join(f"**{steps[n]['step']:.1f}**" for n in rows) + " |")
    lines.append("| limit (its multiple) | " + " | ".join(f"{limit[n]:.1f} ({steps[n]['step'] / limit[n]:.2f}x)"
                                                         for n in rows) + " |")
    if serial:
        lines.append("| read, then linears at half the FMA rate (its multiple) | " + " | ".join(
            f"{serial[n]:.1f} ({steps[n]['step'] / serial[n]:.2f}x)" for n in rows) + " |")
    lines.append("| tokens/s | " + " | ".join(f"{n / steps[n]['step'] * 1e3:.1f}" for n in rows) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--rows", default="1,8,16", help="decode rows per step, comma-separated")
    p.add_argument("--prefix", type=int, default=2300, help="tokens of the shared prefix")
    p.add_argument("--prefill", type=int, default=0, help="also time a cold prefill of this many tokens")
    args = p.parse_args(argv)
    offline_env()
    rows = sorted({int(x) for x in args.rows.split(",")})
    if not rows or rows[0] < 1:
        p.error("--rows takes positive counts")
    limits = machine_limits()
    print(machine_header(limits))
    from engine.model.loader import load_model
    from engine.model.runner import ModelRunner

    prof = Profile(ModelRunner(load_model(dtype=args.dtype)), args.prefix, rows[-1])
    r = prof.runner
    cost = model_cost(r.model, r.kv_bytes_per_token, r.num_layers, r.query_groups * r.num_kv_heads, r.head_dim)
    steps = {n: prof.step(n) for n in rows}
    limit = {n: cost.step_seconds(n, args.prefix + QUESTION + 1, limits, args.prefix) * 1e3 for n in rows}
    print(f"\n{r.forward_kind}; {args.dtype}; each row behind {args.prefix:,} shared tokens and {QUESTION} of its own\n")
    serial = {n: cost.serial_seconds(n, args.prefix + QUESTION + 1, limits, args.prefix) * 1e3 for n in rows}
    print(format_table(steps, limit, serial))
    if args.prefill:
        seconds = prof.cold_prefill(args.prefill)
        n = args.prefill
        flops = n * (cost.flops_per_token - 2 * r.model.get_output_embeddings().weight.numel()) \
            + n * (n + 1) // 2 * cost.attention_flops_per_context_token
        print(f"\nCold prefill of {n:,} tokens (256-token chunks, best of 2): {seconds:.2f} s, "
              f"{flops / seconds / 1e9:.0f} GFLOP/s = {flops / seconds / limits.flops_per_s:.0%} of the FMA rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
