"""The Gradio UI. ``panels/``: one file per panel, each with a ``build_*`` function that lays
out its components and wires their events (gradio lives only there). ``views/``: pure builders,
engine data in, figures, marks and words out (no gradio). At the top: ``demo.py`` (the tabs),
``session.py`` (who a visitor is), ``warm_start.py`` and the shipped content (``chat_presets.py``,
``lab_presets.py``). Reads the engine only through its public modules; turns engine errors into
``gr.Warning`` messages."""
