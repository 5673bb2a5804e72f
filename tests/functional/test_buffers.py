"""Property tests of the output buffers that keep floods from reaching host memory."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.backends.container.initclient import CappedBuffer, RingLog

chunks = st.lists(st.binary(min_size=0, max_size=300), max_size=40)


@settings(max_examples=300, deadline=None)
@given(chunks, st.integers(min_value=2, max_value=500))
def test_capped_buffer_keeps_head_and_tail_and_counts_all(parts, cap):
    buf = CappedBuffer(cap)
    for p in parts:
        buf.add(p)
    data = b"".join(parts)
    assert buf.total == len(data)
    assert len(buf.head) + len(buf.tail) <= cap
    if len(data) <= cap:
        assert not buf.truncated and buf.value() == data
    else:
        assert buf.truncated
        out = buf.value()
        assert out.startswith(data[: cap // 2]) and out.endswith(data[len(data) - (cap - cap // 2):])
        assert f"{len(data) - cap} bytes truncated".encode() in out


@settings(max_examples=300, deadline=None)
@given(chunks, st.integers(min_value=1, max_value=400), st.integers(min_value=0, max_value=3000))
def test_ring_log_cursors_return_exactly_the_new_bytes(parts, cap, cursor):
    log = RingLog(cap)
    for p in parts:
        log.add(p)
    data = b"".join(parts)
    assert log.end == len(data) and len(log.buf) <= cap
    got, new_cursor, lost = log.since(cursor)
    assert new_cursor == len(data)
    start = max(cursor, len(data) - len(log.buf))
    assert got == data[start:] if cursor <= len(data) else got == b""
    assert lost == max(0, (len(data) - len(log.buf)) - cursor)
