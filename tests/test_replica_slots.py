"""The replica's bound on its engine's requests over both paths (chunkserve/replicas/deployment._Slots):
waiters get slots in arrival order, a waiter that leaves gives its place (or a slot handed to it)
back, and nothing is lost when a release and a cancel meet."""

from __future__ import annotations

import asyncio

from chunkserve.replicas.deployment import _Slots


def test_slots_in_order_and_cancelled_waiters_give_back():
    async def run() -> None:
        slots = _Slots(2)
        await slots.take()
        await slots.take()
        assert not slots.free()
        order: list[int] = []

        async def wait(i: int) -> None:
            await slots.take()
            order.append(i)

        waiters = [asyncio.create_task(wait(i)) for i in range(4)]
        await asyncio.sleep(0)
        waiters[1].cancel()  # leaves the line
        slots.release()
        slots.release()
        await asyncio.sleep(0)
        assert order == [0, 2] and slots.used == 2
        # a release and a cancel in one turn: the waiter was handed the slot, so it gives it back
        slots.release()
        waiters[3].cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert order == [0, 2] and slots.used == 1 and slots.free()
        # a cancel first, then a release that drops the cancelled waiter: no error, no slot lost
        slots.used = 2
        late = asyncio.create_task(wait(9))
        await asyncio.sleep(0)
        late.cancel()
        slots.release()
        (ended,) = await asyncio.gather(late, return_exceptions=True)
        assert isinstance(ended, asyncio.CancelledError), ended  # (not an error of the bookkeeping)
        assert slots.used == 1 and not slots._waiting

    asyncio.run(run())
