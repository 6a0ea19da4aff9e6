"""kvcache's OpenAI-compatible HTTP server on the engine: the app (`build_app`, `ServerSettings`),
the wire format (`openai_api`), Prometheus metrics, and running it with uvicorn (`serve`).
`kvcache serve` is the command; docs/serve.md the guide."""

from kvcache.server.app import ServerSettings, build_app
from kvcache.server.run import bind, serve

__all__ = ["ServerSettings", "bind", "build_app", "serve"]
