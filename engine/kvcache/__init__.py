"""The only code that owns KV bytes: the radix tree, the one pool, the cache over both, request KV views, the second tier."""
