"""The HTTP side of the app: an OpenAI-compatible API, Prometheus metrics, and a remote engine
that puts the dashboard in front of another OpenAI-compatible server. Imports ``engine``, never
``components`` or gradio (tests/test_layering.py)."""
