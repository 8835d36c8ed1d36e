"""The built-in OpenAI-compatible inference server (``grail-serve``): FastAPI app + engine."""
