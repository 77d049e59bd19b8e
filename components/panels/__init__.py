"""The page's Gradio panels: each module lays out its components and wires their events (a
``build_*`` function), and the helpers only panels use (live refresh, input hygiene, the chat and
few-shot panels' shared pieces). Figures, marks and words come from ``components.views``."""
