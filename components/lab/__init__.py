"""The prompt-ordering lab's tab: its builder, preset content, figures and Markdown."""
