"""The wire of this project's own TCP links: length-prefixed pickle frames over asyncio streams,
and the listening socket each link's server takes. Used by the replicas' direct streams
(chunkserve/replicas/direct_stream.py) and the routers' peer links (peers.py); each checks what
it reads against its own message types, and connections are admitted by a token first."""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from typing import Any

_LEN = struct.Struct("!I")  # a frame: its length, then the pickled message


def frame(msg: Any) -> bytes:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> Any:
    """The next frame's message; ConnectionError for a frame over max_bytes (its bytes unread)."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > max_bytes:
        raise ConnectionError(f"a frame of {n} bytes (at most {max_bytes})")
    return pickle.loads(await reader.readexactly(n))


def listening_socket(host: str, backlog: int) -> socket.socket:
    """A non-blocking TCP socket listening on host at a port of the system's choosing."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(backlog)
    sock.setblocking(False)
    return sock
