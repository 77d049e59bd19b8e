"""Live refresh for panels that follow the shared engine (tree, numbers, charts).

Owns: the ``LiveView`` a panel hands back (its timer and refresh function, so
``components.demo`` can also fire it on page load and tab select, and pause
the timers of hidden tabs), a cheap signature of the engine's state (so a tick
that would redraw the same picture sends nothing), one tree snapshot per tick
shared by every visitor (each visitor's view derived from it, with no second
walk of the tree), and the page script that keeps a visitor's zoom across
redraws and hides tree labels that would collide on a plot narrower than they
were placed for (``KEEP_ZOOM_JS``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import gradio as gr

from components.panels.engine_state import engine_state
from engine.api import EngineAPI, FiguresAPI
from engine.snapshot_view import for_viewer, namespaces_of, owns_any
from engine.types import TreeSnapshot
from engine.visibility import Figure, Unit, everyone, shipped

log = logging.getLogger(__name__)

FORCE_REDRAW_S = 15.0  # redraw at least this often, so "last used 3 s ago" does not go stale
KEEP_ZOOM = "keep-zoom"  # elem_classes of a gr.Plot whose zoom survives redraws

# Gradio 6.31 mounts a fresh plotly div for every new figure (a keyed block), so
# plotly's ``uirevision`` alone cannot keep a zoom. This page script remembers
# the axis ranges a visitor zoomed or panned to in each ``.keep-zoom`` plot
# (keyed by its elem_id and the figure's uirevision) and puts them back on the
# next figure; a double-click (autorange) forgets them.
#
# The same script declutters the tree plots' labels after every draw (a zoom, a
# resize): ``components.views.tree_figures`` places them for a plot of a given width
# and lists the most telling first; on a narrower plot (the tree tab on a phone)
# a label that would cover an earlier one, or stick out of the plot, is hidden
# (its text stays in the hover), and a zoom that makes room shows it again.
TREE_PLOTS = "#tree-plot, .mini-tree"
KEEP_ZOOM_JS = """
() => {
  const saved = {};
  const keys = ["xaxis.range[0]", "xaxis.range[1]", "yaxis.range[0]", "yaxis.range[1]"];
  const declutter = (el) => {
    const drag = el.querySelector(".nsewdrag");
    if (!drag) return;
    const a = drag.getBoundingClientRect();
    const kept = [];
    el.querySelectorAll(".scatterlayer .textpoint text").forEach((t) => {
      t.style.visibility = "";
      if (!t.textContent) return;
      const r = t.getBoundingClientRect();
      const out = r.left < a.left - 1 || r.right > a.right + 1 || r.top < a.top - 1 || r.bottom > a.bottom + 1;
      const hit = kept.some((k) => r.left < k.right && k.left < r.right && r.top < k.bottom && k.top < r.bottom);
      if (out || hit) { t.style.visibility = "hidden"; } else { kept.push(r); }
    });
  };
  const hook = () => {
    document.querySelectorAll(".KEEP_ZOOM_CLASS .js-plotly-plot").forEach((el) => {
      if (el.__keepZoom || !el._fullLayout || !el.on || !window.Plotly) return;
      el.__keepZoom = true;
      const box = el.closest(".KEEP_ZOOM_CLASS");
      if (box.matches("TREE_PLOTS")) { el.on("plotly_afterplot", () => declutter(el)); declutter(el); }
      const key = (box.id || "plot") + "|" + (el.layout.uirevision || "");
      if (saved[key]) window.Plotly.relayout(el, saved[key]);
      el.on("plotly_relayout", (ev) => {
        if (ev["xaxis.autorange"] || ev["yaxis.autorange"]) { delete saved[key]; return; }
        const got = {};
        keys.forEach((k) => { if (k in ev) got[k] = ev[k]; });
        if (ev["xaxis.range"]) { got["xaxis.range[0]"] = ev["xaxis.range"][0]; got["xaxis.range[1]"] = ev["xaxis.range"][1]; }
        if (ev["yaxis.range"]) { got["yaxis.range[0]"] = ev["yaxis.range"][0]; got["yaxis.range[1]"] = ev["yaxis.range"][1]; }
        if (Object.keys(got).length) saved[key] = Object.assign({}, saved[key] || {}, got);
      });
    });
  };
  new MutationObserver(hook).observe(document.body, {childList: true, subtree: true});
}
""".replace("KEEP_ZOOM_CLASS", KEEP_ZOOM).replace("TREE_PLOTS", TREE_PLOTS)


REFRESH_FAILED = "⚠ Could not redraw this panel ({error}); it shows the last picture. Details are in the server log."


@dataclass
class LiveView:
    """A panel's refresh: ``fn(*inputs) -> outputs``, run on every ``timer`` tick.

    ``status`` (optional) is a one-line ``gr.Markdown`` on the panel: empty and hidden
    while refreshes work, it says so when one fails (see ``_quiet``)."""

    timer: gr.Timer
    fn: Callable
    inputs: Sequence = ()
    outputs: Sequence = ()
    status: gr.Markdown | None = None

    def refresh_on(self, *triggers) -> None:
        outputs = list(self.outputs) + ([self.status] if self.status is not None else [])
        gr.on(list(triggers), _quiet(self.fn, len(self.outputs), self.status is not None), list(self.inputs),
              outputs, show_progress="hidden", api_visibility="private", queue=True, trigger_mode="always_last")


def status_line(**kw) -> gr.Markdown:
    """The empty, hidden line a ``LiveView`` fills when a refresh fails; place it under the picture."""
    return gr.Markdown("", visible=False, elem_classes=["refresh-status"], **kw)


_failures_logged: set[tuple[str, str]] = set()


def _quiet(fn: Callable, num_outputs: int, with_status: bool = False) -> Callable:
    """A refresh that fails keeps the last picture and logs the detail (with the traceback):
    a timer must never show a visitor a traceback. With ``with_status`` the panel's status
    line (one more output) says in one short line that the picture is stale, naming only the
    exception's type; the next refresh that works hides it again."""

    @functools.wraps(fn)  # Gradio reads the wrapped signature (it injects gr.Request)
    def wrapper(*args, **kwargs):
        try:
            out = fn(*args, **kwargs)
        except Exception as exc:  # anything: once per tick, to the log; the traceback once per kind
            where = getattr(fn, "__qualname__", repr(fn))
            first = (where, type(exc).__name__) not in _failures_logged
            _failures_logged.add((where, type(exc).__name__))
            log.warning("panel refresh failed (%s): %s: %s", where, type(exc).__name__, exc, exc_info=first)
            skips = tuple(gr.skip() for _ in range(num_outputs))
            if with_status:
                return (*skips, gr.update(value=REFRESH_FAILED.format(error=type(exc).__name__), visible=True))
            return skips[0] if num_outputs == 1 else skips
        if not with_status:
            return out
        out = (out,) if num_outputs == 1 else tuple(out)
        return (*out, gr.update(value="", visible=False))

    return wrapper


def engine_signature(engine: FiguresAPI) -> tuple:
    """Changes whenever anything a panel shows could have changed (bar the clock): the engine's
    change counter, no stats built."""
    return (engine.version(),)


def unchanged(seen: tuple | None, signature: tuple) -> bool:
    """True when ``seen`` (signature, time drawn) says the picture is current."""
    return bool(seen) and seen[0] == signature and time.monotonic() - seen[1] < FORCE_REDRAW_S


def drawn(signature: tuple) -> tuple:
    return (signature, time.monotonic())


class _Shared:
    """One full snapshot per engine per tick, and each viewer's view of it (derived, not walked)."""

    def __init__(self, signature: tuple, full: TreeSnapshot) -> None:
        self.signature, self.taken_at, self.full = signature, time.monotonic(), full
        self.namespaces = namespaces_of(full)
        self.views: dict[str, TreeSnapshot] = {}  # viewer (or STRANGER) -> their view of ``full``


STRANGER = "\x00stranger"  # the view of every viewer who owns nothing in the tree: public nodes only
MAX_VIEWS = 1024  # derived views kept per snapshot; past that, derived again (cheap, no lock)

class _SharedSlot:
    """The engine's current shared snapshot (kept per engine by ``engine_state``, so it dies with the engine)."""

    def __init__(self) -> None:
        self.shared: _Shared | None = None
        self.lock = threading.Lock()  # guards ``shared``
        self.walk_lock = threading.Lock()  # visitors whose timers fire together wait for one walk


def _slot(engine: EngineAPI) -> _SharedSlot:
    return engine_state(engine, "live.shared_snapshot", _SharedSlot)


def forget(engine: EngineAPI) -> None:
    """Drop the engine's shared snapshot (the next tick walks the tree again)."""
    slot = _slot(engine)
    with slot.lock:
        slot.shared = None


def shared_snapshot(engine: EngineAPI, viewer: str | None, max_age_s: float = 1.0) -> TreeSnapshot:
    """``engine.snapshot(viewer)`` at the cost of one tree walk per engine per ``max_age_s``,
    however many visitors poll it: the full snapshot (``viewer=None``) is taken once while the
    engine's signature holds, and each viewer's view is derived from it by
    ``engine.snapshot_view.for_viewer`` (the engine's own hiding rule, applied to plain data:
    no cache lock, no decoding). Viewers who own nothing in the tree share one view."""
    sig = engine_signature(engine)
    slot = _slot(engine)

    def current() -> _Shared | None:
        with slot.lock:
            got = slot.shared
        return got if got and got.signature == sig and time.monotonic() - got.taken_at < max_age_s else None

    shared = current()
    if shared is None:
        with slot.walk_lock:  # visitors whose timers fire together wait for one walk instead of each taking one
            shared = current()
            if shared is None:
                shared = _Shared(sig, engine.snapshot(viewer=None))
                with slot.lock:
                    slot.shared = shared
    if viewer is None or not engine.isolation:
        return shared.full
    key = viewer if owns_any(shared.namespaces, viewer) else STRANGER
    view = shared.views.get(key)
    if view is None:
        view = for_viewer(shared.full, viewer)
        if len(shared.views) < MAX_VIEWS:
            shared.views[key] = view
    return view


@dataclass(frozen=True)
class CacheFigures:
    """The cache's figures a panel shows, as a viewer may see them, each declared
    (``engine.visibility``): the KV in use, tokens, nodes and evictions are everyone's (the
    viewer's view counts others' tokens in buckets already; on a public page the whole figure is
    coarse), the budget ships with the deployment."""

    kv_bytes: Figure
    budget: Figure
    tokens: Figure
    nodes: Figure
    evicted: Figure
    # everyone's, shown only where the cache is shared (not per viewer in isolation mode)
    tree_kv: Figure = everyone(0, Unit.BYTES)
    running_kv: Figure = everyone(0, Unit.BYTES)
    shared: Figure = everyone(0, Unit.TOKENS)


def cache_figures(engine: EngineAPI, viewer: str | None) -> CacheFigures:
    """What ``engine.stats(viewer)`` says of the cache, at no walk of the tree per viewer: in
    isolation mode ``stats(viewer)`` takes a snapshot of its own for every visitor on every
    tick (the overview's cards, the memory tab); this reads the viewer's view of the shared
    one instead (others' tokens coarse, the same rule). Shared or remote: ``engine.stats()``."""
    if viewer is None or not engine.isolation or not engine.capabilities.local_cache:
        s = engine.stats(viewer)
        return CacheFigures(everyone(s.cache_bytes, Unit.BYTES), shipped(s.budget_bytes, Unit.BYTES),
                            everyone(s.cached_tokens_now, Unit.TOKENS), everyone(s.num_nodes),
                            everyone(s.evicted_tokens, Unit.TOKENS), everyone(s.tree_bytes, Unit.BYTES),
                            everyone(s.running_bytes, Unit.BYTES), everyone(s.shared_tokens, Unit.TOKENS))
    snap = shared_snapshot(engine, viewer)
    return CacheFigures(everyone(snap.num_bytes, Unit.BYTES), shipped(snap.budget_bytes, Unit.BYTES),
                        everyone(snap.num_tokens, Unit.TOKENS), everyone(len(snap.nodes)),
                        everyone(snap.evicted_tokens, Unit.TOKENS))
