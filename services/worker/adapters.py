"""A worker's LoRA adapters at run time (Worker.LoadAdapter / UnloadAdapter): the worker reads the
files, so it is the one that decides which it may read, and it is the one that knows which
sequences its adapters serve.

- Only from `adapter_dirs` ([[pools.workers]] adapter_dirs; default: the folders of the pool's
  [[pools.adapters]]; none: loading at run time is refused). The path's real path (symlinks and
  `..` resolved, os.path.realpath) must lie inside one of them, else PERMISSION_DENIED naming the
  setting; the files are then read from that real path, so a link changed after the check cannot
  lead elsewhere. Files inside an allowed folder are read as they are: a link there is the
  operator's (a Hugging Face cache snapshot is made of them).
- Never under a sequence: replacing an adapter (same name, new weights) or unloading it while a
  sequence this worker holds uses it is refused (CONFLICT): that sequence's K/V and output so far
  came from the weights it started with. The scheduler refuses such reloads first
  (services/scheduler/pool_adapters.py); this holds for any caller.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from services.common.errors import ErrorKind, ServiceError, invalid
from services.common.proto.qos.v1 import worker_pb2
from services.engine.lora import AdapterError

log = logging.getLogger(__name__)

SETTING = "[[pools.workers]] adapter_dirs"


def allowed_folder(path: str, adapter_dirs: Sequence[str]) -> Path:
    """The real folder `path` names, if it lies inside one of `adapter_dirs`; else
    PERMISSION_DENIED naming the setting."""
    if not adapter_dirs:
        raise ServiceError(ErrorKind.PERMISSION_DENIED, f"this worker loads no adapters at run time: {SETTING} "
                           "is empty (it defaults to the folders of the pool's [[pools.adapters]]); list "
                           "the folders adapters may be loaded from", field="path", reason="adapter_dirs")
    real = os.path.realpath(os.path.expanduser(path))
    for folder in adapter_dirs:
        root = os.path.realpath(os.path.expanduser(folder))
        if os.path.commonpath([root, real]) == root:
            return Path(real)
    raise ServiceError(ErrorKind.PERMISSION_DENIED, f"{path} is not inside a folder this worker loads adapters "
                       f"from ({SETTING}: {', '.join(adapter_dirs)}; links and .. are resolved first)",
                       field="path", reason="adapter_dirs")


class WorkerAdapters:
    """The LoadAdapter / UnloadAdapter handlers over an engine, its sequence table, and the single
    engine thread (`executor`) where adapters join and leave between two steps."""

    def __init__(self, engine, table, executor, adapter_dirs: Sequence[str] = ()):
        self.engine, self.table, self.executor = engine, table, executor
        self.adapter_dirs = list(adapter_dirs)

    def users(self, name: str) -> int:
        return sum(1 for seq in list(self.table.sequences.values()) if seq.lora == name)

    def _refuse_in_use(self, name: str, doing: str) -> None:
        users = self.users(name)
        if users:
            raise ServiceError(ErrorKind.CONFLICT, f"LoRA adapter {name!r} is used by {users} sequence(s) on this "
                               f"worker; {doing} it once they finish", field="name", retry_after_ms=1000,
                               reason="adapter_in_use")

    async def load(self, request: worker_pb2.LoadAdapterRequest) -> worker_pb2.LoadAdapterReply:
        """Read and check on a helper thread (steps go on meanwhile), then put it on the device
        on the engine's thread, between two steps."""
        name, path = request.name.strip(), request.path.strip()
        if not name or not path:
            raise invalid("an adapter needs a name and a path (a PEFT adapter folder)",
                          field="name" if not name else "path")
        folder = allowed_folder(path, self.adapter_dirs)
        try:
            adapter = await asyncio.to_thread(self.engine.read_adapter, name, folder)
        except AdapterError as exc:
            raise invalid(str(exc), field="path") from None

        def add() -> list[str]:          # on the engine's thread, between two steps
            if name in self.engine.adapters:
                self._refuse_in_use(name, "reload")
            in_use = {seq.lora for seq in self.table.sequences.values() if seq.lora}
            return self.engine.add_adapter(adapter, in_use)
        try:
            dropped = await asyncio.get_running_loop().run_in_executor(self.executor, add)
        except AdapterError as exc:
            raise ServiceError(ErrorKind.EXHAUSTED, str(exc), field="name", retry_after_ms=5000,
                               reason="max_cpu_loras") from None
        log.info("LoRA adapter %s loaded from %s (rank %d, %s)%s", name, folder, adapter.rank,
                 ", ".join(adapter.targets), f"; dropped idle {', '.join(dropped)}" if dropped else "")
        return worker_pb2.LoadAdapterReply(adapter=adapter_info(adapter), dropped=dropped)

    async def unload(self, request: worker_pb2.UnloadAdapterRequest) -> worker_pb2.UnloadAdapterReply:
        name = request.name
        if name not in self.engine.adapters:
            raise ServiceError(ErrorKind.NOT_FOUND, f"LoRA adapter {name!r} is not loaded", field="name")

        def remove() -> None:            # on the engine's thread: no step admits a sequence meanwhile
            self._refuse_in_use(name, "unload")
            self.engine.remove_adapter(name)
        await asyncio.get_running_loop().run_in_executor(self.executor, remove)
        log.info("LoRA adapter %s unloaded", name)
        return worker_pb2.UnloadAdapterReply()


def adapter_info(adapter) -> worker_pb2.AdapterInfo:
    return worker_pb2.AdapterInfo(name=adapter.name, path=adapter.path, rank=adapter.rank,
                                  target_modules=adapter.targets)
