"""Command-line tools over the engine: ``python -m engine.tools.bench`` and
``python -m engine.tools.replay``."""
