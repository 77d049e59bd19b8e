"""Replay analysis without a UI: log formats, the model-free simulation, what a replay keeps, template inference, the synthetic log.

Reads the engine through its public modules (types, validation, snapshot_view, text) and the
torch-free parts of the cache (the radix tree, the eviction policy, the chunk size), which the
simulated cache is built on. One reach into the core: ``simulate.model_geometry`` reads a model's
KV geometry through ``engine.model.loader``, inside the function (loading the replay loads no torch)."""
