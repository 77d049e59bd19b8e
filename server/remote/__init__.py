"""Remote mode: the engine interface over another OpenAI-compatible server (client, usage parsing, the engine)."""
