"""The server's Mailbox: every event from the engine thread arrives, in order, each handler's in
its own queue; a busy loop polls instead of being woken, and goes back to waiting when quiet."""

import asyncio
import threading

from ortspec.serve.app import Mailbox


def test_events_arrive_in_order_and_the_poll_stops_when_quiet():
    async def main():
        loop = asyncio.get_running_loop()
        mailbox = Mailbox(loop)
        queues = [asyncio.Queue() for _ in range(3)]
        posters = [mailbox.poster(q, i) for i, q in enumerate(queues)]

        def engine():
            for n in range(500):
                for post in posters:
                    post(n)

        thread = threading.Thread(target=engine)
        thread.start()
        got = [[] for _ in queues]
        for i, q in enumerate(queues):
            for _ in range(500):
                got[i].append(await asyncio.wait_for(q.get(), 5))
        thread.join()
        assert got == [[(i, n) for n in range(500)] for i in range(3)]
        await asyncio.sleep(Mailbox.POLL_S * (Mailbox.QUIET_POLLS + 20))
        assert not mailbox._polling  # quiet: the next event wakes the loop again
        posters[0]("late")
        assert await asyncio.wait_for(queues[0].get(), 5) == (0, "late")

    asyncio.run(main())
