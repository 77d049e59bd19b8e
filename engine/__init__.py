"""The engine: a radix-tree prefix cache in front of a real Hugging Face causal LM.

Nothing in this package imports gradio, plotly or networkx; the UI reads the
engine only through the plain dataclasses in :mod:`engine.types`.
"""
