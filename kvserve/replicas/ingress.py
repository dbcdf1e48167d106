"""The one HTTP entry of a replicated kvserve: reads each request, computes its routing key, and hands it whole
to a replica through a Ray Serve handle (whose request router picks the replica), streaming the answer back.

It does not parse the API: the replica's own app does (replicas/engine_replica.py), so status codes,
error bodies and SSE streams are the single server's. Its own answers are for what no replica can give:
a replica that died before answering is a 503 in OpenAI's error shape (Anthropic's on /v1/messages);
one that dies mid-stream ends the stream with an error event. Either way only that request fails, and
Ray Serve restarts the replica while its router stops choosing it.
"""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvserve.replicas.routing_key import RoutingKeys

log = logging.getLogger(__name__)

_HOP_BY_HOP = {"content-length", "transfer-encoding", "connection"}


def replica_unavailable_body(path: str, why: str) -> bytes:
    message = f"the replica serving this request failed ({why}); it is being restarted: retry the request"
    if path == "/v1/messages":
        return json.dumps({"type": "error", "error": {"type": "api_error", "message": message}}).encode()
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                 "code": "replica_unavailable"}}).encode()


class Ingress:
    """The Ray Serve deployment class of the ingress (wrapped in replicas/app.py)."""

    def __init__(self, replicas, model: str | None, block_size: int, api_keys: list[str]) -> None:
        from kvserve.model.loader import load_tokenizer  # the vocabulary only, never the weights

        self.replicas = replicas  # a DeploymentHandle to the EngineReplica deployment
        self.keys = RoutingKeys(load_tokenizer(model), block_size, api_keys)

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        path = request.url.path
        headers = {k.lower(): v for k, v in request.headers.items()}
        call = {"method": request.method, "path": path, "query": request.url.query, "body": body,
                "headers": list(request.headers.items()),
                "client": (request.client.host, request.client.port) if request.client else None}
        hashes = self.keys.hashes(path, headers, body) if request.method == "POST" else []
        stream = self.replicas.options(stream=True).handle_http.remote(call, routing_hashes=hashes)
        try:
            head = await stream.__anext__()
        except StopAsyncIteration:
            return _unavailable(path, "it sent no answer")
        except Exception as exc:  # noqa: BLE001 - a dead or unreachable replica: Ray's errors vary by cause
            log.warning("replica failed before answering %s: %s", path, exc)
            return _unavailable(path, type(exc).__name__)
        response_headers = {k: v for k, v in head["headers"] if k.lower() not in _HOP_BY_HOP}
        return StreamingResponse(_rest(stream, path, self.keys), status_code=head["status"], headers=response_headers)


async def _rest(stream, path: str, keys: RoutingKeys) -> AsyncIterator[bytes]:
    try:
        async for chunk in stream:
            if isinstance(chunk, dict):  # the replica's remembered answers: the next turn routes by them
                keys.remember(chunk.get("answers", []))
                continue
            yield chunk
    except Exception as exc:  # noqa: BLE001 - the replica died mid-answer: say so in the stream, then end it
        log.warning("replica failed while answering %s: %s", path, exc)
        yield b"event: error\ndata: " + replica_unavailable_body(path, type(exc).__name__) + b"\n\n"


def _unavailable(path: str, why: str) -> Response:
    return Response(replica_unavailable_body(path, why), status_code=503, media_type="application/json",
                    headers={"retry-after": "1"})

