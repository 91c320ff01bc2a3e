"""The router's OpenAI-compatible HTTP front: OpenAI's and vLLM's bodies in, their objects and
streams out, over the router's shared request path (services/router/request_path.py). Only the
router's server (services/router/server.py) imports this package."""
