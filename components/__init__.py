"""The Gradio UI: one file per panel, each with a ``build_*_panel(engine)`` that lays
out its components and wires their events. Reads the engine only through
``engine.types``; turns engine errors into ``gr.Warning`` messages."""
