"""The shape every HTTP middleware of the server shares: non-HTTP scopes (lifespan, websockets)
pass straight through to the app; a subclass's ``handle`` sees only HTTP requests."""

from __future__ import annotations

__all__ = ["HTTPMiddleware"]


class HTTPMiddleware:
    """ASGI middleware base: ``handle(scope, receive, send)`` runs for each HTTP request; every other
    scope goes to ``self.app`` untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope, receive, send) -> None:
        raise NotImplementedError
