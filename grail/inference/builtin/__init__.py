"""The built-in OpenAI-compatible inference server (``grail-serve``): FastAPI app + engine."""

#: the environment variable ``grail-serve`` reads its key from when ``--api-key`` is not given:
#: the way grail hands its child server the key (a command line is visible to every local user)
API_KEY_ENV = "GRAIL_API_KEY"
