"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}} with the HTTP status."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error the server answers with a status and OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")


def unauthorized() -> APIError:
    return APIError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'.",
                    code="invalid_api_key")


def overloaded(waiting: int, limit: int) -> APIError:
    return APIError(429, f"The server is at capacity ({waiting} requests waiting, limit {limit}); retry later.",
                    type="rate_limit_error", code="rate_limit_exceeded")


def internal(message: str) -> APIError:
    return APIError(500, message, type="server_error")
