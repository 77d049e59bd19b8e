"""What a fair prefill timing is and what it yields: plain records, no engine.

Owns: ``TimingPolicy`` (how many pairs and runs a timing takes, its bounds) and
``default_policy``; the results ``PrefillPair``, ``LogitsCheck``, ``PrefillTiming``, ``WarmPrefix``,
``GrowthPoint``, ``GrowthCurve``; the medians a timing reports. ``prefill_timing.py`` measures
and re-exports them; the page reads them. Knows nothing about the engine, the runner or the UI.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TimingPolicy:
    """What one timing may cost. ``max_tokens`` bounds the tokens a timing runs through the
    model, all pairs together (fewer pairs when a prompt is long; none when one pair is over).
    ``memo_min_tokens``: when set, a prompt that starts with a shipped prefix (``public_len``)
    at least this long takes its no-reuse figure from a memo, measured once per prefix, prompt
    length and namespace (never read by another visitor); only the reuse side is measured again."""

    pairs: int = 3
    reuse_runs: int = 3  # the reuse side of a pair is the median of this many runs (short, so noise-prone)
    max_tokens: int = 16_384
    block_tokens: int = 512
    memo_min_tokens: int | None = None
    wait_s: float = 30.0  # a timing waits at most this long for the one before it, then is skipped
    memo_size: int = 256


def default_policy(device_type: str, isolation: bool) -> TimingPolicy:
    """CPU: blocks of 512 tokens (about a second of prefill on two cores, so streams keep moving);
    accelerators run a prompt in one call. A public deployment (``isolation``) bounds a timing to
    4,096 tokens on CPU and memoizes the no-reuse figure of long shipped prefixes; locally every
    timing measures both sides afresh, up to 16,384 tokens."""
    cpu = device_type == "cpu"
    block = 512 if cpu else 8192
    if isolation:
        return TimingPolicy(pairs=3, max_tokens=4096 if cpu else 65_536, block_tokens=block, memo_min_tokens=512)
    return TimingPolicy(pairs=3, max_tokens=16_384 if cpu else 262_144, block_tokens=block)


@dataclass(frozen=True)
class PrefillPair:
    reuse_ms: float
    full_ms: float

    @property
    def ratio(self) -> float:
        return self.full_ms / self.reuse_ms if self.reuse_ms > 0 else 0.0


@dataclass(frozen=True)
class LogitsCheck:
    """What a paired timing's two sides computed for the prompt's last token (the logits its first
    new token is picked from), compared: with reuse (the cached prefix's KV copied, the rest
    computed) and without (every token computed). ``identical`` is ``torch.equal`` on the float32
    rows; the digests are their bytes' SHA-256 (first 16 hex digits), so a reader can see it."""

    identical: bool
    max_abs_diff: float
    same_next_token: bool  # the greedy pick (first of the largest) is the same token
    reuse_digest: str
    full_digest: str


@dataclass(frozen=True)
class PrefillTiming:
    """One prompt timed with and without reuse. ``reuse_ms``/``full_ms`` are the median pair's;
    ``full_ms`` is None when the no-reuse side was over the bound (``skipped`` says why).
    ``full_from_memo``: the no-reuse figure was measured at ``full_measured_at`` (time.time())
    for the same shipped prefix and prompt length, as the median of ``full_runs`` runs."""

    prompt_tokens: int
    cached_tokens: int  # what the reuse side copied from the cache
    pairs: tuple[PrefillPair, ...] = ()
    reuse_ms: float | None = None
    full_ms: float | None = None
    full_measured_at: float = 0.0
    full_from_memo: bool = False
    full_runs: int = 0
    block_tokens: int = 0
    reuse_runs: int = 1  # runs behind each pair's reuse figure (their median)
    skipped: str | None = None
    logits: LogitsCheck | None = None  # both sides' last logits compared (None: the no-reuse side came from the memo)

    @property
    def speedup(self) -> float | None:
        if self.full_ms is None or not self.reuse_ms:
            return None
        return self.full_ms / self.reuse_ms


@dataclass(frozen=True)
class WarmPrefix:
    """A shipped prefix put in the cache at start: its length, what was computed and how long it took."""

    label: str
    num_tokens: int
    computed_tokens: int
    prefill_ms: float
    skipped: str | None = None


@dataclass(frozen=True)
class GrowthPoint:
    cached_tokens: int  # the length measured: this much of the filler was meant to be reused
    suffix_tokens: int
    reuse_ms: float
    full_ms: float
    pairs: int
    reused_tokens: int | None = None  # what the reuse side really copied (fewer if some was evicted)

    @property
    def reused_less(self) -> bool:
        return self.reused_tokens is not None and self.reused_tokens < self.cached_tokens

    @property
    def speedup(self) -> float:
        return self.full_ms / self.reuse_ms if self.reuse_ms > 0 else 0.0


@dataclass(frozen=True)
class GrowthCurve:
    """Prefill time with and without reuse against the cached length, on this engine's device.
    ``state``: "none", "running", "done" or "failed" (``error`` says why)."""

    state: str = "none"
    points: tuple[GrowthPoint, ...] = ()
    device: str = ""
    dtype: str = ""
    started_at: float = 0.0
    finished_at: float = 0.0
    error: str = ""
    lengths: tuple[int, ...] = field(default_factory=tuple)


def _median_pair(pairs: Sequence[PrefillPair]) -> PrefillPair:
    """The pair whose ratio is the median (the lower middle one for an even count: conservative)."""
    ranked = sorted(pairs, key=lambda p: p.ratio)
    return ranked[(len(ranked) - 1) // 2]


def _median(values: Sequence[float]) -> float:
    ranked = sorted(values)
    return ranked[(len(ranked) - 1) // 2]
