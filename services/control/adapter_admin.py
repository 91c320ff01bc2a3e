"""Loading and unloading LoRA adapters at run time, from the router: `POST /v1/load_lora_adapter`
and `/v1/unload_lora_adapter` (vLLM's endpoints and body: `lora_name`, `lora_path`; ours adds an
optional `pool`). The router asks each target pool's scheduler (Scheduler.LoadAdapter), which
loads on every worker of the pool and on workers that join later; then it waits for its own pool
cache to show the change, so the next request naming the adapter is routed by it. A worker loads
only from its adapter_dirs (services/worker/adapters.py: it reads the files, so it decides; 403
naming the setting), and a pool's scheduler refuses a reload while requests use the adapter
(services/scheduler/pool_adapters.py: 409 naming it)."""
from __future__ import annotations

import asyncio
import time
from typing import Protocol

import grpc

from services.common.errors import ErrorKind, ServiceError, invalid
from services.common.grpc_errors import error_from_rpc
from services.common.proto.qos.v1 import worker_pb2

CACHE_WAIT_S = 3.0


class PoolDirectory(Protocol):
    """What this module reads of the router's pools (services/router/pools.py satisfies it): each
    pool's handle (name, scheduler stub, peer, metadata: the cluster token), and the adapters its
    cached stats show."""
    handles: dict

    def adapter_names(self) -> set[str]: ...


def _targets(pools: PoolDirectory, pool: str | None):
    if pool is None:
        return list(pools.handles.values())
    if pool not in pools.handles:
        raise invalid(f"no pool named {pool!r}; pools: {', '.join(pools.handles)}", field="pool")
    return [pools.handles[pool]]


def _fields(body: dict, *names: str) -> list[str]:
    values = []
    for name in names:
        value = body.get(name)
        if not isinstance(value, str) or not value.strip():
            raise invalid(f"{name} must be a non-empty string", field=name)
        values.append(value.strip())
    pool = body.get("pool")
    if pool is not None and not isinstance(pool, str):
        raise invalid("pool must be a pool's name", field="pool")
    return values


async def _until_cached(pools: PoolDirectory, name: str, present: bool) -> None:
    deadline = time.monotonic() + CACHE_WAIT_S
    while (name in pools.adapter_names()) != present and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def load(pools: PoolDirectory, body: dict) -> dict:
    name, path = _fields(body, "lora_name", "lora_path")
    handles = _targets(pools, body.get("pool"))
    loaded, errors = {}, []
    for handle in handles:
        try:
            reply = await handle.scheduler.LoadAdapter(worker_pb2.LoadAdapterRequest(name=name, path=path),
                                                       timeout=180, metadata=handle.metadata)
            loaded[handle.name] = {"adapters": [a.name for a in reply.adapters], "missing_on": list(reply.missing_on)}
        except grpc.aio.AioRpcError as exc:
            errors.append(error_from_rpc(exc, handle.peer))
    if not loaded:
        raise errors[0]
    await _until_cached(pools, name, present=True)
    return {"object": "lora_adapter", "lora_name": name, "lora_path": path, "pools": loaded,
            "failed": {h.name: e.message for h, e in zip([h for h in handles if h.name not in loaded], errors)}}


async def unload(pools: PoolDirectory, body: dict) -> dict:
    (name,) = _fields(body, "lora_name")
    handles = [h for h in _targets(pools, body.get("pool"))
               if h.stats is not None and name in h.stats.adapters]
    if not handles:
        raise ServiceError(ErrorKind.NOT_FOUND, f"LoRA adapter {name!r} is not loaded in any pool",
                           field="lora_name", reason="unknown_adapter")
    unloaded = {}
    for handle in handles:
        try:
            reply = await handle.scheduler.UnloadAdapter(worker_pb2.UnloadAdapterRequest(name=name), timeout=60,
                                                         metadata=handle.metadata)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, handle.peer) from None
        unloaded[handle.name] = {"adapters": [a.name for a in reply.adapters]}
    await _until_cached(pools, name, present=False)
    return {"object": "lora_adapter", "lora_name": name, "pools": unloaded}
