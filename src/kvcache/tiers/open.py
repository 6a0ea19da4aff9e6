"""The store below the pool from what a user gave: a store object, a redis:// URL (`open_store`),
or `kvcache serve`'s --kv-disk folder and --kv-store URL (`open_tiers`). Each tier's module is
imported only when it is asked for."""

from __future__ import annotations

from kvcache.generation.params import RequestError


def open_tiers(disk=None, *, disk_bytes: int = 8 << 30, url: str | None = None, ttl_s: int = 3600):
    """The store below the pool for `kvcache serve --kv-disk DIR --kv-store URL`: a
    `DiskBlockStore` of `disk_bytes` in folder `disk`, Redis at `url`, both as one `TieredStore`
    (disk first), or None for neither. ValueError for a folder another process holds."""
    from kvcache.tiers.disk_store import DiskBlockStore
    from kvcache.tiers.tiered_store import TieredStore

    tiers = []
    if disk is not None:
        tiers.append(DiskBlockStore(disk, max_bytes=disk_bytes))
    if url is not None:
        tiers.append(open_store(url, ttl_s=ttl_s))
    return None if not tiers else tiers[0] if len(tiers) == 1 else TieredStore(tiers)


def open_store(store, **options):
    """A store object as given, or a `RedisBlockStore(url, **options)` for a redis:// (rediss://,
    unix://) URL; RequestError for any other string."""
    if not isinstance(store, str):
        return store
    if not store.startswith(("redis://", "rediss://", "unix://")):
        raise RequestError(f"kv_store must be a redis://HOST:PORT/DB URL, got {store!r}")
    from kvcache.tiers.redis_store import RedisBlockStore

    return RedisBlockStore(store, **options)
