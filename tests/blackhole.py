"""A loopback TCP proxy a test owns, which it can turn into a black hole: `black_hole()` stops
forwarding in both directions and taking new connections without closing any socket (the kernel
still completes handshakes and acknowledges what is sent, as a middlebox or a hung server would),
`restore()` lets everything held so far through. What a client sees meanwhile is a peer that
never answers: no error, no reset, no EOF."""
from __future__ import annotations

import asyncio
import threading


class BlackHoleProxy:
    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="blackhole-proxy")
        self._flowing: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def __enter__(self) -> "BlackHoleProxy":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *_exc) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def black_hole(self) -> None:
        self._loop.call_soon_threadsafe(self._flowing.clear)

    def restore(self) -> None:
        self._loop.call_soon_threadsafe(self._flowing.set)

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        self._server.close()
        for writer in list(self._writers):
            writer.close()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._writers.add(client_writer)
        await self._flowing.wait()          # a connection made during the black hole waits for its end
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        self._writers.add(upstream_writer)
        await asyncio.gather(self._pipe(client_reader, upstream_writer),
                             self._pipe(upstream_reader, client_writer), return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._flowing.wait()
                data = await reader.read(65536)
                if not data:
                    break
                await self._flowing.wait()      # read as the black hole began: held with the rest
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()
            self._writers.discard(writer)
