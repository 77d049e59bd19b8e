"""The prompt-ordering lab's tab: its builder and wiring (figures and Markdown in ``components.views.lab``)."""
