"""The scheduler's knobs.

Owns: ``SchedulerConfig`` (batch rows, tokens per step, the waiting-order policy's
limits, the step log's size). Knows nothing else: plain values, read by the rest of the
package.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 16  # requests in prefill or decode at once (a decode forward's batch size at most)
    chunk_tokens: int = 256  # prompt tokens computed per step, over all prefills
    isolation: bool = False  # a public deployment: turns and rows by owner (``policy.held_back``)
    lpm_queue_limit: int = 16  # a longer waiting list is served first-come-first-served
    max_wait_s: float = 10.0  # waited longer: admitted first, in arrival order (ageing guard)
    share_min_tokens: int = 16  # hold a request back while another prefills this many of its uncached tokens
    # the oldest prompt in prefill takes this share of each step's chunk budget first (at least
    # one token), so that steady arrivals (each with no chunk done, so ahead of it) cannot starve it
    oldest_prefill_share: float = 0.25
    match_refresh_s: float = 0.25  # a waiting request's cached-prefix length is re-matched this often
    step_log_size: int = 600

    @property
    def oldest_prefill_tokens(self) -> int:
        return max(1, int(self.chunk_tokens * self.oldest_prefill_share)) if self.oldest_prefill_share > 0 else 0
    rate_window_s: float = 10.0  # tokens/s is measured over this window
