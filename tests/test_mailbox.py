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


def test_an_event_on_the_loop_goes_straight_in_after_any_from_a_thread():
    """The engine process's pipe is read on the loop: its events need no flush, but one that
    another thread (a failing restart) left waiting still comes first."""

    async def main():
        mailbox = Mailbox(asyncio.get_running_loop())
        events = asyncio.Queue()
        post = mailbox.poster(events)
        post("on the loop")
        assert events.get_nowait() == (0, "on the loop")  # no flush in between
        thread = threading.Thread(target=post, args=("from a thread",))
        thread.start()
        thread.join()
        post("on the loop, after")
        assert events.empty()  # both wait for the flush, in order
        assert [await asyncio.wait_for(events.get(), 5) for _ in range(2)] == [(0, "from a thread"),
                                                                              (0, "on the loop, after")]

    asyncio.run(main())
