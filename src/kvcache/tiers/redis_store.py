"""A second tier of KV blocks in Redis (or a server that speaks its protocol: Valkey, …), shared by
every replica that points at it.

Reads are bounded as a whole and never block a step: one pipelined round trip asks the size of
each of a prompt's block keys (STRLEN: 0 when absent, so a value of the wrong size is never read),
then MGETs of up to READ_BATCH_BYTES each fetch the leading run that holds blocks of the right
size (one MGET for a short prompt; a whole long one in one reply re-grew its buffer to the
prompt's size). They run on a reader thread, started when a request is queued (`start_read`);
its answer counts only if it came within `timeout_s` (a server that trickles its answer a byte
at a time keeps a socket read alive forever): past that the store counts as down.
Writes never block a request: they go to a bounded queue that a background thread drains in
batches (pipelined SET with a TTL); when the queue is full, blocks are dropped and counted.

The store is an optimisation, never a dependency: any error marks it down for a while
(`block_store.BlockStore`, which holds the threads, the queue and the counters).
"""

from __future__ import annotations

from kvcache.tiers.block_store import BlockStore

READ_BATCH_BYTES = 16 << 20  # values fetched by one MGET at most


class RedisBlockStore(BlockStore):
    """Blocks under string keys in one Redis database at `url` (redis://host:port/db).

    Args:
        url: where the server is; its client is the `redis` package (`pip install redis`).
        ttl_s: seconds a written block lives (refreshed by nothing: a block read back is simply
            rewritten when its absence is noticed).
        timeout_s: the socket timeout of every call (connect included), and the most a read
            (all its round trips) may take to count.
        retry_s: how long an error keeps the store out of use.
        max_pending: blocks queued for writing before new ones are dropped.
    """

    kind = "redis"
    medium = "REDIS"  # (a block its TTL expires goes unannounced: Redis tells no one)

    def __init__(self, url: str, *, ttl_s: int = 3600, timeout_s: float = 0.5, retry_s: float = 2.0,
                 max_pending: int = 512) -> None:
        try:
            import redis
        except ImportError as error:  # pragma: no cover - an install without the extra
            raise ImportError(
                "a Redis KV store needs the redis client: pip install 'kvcache[redis]'"
            ) from error
        if ttl_s < 1:
            raise ValueError(f"need ttl_s >= 1, got {ttl_s}")
        self.url, self.ttl_s = url, ttl_s
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
        )
        super().__init__(url, (redis.RedisError, OSError), timeout_s=timeout_s, retry_s=retry_s,
                         max_pending=max_pending)

    def _read_run(self, keys: list[str], value_bytes: int) -> list:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.strlen(key)
        sizes = pipe.execute()
        run = next((index for index, size in enumerate(sizes) if size != value_bytes), len(keys))
        if run < len(keys) and sizes[run]:
            self.counters.invalid_blocks += 1  # present, of another size: never read
        self.counters.read_round_trips += 1
        step = max(1, READ_BATCH_BYTES // max(1, value_bytes))
        values: list = []
        for start in range(0, run, step):  # (one reply of a whole long prompt: its buffer re-grown)
            values += self._client.mget(keys[start : min(run, start + step)])
            self.counters.read_round_trips += 1
        return values

    def _write(self, batch: list[tuple[str, bytes]]) -> int:
        pipe = self._client.pipeline(transaction=False)
        for key, value in batch:
            pipe.set(key, value, ex=self.ttl_s)
        pipe.execute()
        return sum(len(value) for _, value in batch)

    def close(self) -> None:
        """Stop the writer (queued blocks are dropped) and close the connection."""
        super().close()
        self._client.close()
