"""The feed's sender wakes when an engine becomes dirty, not at every later change before its load frame."""

from __future__ import annotations

from actors.feed import FeedHub, _Connection


async def test_only_the_first_change_since_the_last_load_frame_wakes_the_sender() -> None:
    hub = FeedHub()
    c = _Connection({"e0", "e1"}, 16)
    hub._conns.add(c)
    hub.changed("e0")
    assert c.wake.is_set() and c.dirty == {"e0"}
    c.wake.clear()
    hub.changed("e0")  # a busy engine's next steps: already in the next load frame
    assert not c.wake.is_set()
    hub.changed("e1")  # another engine becoming dirty does wake it
    assert c.wake.is_set() and c.dirty == {"e0", "e1"}
    c.wake.clear()
    c.dirty.clear()  # the load frame went out
    hub.changed("e0")
    assert c.wake.is_set()
    hub.changed("e9")  # not carried by this connection
    assert c.dirty == {"e0"}
