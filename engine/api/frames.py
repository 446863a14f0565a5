"""Pickled messages over a pipe, each behind its length, read without ever blocking.

The engine process writes its turns with `write_frame` (a blocking write); the server reads them on
its event loop with `FrameReader`, which takes whatever bytes have arrived and returns the whole
messages among them. A reader that blocked on a half-arrived message would stall the event loop, and
event loops such as uvloop switch the descriptors they watch to non-blocking anyway.
"""

from __future__ import annotations

import os
import pickle
import struct

HEADER = struct.Struct("<Q")  # the length of the pickle that follows
READ_SIZE = 1 << 20


def write_frame(fd: int, message) -> None:
    data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


class FrameReader:
    """Whole messages from a descriptor switched to non-blocking mode; `eof` once the writer is gone."""

    def __init__(self, fd: int):
        self.fd = fd
        os.set_blocking(fd, False)
        self.buffer = bytearray()
        self.eof = False

    def read(self) -> list:
        while not self.eof:
            try:
                chunk = os.read(self.fd, READ_SIZE)
            except BlockingIOError:
                break
            if chunk:
                self.buffer += chunk
            else:
                self.eof = True
        messages, start, end = [], 0, len(self.buffer)
        with memoryview(self.buffer) as view:
            while end - start >= HEADER.size:
                (size,) = HEADER.unpack_from(view, start)
                if end - start - HEADER.size < size:
                    break
                start += HEADER.size
                messages.append(pickle.loads(view[start:start + size]))
                start += size
        del self.buffer[:start]
        return messages
