"""Attention over KV that lives in the pool, reading a shared prefix once per step.

Owns: the plan of one packed forward over pool slots (which new token writes
which slot, which requests share a prefix segment) and the attention of one
layer under that plan. Knows nothing about the tree or the scheduler: it is
handed, per request, its new token ids, how many tokens it already holds and
the slot of every position.

One request's context, in token positions, split in two segments::

    positions:  [0 ......... P) [P ............. past) [past .. past+n)
    segment:     shared (view)   rest: own or unshared   the new tokens (part of rest)

- **Shared**: the leading runs of slots, capped at ``past`` (fully visible to
  every new token). Requests whose prefixes lie in the same slots read the
  same KV (a cached system prompt): all their queries attend to it in ONE call
  per run, so the prefix is read once per layer per step whatever the batch
  size (cascade attention, as in vLLM and FlashInfer; Hydragen). A prefix the
  tree built in pieces (the template's first tokens in another prompt's node, a
  prompt extending a cached one) is several runs; each is read in place and
  the partial results merge like the two segments below.
- **Rest**: everything after ``P``, including the new tokens, causal among the
  new ones. Requests decoding one token are batched into one call over their
  rests (gathered and padded: rests are short); prefill chunks take one each.

The partial results (the rest, and each run of the shared prefix) merge exactly by their
log-sum-exps, all in one pass: ``m = max_i l_i``, ``out = sum_i o_i e^(l_i-m) / sum_i e^(l_i-m)``.

Grouped-query heads: query head ``h`` reads KV head ``h // g`` (``g`` query
heads per KV head, as transformers' ``repeat_kv`` lays them out). Instead of
repeating K and V ``g`` times, the ``g`` query heads of each KV head are folded
into the query length: ``[1, Hq, n, D] -> [1, Hkv, g*n, D]``; every folded row
attends to the same keys, so one call over ``Hkv`` heads does the work.

Each call over one segment goes to the runner's attention backend
(``engine.model.attention``, chosen once at start: PyTorch's flash kernel on a CPU,
a float32 matmul-softmax within a fixed workspace elsewhere), which returns the
values and their log-sum-exp. A prefill chunk's causal rule goes to it as a rule
(``Causal``), never as a dense mask repeated over the folded heads; under a backend
that caps its workspace, decode rows are read in calls whose gathered KV fits the cap.

Out of device memory inside attention, the forward fails with ``OutOfMemoryFault``
(an ``EngineFault``); the scheduler then runs its rows one by one, and only a row that
fails alone fails (``engine.scheduler.batch.forward``). Attention writes nothing:
the new tokens' KV went to their own slots before, and shared slots are only read,
so the cache is as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.model.attention import AttentionBackend, Causal, choose_backend
from engine.types import OutOfMemoryFault

SHARED_MIN_TOKENS = 16  # a shorter common prefix is not worth a call of its own
# A shared prefix is read run by run (views of the pool, merged by log-sum-exp), so a prefix the
# tree built in pieces (a long system prompt that extends a shorter cached one, a chat's turns)
# is still read once per step for all; past this many runs the rest is gathered per row.
SHARED_MAX_RUNS = 8


@dataclass
class PagedSegment:
    """One request's part of a packed forward: ``ids`` run after the ``past`` tokens it
    holds; ``slots[i]`` is the pool slot of position ``i`` (at least ``past + len(ids)``
    entries: the new tokens' KV is written to ``slots[past:past + len(ids)]``).
    ``runs`` are ``contiguous_runs(slots)`` if the caller has them (else computed)."""

    ids: Sequence[int]
    past: int
    slots: Sequence[int]
    runs: Sequence[tuple[int, int, int]] | None = None


def merge(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> torch.Tensor:
    """Combine attentions of the same queries over disjoint key sets, all at once (float32).
    ``outs[i]`` [..., M, D], ``lses[i]`` [..., M]; a part may have ``lse = -inf`` (no keys
    there), but not every part. One pass over all parts: fewer small ops than merging pairwise."""
    stacked = torch.stack(list(lses))
    w = torch.exp(stacked - stacked.amax(0)).unsqueeze(-1)
    total = outs[0].float() * w[0]
    for i in range(1, len(outs)):
        total += outs[i].float() * w[i]
    return total / w.sum(0)


def leading_runs(runs: Sequence[tuple[int, int, int]], cap: int) -> tuple[tuple[int, int], ...]:
    """The runs ``(first slot, length)`` of positions ``0..cap-1``, at most ``SHARED_MAX_RUNS``
    (``runs`` are ``contiguous_runs`` triples, in position order)."""
    out = []
    for start, first, length in runs:
        if start >= cap or len(out) == SHARED_MAX_RUNS:
            break
        out.append((first, min(length, cap - start)))
    return tuple(out)


def group_key(runs: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """Requests share a group when their prefixes start in the same slots up to the first run of
    at least ``SHARED_MIN_TOKENS``: the first slot of each run to there. (The first slot alone is
    not enough: every chat prompt begins with the template's few tokens, which may lie in some
    other prompt's node, and two different system prompts would then share only those.)"""
    key = []
    for first, length in runs:
        key.append(first)
        if length >= SHARED_MIN_TOKENS:
            break
    return tuple(key)


def common_runs(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The runs two requests share from position 0: equal runs, then the common part of the
    first pair that starts at the same slot but ends apart."""
    out = []
    for (fa, na), (fb, nb) in zip(a, b, strict=False):
        if fa != fb:
            break
        out.append((fa, min(na, nb)))
        if na != nb:
            break
    return tuple(out)


def packed(segs: Sequence[PagedSegment], device: torch.device) -> tuple[list[int], list[int], list[int], torch.Tensor]:
    """Segments packed in this order into one sequence: each one's length, the token ids, their
    positions, and the pool slot each new token's KV goes to (``write_index``)."""
    lens = [len(s.ids) for s in segs]
    ids = [t for s in segs for t in s.ids]
    positions = [p for s in segs for p in range(s.past, s.past + len(s.ids))]
    write_index = torch.tensor([slot for s in segs for slot in s.slots[s.past:s.past + len(s.ids)]],
                               dtype=torch.long, device=device)
    return lens, ids, positions, write_index


class _Rest:
    """One prefill chunk's rest segment: a view ``(first_slot, length)`` or a gather index."""

    def __init__(self, view: tuple[int, int] | None, index: torch.Tensor | None, causal: Causal) -> None:
        self.view, self.index, self.causal = view, index, causal

    def kv(self, k_layer: torch.Tensor, v_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.view is not None:
            a, n = self.view
            return k_layer[:, a:a + n].unsqueeze(0), v_layer[:, a:a + n].unsqueeze(0)
        return k_layer.index_select(1, self.index).unsqueeze(0), v_layer.index_select(1, self.index).unsqueeze(0)


class _DecodeCall:
    """Decode rows read in one call: their pack positions, their rests' slots padded to the
    widest (``index``, ``[rows * width]``) and the padding's additive mask (None if none)."""

    def __init__(self, pos: list[int], rows: list[list[int]], lens: list[int], device: torch.device) -> None:
        self.width = width = max(lens)
        self.pos = torch.tensor(pos, dtype=torch.long, device=device)
        pad = [row + [row[-1]] * (width - len(row)) for row in rows]
        self.index = torch.tensor(pad, dtype=torch.long, device=device).view(-1)
        mask = torch.zeros((len(pos), width), device=device)
        mask.masked_fill_(torch.arange(width, device=device)[None, :] >= torch.tensor(lens, device=device)[:, None],
                          float("-inf"))
        self.mask = mask.view(len(pos), 1, 1, width) if width > min(lens) else None


class PagedPlan:
    """What one packed forward needs per layer, built once before the layers run.

    ``order`` is the permutation applied to the caller's segments (group members are packed
    next to each other, so a group's queries are one slice of the pack); logits come out in
    pack order and the runner puts them back. ``backend`` is the runner's attention backend
    (by default the one ``choose_backend`` picks for ``device``)."""

    def __init__(self, segments: Sequence[PagedSegment], device: torch.device,
                 backend: AttentionBackend | None = None, own_rows: bool = False) -> None:
        from engine.kvcache.kv_pool import contiguous_runs

        self.device = device
        self.backend = backend if backend is not None else choose_backend(device)
        heads = []  # per segment: the runs (first slot, length) of its first ``past`` positions
        every = []  # per segment: its runs as contiguous_runs triples
        for s in segments:
            runs = s.runs if s.runs is not None else contiguous_runs(s.slots[: s.past + len(s.ids)])
            every.append(runs)
            heads.append(leading_runs(runs, s.past))
        by_first: dict[tuple[int, ...], list[int]] = {}
        for i, runs in enumerate(heads):
            if runs and sum(n for _, n in runs) >= SHARED_MIN_TOKENS:
                by_first.setdefault(group_key(runs), []).append(i)
        # Own rows (``own_rows``: the backend reads a decode row's runs of the pool in place, see
        # ``AttentionBackend.attend_rows``): every decode row's rest is read that way, in one call
        # for all of them, instead of gathered and padded; and a decode row that shares its prefix
        # with no other row of the pack is read whole, with nothing to merge.
        lone: set[int] = set()
        if own_rows:
            grouped_with = {i: len(members) for members in by_first.values() for i in members}
            lone = {i for i, s in enumerate(segments) if len(s.ids) == 1 and grouped_with.get(i, 1) == 1}
            by_first = {key: members for key, members in by_first.items() if not set(members) <= lone}
        # Pack group by group (decode rows first inside a group), then the rest.
        order: list[int] = []
        self.groups: list[tuple[int, int, tuple[tuple[int, int], ...]]] = []  # (pack start, pack end, shared runs)
        shared_len = [0] * len(segments)
        pos = 0
        for members in by_first.values():
            members.sort(key=lambda i: (len(segments[i].ids) > 1, i))
            common = heads[members[0]]
            for i in members[1:]:
                common = common_runs(common, heads[i])
            length = sum(n for _, n in common)
            start = pos
            for i in members:
                order.append(i)
                shared_len[i] = length
                pos += len(segments[i].ids)
            self.groups.append((start, pos, common))
        grouped = set(order)
        order += [i for i in range(len(segments)) if i not in grouped]
        self.order = order
        segs = [segments[i] for i in order]
        self.lens, self.ids, self.positions, self.write_index = packed(segs, device)
        self.total = len(self.ids)
        # Rest segments: decode rows batched (padded gather, ``decode_calls``), prefill chunks one by one.
        dec_pos, dec_index, dec_len, self.prefill_rests = [], [], [], []
        pos = 0
        own: list[tuple[int, list[tuple[int, int]]]] = []  # (pack position, runs) of rows read in place
        for i, s in zip(order, segs, strict=True):
            n, start = len(s.ids), shared_len[i]
            if own_rows and n == 1:
                cap = s.past + 1  # a lone row from position 0 (start is 0), the others after their prefix
                runs = [(first + max(0, start - at), min(length, cap - at) - max(0, start - at))
                        for at, first, length in every[i] if at < cap and at + length > start]
                own.append((pos, runs))
                pos += n
                continue
            rest = list(s.slots[start:s.past + n])
            if n == 1:
                dec_pos.append(pos)
                dec_index.append(rest)
                dec_len.append(len(rest))
            else:
                runs = contiguous_runs(rest)
                view = (runs[0][1], len(rest)) if len(runs) == 1 else None
                index = None if view else torch.tensor(rest, dtype=torch.long, device=device)
                causal = Causal(q_start=s.past, k_start=start, period=n, length=len(rest), device=device)
                self.prefill_rests.append((pos, n, _Rest(view, index, causal)))
            pos += n
        self.own_rows = self.backend.cut_rows(own) if own else None
        self._decode_rows = (dec_pos, dec_index, dec_len)
        self.decode_width = max(dec_len, default=0)
        # The decode rows' gathered KV is [rows, width] tokens: one call for all of them, unless the
        # backend caps its workspace, then calls of at most that many bytes (sized at the first layer).
        self._decode_calls: list[_DecodeCall] | None = None if self.backend.workspace_cap_bytes is not None else (
            [_DecodeCall(dec_pos, dec_index, dec_len, device)] if dec_pos else [])

    def decode_calls(self, token_bytes: int) -> list[_DecodeCall]:
        """The decode rows in calls whose gathered KV (``token_bytes`` per token) fits the
        backend's workspace cap (at least one row per call), in pack order."""
        if self._decode_calls is None:
            cap = self.backend.workspace_cap_bytes or 0
            pos, rows, lens = self._decode_rows
            calls, start, widest = [], 0, 0
            for i, n in enumerate(lens):
                if i > start and (i + 1 - start) * max(widest, n) * token_bytes > cap:
                    calls.append(_DecodeCall(pos[start:i], rows[start:i], lens[start:i], self.device))
                    start, widest = i, 0
                widest = max(widest, n)
            if pos:
                calls.append(_DecodeCall(pos[start:], rows[start:], lens[start:], self.device))
            self._decode_calls = calls
        return self._decode_calls

    def rows_call(self, k_layer: torch.Tensor, q_heads: int, scale: float) -> object | None:
        """Where every row of this plan is a decode row the backend reads in place (one stream,
        or streams that share no prefix) and the backend offers it: its attention for C code to
        call once per layer (``native.LayerCall``; the pool layers shaped like ``k_layer``), which
        computes what ``attention`` computes. Else None."""
        make = getattr(self.backend, "layer_call", None)
        if (make is None or self.own_rows is None or self.groups or self.prefill_rests or self._decode_rows[0]
                or self.total != len(self._decode_rows[0]) + self.own_rows[0].shape[0]):
            return None
        return make(k_layer, self.own_rows, q_heads, scale)

    def attention(self, k_layer: torch.Tensor, v_layer: torch.Tensor, query: torch.Tensor,
                  scale: float) -> torch.Tensor:
        """Attention of the pack's queries ``[1, Hq, T, D]`` under this plan, after the new
        tokens' KV was written to the pool layer ``k_layer``/``v_layer`` [Hkv, S, D].
        Returns ``[1, T, Hq, D]`` (what transformers' attention functions return). Raises
        ``EngineFault`` when the device runs out of memory (module docstring)."""
        try:
            return self._attention(k_layer, v_layer, query, scale)
        except torch.OutOfMemoryError:
            pass  # raised below, outside this block: the failed call's tensors are not kept alive
        cap = self.backend.workspace_cap_bytes
        bound = f"workspace at most {cap >> 20} MiB" if cap is not None else "workspace not capped"
        raise OutOfMemoryFault(f"out of {self.device.type} memory in attention ({self.backend.name}, {bound}) over "
                          f"{self.total} tokens (the cache is unchanged)")

    def _attention(self, k_layer: torch.Tensor, v_layer: torch.Tensor, query: torch.Tensor,
                   scale: float) -> torch.Tensor:
        attend = self.backend.attend
        _, hq, total, d = query.shape
        hkv = k_layer.shape[0]
        g = hq // hkv
        q = query[0]  # [Hq, T, D]
        out = torch.empty((hq, total, d), dtype=torch.float32, device=query.device)
        lse = torch.empty((hq, total), dtype=torch.float32, device=query.device)
        if self.own_rows is not None:
            self.backend.attend_rows(q, k_layer, v_layer, self.own_rows, scale, out, lse)
        # Rest segments first: every token has one.
        for call in self.decode_calls(2 * hkv * d * k_layer.element_size()):
            b, width = call.pos.numel(), call.width
            qd = q.index_select(1, call.pos).permute(1, 0, 2).reshape(b, hkv, g, d)
            kd = k_layer.index_select(1, call.index).view(hkv, b, width, d).permute(1, 0, 2, 3)
            vd = v_layer.index_select(1, call.index).view(hkv, b, width, d).permute(1, 0, 2, 3)
            od, ld = attend(qd, kd, vd, scale, mask=call.mask)
            out.index_copy_(1, call.pos, od.reshape(b, hq, d).permute(1, 0, 2).float())
            lse.index_copy_(1, call.pos, ld.reshape(b, hq).t())
        for pos, n, rest in self.prefill_rests:
            kr, vr = rest.kv(k_layer, v_layer)
            qr = q[:, pos:pos + n].reshape(1, hkv, g * n, d)
            orr, lr = attend(qr, kr, vr, scale, causal=rest.causal)
            out[:, pos:pos + n] = orr.reshape(hq, n, d)
            lse[:, pos:pos + n] = lr.reshape(hq, n)
        # Shared segments: per group, one call per run of the shared prefix over all its members' queries.
        for start, end, runs in self.groups:
            n = end - start
            if self.backend.merge_prefix(q[:, start:end], k_layer, v_layer, runs, scale, out[:, start:end],
                                         lse[:, start:end]):
                continue
            qs = q[:, start:end].reshape(1, hkv, g * n, d)
            outs, lses = [out[:, start:end]], [lse[:, start:end]]
            for first, length in runs:
                ks = k_layer[:, first:first + length].unsqueeze(0)
                vs = v_layer[:, first:first + length].unsqueeze(0)
                os_, ls = attend(qs, ks, vs, scale)
                outs.append(os_.reshape(hq, n, d))
                lses.append(ls.reshape(hq, n))
            out[:, start:end] = merge(outs, lses)
        return out.to(query.dtype).transpose(0, 1).unsqueeze(0)
