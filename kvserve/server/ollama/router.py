"""Ollama's routes: /api/chat and /api/generate (serving.py), the model's description (/api/tags, /api/show,
/api/ps, /api/version, `GET /`), and a clear refusal, in Ollama's error shape, of what kvserve does not do:
it serves the one model it was started with and downloads nothing.

Model names: the served name, with or without Ollama's default tag `:latest`.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from kvserve.server.core.auth import api_key_dependency
from kvserve.server.core.errors import APIError, model_not_found
from kvserve.server.core.serving import Serving
from kvserve.server.ollama.protocol import OLLAMA_DEFAULTS, ChatRequest, GenerateRequest, ShowRequest
from kvserve.server.ollama.serving import OllamaServing
from kvserve.tools.reasoning import template_supports_thinking

# The Ollama API level these routes follow (clients such as VS Code check a minimum version).
OLLAMA_API_VERSION = "0.12.0"
_NOT_SERVED = ("/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete", "/api/embed", "/api/embeddings",
               "/api/blobs/{digest}")


def ollama_error_response(error: APIError) -> JSONResponse:
    """Ollama's error body: `{"error": "..."}` with the status."""
    return JSONResponse({"error": error.message}, status_code=error.status, headers=error.headers or None)


def _parameter_count(serving: Serving) -> int:
    """The model's parameters from its shape (its weights may be packed codes, whose element counts are not)."""
    c = serving.engine.loaded.config
    attention = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return embeddings + c.num_layers * (attention + mlp + 2 * c.hidden_size) + c.hidden_size


def _size_label(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}".rstrip("0").rstrip(".") + unit
    return str(count)


class ModelDescription:
    """The served model as Ollama's listing routes describe it (computed once)."""

    def __init__(self, serving: Serving) -> None:
        loaded, name = serving.engine.loaded, serving.settings.model_name
        self.name = name
        self.arch = loaded.config.architecture
        self.context = serving.engine.max_model_len
        self.template = (serving.tokenizer.chat_template if serving.tokenizer else None) or ""
        self.parameters = _parameter_count(serving)
        self.size = sum(loaded.weight_bytes.values())
        self.digest = hashlib.sha256(f"{name}\0{loaded.source}\0{loaded.weight_format}".encode()).hexdigest()
        self.modified_at = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
        quant = loaded.weight_format.split()[1] if loaded.weight_format.startswith("GGUF ") else loaded.linear_dtype
        self.details = {"parent_model": "", "format": "gguf" if loaded.weight_format.startswith("GGUF") else
                        "safetensors", "family": self.arch, "families": [self.arch],
                        "parameter_size": _size_label(self.parameters), "quantization_level": quant}
        c = loaded.config
        self.model_info = {
            "general.architecture": self.arch, "general.parameter_count": self.parameters,
            f"{self.arch}.context_length": self.context, f"{self.arch}.embedding_length": c.hidden_size,
            f"{self.arch}.block_count": c.num_layers, f"{self.arch}.attention.head_count": c.num_heads,
            f"{self.arch}.attention.head_count_kv": c.num_kv_heads}
        # every model takes tools here (kvserve's default block where its template has none)
        self.capabilities = ["completion", "tools"] + (["thinking"] if template_supports_thinking(self.template) else [])

    def entry(self) -> dict:
        return {"name": self.name, "model": self.name, "modified_at": self.modified_at, "size": self.size,
                "digest": self.digest, "details": self.details}


def ollama_router(serving: Serving) -> APIRouter:
    router = APIRouter()
    api_key = api_key_dependency(serving.tenancy)
    ollama = OllamaServing(serving)
    described: list[ModelDescription] = []

    def model() -> ModelDescription:
        if not described:
            described.append(ModelDescription(serving))
        return described[0]

    def served(name: str) -> str:
        """The request's model name as the engine knows it (Ollama's `:latest` tag is the default)."""
        bare = name.removesuffix(":latest")
        if bare != serving.settings.model_name:
            raise model_not_found(name)
        return bare

    @router.get("/", response_class=PlainTextResponse)
    @router.head("/", response_class=PlainTextResponse)
    async def running() -> str:
        return "Ollama is running"

    @router.get("/api/version")
    async def version() -> dict:
        return {"version": OLLAMA_API_VERSION}

    @router.get("/api/tags")
    async def tags(_: str = Depends(api_key)) -> dict:
        return {"models": [model().entry()]}

    @router.post("/api/show")
    async def show(body: ShowRequest, _: str = Depends(api_key)) -> dict:
        served(body.model_name)
        m = model()
        parameters = "\n".join(f"{k:<15} {v}" for k, v in OLLAMA_DEFAULTS.items())
        return {"license": "", "modelfile": f"# served by kvserve\nFROM {m.name}\n", "parameters": parameters,
                "template": m.template, "details": m.details, "model_info": m.model_info,
                "capabilities": m.capabilities, "modified_at": m.modified_at}

    @router.get("/api/ps")
    async def ps(_: str = Depends(api_key)) -> dict:
        # loaded for as long as the server runs
        return {"models": [{**model().entry(), "expires_at": "2318-01-01T00:00:00Z", "size_vram": 0,
                            "context_length": model().context}]}

    @router.post("/api/chat")
    async def chat(body: ChatRequest, request: Request, key: str = Depends(api_key)):
        body.model = served(body.model)
        return await ollama.chat(body, request, key)

    @router.post("/api/generate")
    async def generate(body: GenerateRequest, request: Request, key: str = Depends(api_key)):
        body.model = served(body.model)
        if not body.prompt and not body.system:  # Ollama's "load the model" call: it is loaded
            return {"model": body.model, "created_at": model().modified_at, "response": "", "done": True,
                    "done_reason": "load"}
        return await ollama.generate(body, request, key)

    async def not_served(request: Request) -> None:
        raise APIError(501 if request.url.path.startswith("/api/embed") else 403,
                       f"{request.url.path} is not served by kvserve: it serves the model it was started with "
                       f"({serving.settings.model_name}), generates text, and downloads nothing")

    for path in _NOT_SERVED:
        router.add_api_route(path, not_served, methods=["POST", "DELETE", "HEAD", "GET"], include_in_schema=False)
    return router
