"""Link delay on one hop without kernel support: this machine's kernel has no `sch_netem`, so
`tc qdisc ... netem delay` answers "Specified qdisc kind is unknown". A DelayProxy sits between a
scheduler and a worker and holds every chunk of bytes for the delay (plus jitter) before passing
it on, in order, each way: a long link, without a cap on throughput. Used by bench/chaos.py and
tests/e2e/test_network_faults.py."""
from __future__ import annotations

import asyncio
import random
import threading
import time

from services.common.ports import free_port
from services.local.cluster import LocalCluster


class DelayProxy:
    """A TCP proxy on 127.0.0.1:`port` to 127.0.0.1:`target`; set `delay_s` and `jitter_s` at
    any time (0 passes bytes straight on). Runs its own event loop in a daemon thread."""

    def __init__(self, port: int, target: int):
        self.port, self.target = port, target
        self.delay_s, self.jitter_s = 0.0, 0.0
        self.held = 0             # chunks held back while a delay was set: proof the hop is proxied
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True, name=f"delay-proxy-{port}").start()
        if not ready.wait(10):
            raise RuntimeError(f"delay proxy on 127.0.0.1:{port} did not start")

    def set(self, delay_s: float, jitter_s: float = 0.0) -> None:
        self.delay_s, self.jitter_s = delay_s, jitter_s

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        ready.set()
        self.loop.run_forever()

    async def _serve(self, reader, writer) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:           # the worker is down: the scheduler sees a refused connection
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, upstream_writer), self._pipe(upstream_reader, writer),
                             return_exceptions=True)

    async def _pipe(self, reader, writer) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def send():
            while (item := await queue.get()) is not None:
                due, data = item
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = asyncio.create_task(send())
        last_due = 0.0
        try:
            while data := await reader.read(65536):
                self.held += self.delay_s > 0
                # never before the chunk ahead of it: jitter must not reorder a byte stream
                last_due = max(last_due, time.monotonic() + self.delay_s + random.uniform(0, self.jitter_s))
                queue.put_nowait((last_due, data))
        finally:
            queue.put_nowait(None)
            await sender


class ProxiedCluster(LocalCluster):
    """A local cluster where the workers named in `proxied` ((pool, index) pairs) listen on ports
    of their own, each behind a DelayProxy whose port is the worker's address in the config (the
    one its scheduler dials). A restarted worker listens on the same port again."""

    def __init__(self, config, proxied: list[tuple[str, int]], **kwargs):
        self.proxies: dict[str, DelayProxy] = {}
        for pool, index in proxied:
            proxy = DelayProxy(free_port(), free_port())
            config.pool(pool).workers[index].port = proxy.port
            self.proxies[self.worker_name(pool, index)] = proxy
        super().__init__(config, **kwargs)

    def start_worker(self, pool: str, index: int):
        proxy = self.proxies.get(self.worker_name(pool, index))
        if proxy is None:
            return super().start_worker(pool, index)
        return self._spawn(self.worker_name(pool, index), "worker", "--pool", pool, "--index", str(index),
                           "--port", str(proxy.target))
