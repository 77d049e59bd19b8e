"""The second tier's unit, with no torch: KV is kept in chunks of ``CHUNK_TOKENS`` consecutive positions.

Owns the one number. The store (``engine.kvcache.kv_tier``) keeps whole chunks only, and the
replay's simulated tier (``analysis.replay``) counts the same chunks without loading the store
or torch. Knows nothing else.
"""

from __future__ import annotations

CHUNK_TOKENS = 64
