"""The request body's size limit (TGI's router's --payload-limit, 2 MB by default): a body over
WCODEC_PAYLOAD_LIMIT bytes answers 413 (errors.PayloadTooLarge) as the route starts to read it,
before it parses it. One that says its length (Content-Length) is refused unread, at the route's
first read; one sent in chunks is counted as the route reads it and refused at the chunk that
passes the limit, so no more is ever held. Either way the request has been routed (as TGI's axum
extractors enforce its limit): the 413 is counted under its route in the HTTP metrics, and a route
that reads no body answers as it would (a 404 for no route)."""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import BodyOverLimit


class PayloadLimitMiddleware:
    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        await self.app(scope, self._counting(receive, int(length) if length.isdigit() else 0), send)

    def _counting(self, receive: Receive, declared: int) -> Receive:
        read = 0

        async def counted() -> Message:
            nonlocal read
            if declared > self.limit:            # said too long: refused unread
                raise BodyOverLimit(self.limit)
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.limit:
                raise BodyOverLimit(self.limit)
            return message
        return counted
