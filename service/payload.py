"""The request body's size limit (TGI's router's --payload-limit, 2 MB by default): a body over
WCODEC_PAYLOAD_LIMIT bytes answers 413 (errors.PayloadTooLarge) before the route parses it. One
that says its length (Content-Length) is refused unread; one sent in chunks is counted as the
route reads it and refused at the chunk that passes the limit, so no more is ever held."""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import BodyOverLimit, PayloadTooLarge, respond


class PayloadLimitMiddleware:
    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            await respond(scope["path"], PayloadTooLarge(self.limit))(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Receive) -> Receive:
        read = 0

        async def counted() -> Message:
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.limit:
                raise BodyOverLimit(self.limit)
            return message
        return counted
