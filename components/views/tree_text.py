"""The tree's words: what a mark's hover says and the label drawn beside it.

Owns: the hover text of a mark (tokens, reuse, who owns it, when it was last used, what the
second tier holds, a gist of the text) and of a group mark, the short label, and the gist (chat
markers dropped). Pure: a ``VisualNode`` in, text out; ``tree_figures`` places it.
"""

from __future__ import annotations

import html
import re

from analysis.prefill_timing import GROWTH_NAMESPACE
from components.views.format import fmt_ago, fmt_bytes
from components.views.tree_marks import COMPUTED, REUSED, VisualNode
from engine.snapshot_view import is_own


def tier_words(tier_kind: str) -> str:
    """How a spilled node's place reads: "in the second tier (disk)"."""
    return f"in the second tier ({tier_kind})" if tier_kind else "in the second tier"


_SPECIAL = re.compile(r"<\|[^|<>]{1,40}\|>")  # chat-template markers such as <|im_start|>


MEASURING = ("the app's own measurement of how the win grows (Latency tab): filler text, cleared when the "
             "measurement ends")


def _owner(m: VisualNode, viewer_owns: str | None) -> str:
    if m.hidden:
        return "another visitor's (text hidden)"
    if m.namespace == "":
        return "shared"
    if m.namespace == GROWTH_NAMESPACE:
        return MEASURING
    if viewer_owns and is_own(viewer_owns, m.namespace):
        sub = m.namespace[len(viewer_owns) + 1:]
        return f"yours ({html.escape(sub)})" if sub else "yours"
    return f"namespace {html.escape(m.namespace)}"


def hover_text(m: VisualNode, viewer_owns: str | None, tier_kind: str = "") -> str:
    if m.grouped_nodes:
        return group_hover_text(m)
    lines = [f"<b>{m.num_tokens:,} tokens</b> · {fmt_bytes(m.num_bytes)} · prefix {m.start_tokens:,}–"
             f"{m.end_tokens:,}"]
    if not m.hidden:  # other visitors' nodes may carry no hits, times or locks at all
        lines.append(f"hits {m.hits:,} · last used {fmt_ago(m.last_access_s_ago)} · "
                     + (f"<b>read now</b> by {m.lock_ref} running request(s) (locked)" if m.lock_ref else "unlocked"))
    elif m.lock_ref:
        lines.append(f"<b>read now</b> by {m.lock_ref} running request(s) (locked)")
    lines.append(_owner(m, viewer_owns))
    if m.spilled:
        lines.append(f"<b>{tier_words(tier_kind)}</b>, not in memory: a request that needs it loads it back "
                     "instead of recomputing it (whole chunks)")
    if len(m.member_ids) > 1:
        lines.append(f"{len(m.member_ids)} nodes in a chain, drawn as one")
    if m.status:
        lines.append({REUSED: "your last request was <b>served</b> from here",
                      COMPUTED: "your last request <b>computed</b> this"}[m.status])
    if not m.hidden and m.text:
        lines.append("<i>" + _wrap(m.text) + "</i>")
    return "<br>".join(lines)


def group_hover_text(m: VisualNode) -> str:
    """What a folded mark holds: nodes, tokens, bytes, where it starts and ends."""
    branches = f"{m.grouped_branches:,} branches" if m.grouped_branches > 1 else "one branch"
    return "<br>".join([
        f"<b>{m.grouped_nodes:,} nodes · {m.grouped_tokens:,} tokens</b> folded into one mark to keep the view "
        "readable", f"{branches} from prefix {m.start_tokens:,}, reaching {m.end_tokens:,} · {fmt_bytes(m.num_bytes)}",
        "all another visitor's (text hidden)" if m.hidden else
        f"hits {m.hits:,} · last used {fmt_ago(m.last_access_s_ago)}" + (" · some <b>locked</b>" if m.lock_ref else "")])


def _wrap(text: str, width: int = 64, max_lines: int = 6) -> str:
    """Escaped, wrapped text for a hover box (plotly reads a small HTML subset)."""
    text = text.replace("\r", "").replace("\t", " ")
    out: list[str] = []
    for para in text.split("\n"):
        while para and len(out) < max_lines:
            out.append(para[:width])
            para = para[width:]
        if len(out) >= max_lines:
            break
    shown = "\n".join(out)
    more = "…" if len(shown) < len(text.rstrip("\n")) else ""
    return html.escape(shown).replace("\n", "<br>") + more


def mark_label(m: VisualNode, width: int = 22) -> str:
    if m.grouped_nodes:
        return f"+{m.grouped_nodes:,} nodes · {_fmt_tokens(m.grouped_tokens)}"
    if m.hidden:
        return "(private)"
    if m.namespace == GROWTH_NAMESPACE:  # filler text: say what it is for instead
        return f"{m.num_tokens:,} tok · measuring (cleared soon)"
    text = _gist(m.text)
    return f"{m.num_tokens:,} tok · " + html.escape(text[:width] + ("…" if len(text) > width else ""))


def _fmt_tokens(n: int) -> str:
    return f"{n / 1000:.1f}k tok" if n >= 10_000 else f"{n:,} tok"


def _gist(text: str) -> str:
    """The first substantial run of text between chat-template markers, "role: text" style:
    a node that starts with the tail of an earlier turn is labelled by what it adds."""
    segments = [seg.strip() for seg in _SPECIAL.split(text) if seg.strip()]
    seg = next((s for s in segments if len(s) >= 12), " ".join(segments))
    role, sep, rest = seg.partition("\n")
    if sep and role.isalpha() and len(role) <= 12:
        seg = f"{role}: {rest}"
    return " ".join(seg.split())


# ---------------------------------------------------------------- plain data
