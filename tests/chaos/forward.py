"""A TCP relay between a network namespace and this machine's loopback (F11's "services" host).

Run as ``python -m tests.chaos.forward NETNS ADDRESS PORT [PORT ...]``: it enters the named
network namespace (``ip netns add`` made it) only to open its listening sockets on
``ADDRESS:PORT`` there, comes back to its own namespace, and relays every connection it accepts
to ``127.0.0.1:PORT`` (the suite's private Postgres, Redis and API server). Worker "hosts" in
other namespaces reach the services at ``ADDRESS`` only through the veth links the test owns,
so cutting a link cuts that host off; nothing else is ever addressed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import socket
import sys

CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def listeners(netns: str, address: str, ports: list[int]) -> list[socket.socket]:
    """Listening sockets opened inside ``netns`` (they stay there after we leave it)."""
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    socks = []
    try:
        _setns(target)
        for port in ports:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, port))
            sock.listen(256)
            sock.setblocking(False)
            socks.append(sock)
    finally:
        _setns(home)
        os.close(home)
        os.close(target)
    return socks


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


def _relay(port: int):  # type: ignore[no-untyped-def]
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", port), 5
            )
        except (OSError, TimeoutError):
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    return handle


async def serve(socks: list[socket.socket], ports: list[int]) -> None:
    servers = [
        await asyncio.start_server(_relay(port), sock=sock)
        for sock, port in zip(socks, ports, strict=True)
    ]
    print("forwarding", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main() -> None:
    netns, address, *ports = sys.argv[1:]
    numbers = [int(p) for p in ports]
    asyncio.run(serve(listeners(netns, address, numbers), numbers))


if __name__ == "__main__":
    main()
