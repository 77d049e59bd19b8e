"""Pure views: engine data in, plotly figures, marks, HTML and words out. Nothing here imports
gradio, not even lazily (tests/test_layering.py), so a view can be built, tested and benchmarked
without a page. New figure code goes here; the panel that shows it lives in ``components.panels``."""
