"""Frames between the engine process and the server: whole messages out of whatever bytes arrived."""

from __future__ import annotations

import os
import select
import threading

from zipage.engine.api.frames import FrameReader, write_frame


def test_messages_larger_than_the_pipe_arrive_whole_and_in_order():
    r, w = os.pipe()
    messages = [list(range(n)) for n in (0, 5, 300_000, 7, 1_000_000)]  # megabytes, far past a pipe's buffer
    writer = threading.Thread(target=lambda: [write_frame(w, m) for m in messages])
    writer.start()
    reader, got = FrameReader(r), []
    while len(got) < len(messages):
        select.select([r], [], [])
        got += reader.read()  # never blocks, even in the middle of a message
    writer.join()
    assert got == messages
    os.close(w)
    select.select([r], [], [])
    assert reader.read() == [] and reader.eof
    os.close(r)


def test_a_partial_message_waits_for_the_rest():
    r, w = os.pipe()
    reader = FrameReader(r)
    write_frame(w, "first")
    data_r, data_w = os.pipe()
    write_frame(data_w, {"second": 2})
    frame = os.read(data_r, 1 << 16)
    os.write(w, frame[:5])
    assert reader.read() == ["first"]
    os.write(w, frame[5:])
    assert reader.read() == [{"second": 2}]
    for fd in (r, w, data_r, data_w):
        os.close(fd)
