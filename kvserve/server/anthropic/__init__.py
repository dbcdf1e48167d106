"""Anthropic's Messages API, with cache_control breakpoints as pinned prefixes."""

from kvserve.server.anthropic.router import messages_router

__all__ = ["messages_router"]
