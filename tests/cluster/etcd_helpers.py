"""etcd operations only the tests need, on a connected :class:`pdcoord.etcd.EtcdClient`.

Masters and agents never delete keys by hand, list leases, compact or wait for etcd to come up, so
these stay out of the adapter. They reuse the client's channel and its error mapping (its private
``_c()`` and ``_errors()``) so a failure reads the same as one from the adapter.
"""

from __future__ import annotations

import asyncio
import time

from etcd3aio import prefix_range_end

from pdcoord.etcd import EtcdClient, EtcdUnavailable


async def delete(client: EtcdClient, key: str) -> bool:
    """Delete *key*; True if it existed."""
    with client._errors(f"delete {key}"):
        kv = client._c().kv
        assert kv is not None
        resp = await kv.delete(key, timeout=client.timeout)
    return int(resp.deleted) > 0


async def delete_prefix(client: EtcdClient, prefix: str) -> int:
    """Delete every key under *prefix*; returns how many were deleted."""
    if not prefix:
        raise ValueError("refusing to delete the empty prefix (the whole keyspace)")
    with client._errors(f"delete prefix {prefix}"):
        kv = client._c().kv
        assert kv is not None
        resp = await kv.delete(prefix, range_end=prefix_range_end(prefix), timeout=client.timeout)
    return int(resp.deleted)


async def list_leases(client: EtcdClient) -> list[int]:
    """IDs of every lease etcd holds (for leak checks)."""
    with client._errors("list leases"):
        lease = client._c().lease
        assert lease is not None
        resp = await lease.leases(timeout=client.timeout)
    return [int(x.ID) for x in resp.leases]


async def compact(client: EtcdClient, revision: int) -> None:
    """Drop the history before *revision* (watches from older revisions then get WatchCompacted)."""
    with client._errors(f"compact to {revision}"):
        kv = client._c().kv
        assert kv is not None
        await kv.compact(revision, physical=True, timeout=client.timeout)


async def wait_until_available(client: EtcdClient, timeout: float) -> None:
    """Poll ``client.status()`` until etcd answers; EtcdUnavailable after *timeout* seconds."""
    deadline = time.monotonic() + timeout
    while not await client.status():
        if time.monotonic() >= deadline:
            raise EtcdUnavailable(f"{client.where}: not reachable after {timeout:.1f} s")
        await asyncio.sleep(0.2)
