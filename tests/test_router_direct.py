"""chunkserve/router/direct.py: the ingress finds its process's router of a deployment and gets its choice
made on the router's own event loop (a thread of its own, as Serve runs routers); a choice made
for a request whose client left while waiting is released, not leaked into the replica's load."""

from __future__ import annotations

import asyncio
import threading
import time

from chunkserve.router import direct
from chunkserve.router.direct import DirectRoute


class _Router:
    """A router on its own loop thread: route_direct records where it ran and what it released."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.threads: list[int] = []
        self.released: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def route_direct(self, request) -> DirectRoute | None:
        self.threads.append(threading.get_ident())
        time.sleep(self.delay_s)  # (the router's loop busy: the caller waits)
        return DirectRoute("r1", ("127.0.0.1", 1, "00"), lambda: self.released.append(request))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def test_no_router_no_route():
    assert asyncio.run(direct.route_direct("nope", "LLMReplica", "req")) is None


def test_the_choice_is_made_on_the_routers_loop():
    router = _Router()
    direct.register("app", "LLMReplica", router, router.loop)
    try:
        route = asyncio.run(direct.route_direct("app", "LLMReplica", "req"))
        assert route is not None and route.replica_id == "r1"
        assert router.threads == [router.thread.ident]
        route.release()
        assert router.released == ["req"]
        assert asyncio.run(direct.route_direct("app", "other", "req")) is None  # by deployment
    finally:
        router.stop()
    assert asyncio.run(direct.route_direct("app", "LLMReplica", "req")) is None  # its loop is gone


def test_a_choice_for_a_cancelled_request_is_released():
    router = _Router(delay_s=0.3)
    direct.register("app2", "LLMReplica", router, router.loop)

    async def run() -> None:
        task = asyncio.create_task(direct.route_direct("app2", "LLMReplica", "gone"))
        await asyncio.sleep(0.1)  # the router is choosing
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        for _ in range(100):
            if router.released:
                break
            await asyncio.sleep(0.02)

    try:
        asyncio.run(run())
        assert router.released == ["gone"]
    finally:
        router.stop()
