"""A small shop API for the action tests: a real aiohttp server on a free 127.0.0.1 port.

GET /orders/{id} answers an order's status as JSON, 404 for an unknown one. Two orders misbehave:
SLOW_ORDER answers only after `slow_s`, FAILING_ORDER answers 500. Every request's path is kept.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

ORDERS = {
    "AB-1234": {"status": "out for delivery", "eta": "Tuesday"},
    "CD-5678": {"status": "delivered", "eta": None},
}
SLOW_ORDER = "SL-0001"
FAILING_ORDER = "ER-0500"


class ShopServer:
    """The shop, started with `async with ShopServer() as shop` (its URL: `shop.url`)."""

    def __init__(self, slow_s: float = 30.0):
        self.slow_s = slow_s
        self.requests: list[str] = []
        self.url = ""
        app = web.Application()
        app.router.add_get("/orders/{order_id}", self._order)
        self._runner = web.AppRunner(app)

    async def _order(self, request: web.Request) -> web.Response:
        order_id = request.match_info["order_id"]
        self.requests.append(request.path)
        if order_id == SLOW_ORDER:
            await asyncio.sleep(self.slow_s)
        if order_id == FAILING_ORDER:
            return web.json_response({"error": "database down"}, status=500)
        order = ORDERS.get(order_id)
        if order is None:
            return web.json_response({"error": "no such order"}, status=404)
        return web.json_response({"order_id": order_id, **order})

    async def __aenter__(self) -> ShopServer:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()
