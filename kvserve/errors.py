"""The errors kvserve raises on purpose.

Every error a user can cause (a bad model path, an unsupported quant type, an
invalid sampling parameter) is one of these, with a message that names what is
wrong, so the CLI and server can report it in one line instead of a traceback.
"""


class KVServeError(Exception):
    """Base class for every error kvserve raises deliberately."""


class ModelLoadError(KVServeError):
    """The model could not be loaded: missing file, unreadable or inconsistent data."""


class UnsupportedModelError(ModelLoadError):
    """The model uses an architecture, tensor type or feature kvserve does not support."""


class TokenizerUnavailableError(KVServeError):
    """Text input or output was requested from a model loaded without a tokenizer."""


class KVIntegrityError(KVServeError):
    """The KV block accounting is inconsistent (a leak, a double free, a stale hash): a bug, never user error.

    Raised by the `check_integrity()` methods instead of `assert`, so `python -O` cannot silence them.
    """


class InvalidRequestError(KVServeError, ValueError):
    """A request or its sampling parameters are invalid; `param` names the offending field when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ConfigError(KVServeError, ValueError):
    """An engine or server setting is invalid (a CLI flag, an EngineConfig field); the message names it."""


class RequestFailedError(KVServeError):
    """One request failed while it ran (sampling, post-processing, or a forward that fails with it
    alone); the engine finished it and every other request went on."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id = request_id
