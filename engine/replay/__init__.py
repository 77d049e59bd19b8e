"""Replay analysis without a UI: log formats, the model-free simulation, what a replay keeps, template inference, the synthetic log."""
