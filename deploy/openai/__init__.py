"""The OpenAI-compatible HTTP layer: a plain FastAPI app over a `Backend`, mounted later by Ray Serve.

    from deploy.openai import ApiConfig, EngineBackend, build_api
    app = build_api(EngineBackend(async_engine, "smollm2"), ApiConfig(api_keys={"sk-1": "acme"}))
"""

from deploy.openai.app import build_api
from deploy.openai.backend import Backend, EngineBackend
from deploy.openai.config import ApiConfig

__all__ = ["ApiConfig", "Backend", "EngineBackend", "build_api"]
