"""The server's client errors: one sentence each, never a traceback."""

from __future__ import annotations


class BadRequest(Exception):
    """Invalid client input: an error body with status 400 (OpenAI's shape on
    the OpenAI routes, Anthropic's on ``/v1/messages``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelNotFound(BadRequest):
    """A request for a model this server does not serve: status 404."""
