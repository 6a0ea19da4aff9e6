"""Tiers of KV blocks asked in order, as one store: disk, then Redis (`kvcache serve --kv-disk DIR
--kv-store URL`). A read takes the leading run of blocks from the first tier that holds it, and
the rest of the run from the tiers below; a block found below is written into the tiers above it
(promoted). A write goes to every tier. Each tier keeps its own health and counters: one that is
down is skipped, and the run goes on in the next.
"""

from __future__ import annotations

from kvcache.tiers.block_store import BlockStore, block_bytes


class TieredStore(BlockStore):
    """`tiers`, highest first (each a `BlockStore`), read and written as one store."""

    kind = "tiered"

    def __init__(self, tiers: list[BlockStore]) -> None:
        if len(tiers) < 2:
            raise ValueError(f"a tiered store needs two tiers or more, got {len(tiers)}")
        self.tiers = list(tiers)
        names = " -> ".join(tier.name for tier in self.tiers)
        # its own reader; a read's time is each tier's in turn
        super().__init__(names, (), timeout_s=sum(tier.timeout_s for tier in self.tiers), retry_s=0.0,
                         max_pending=1)

    def available(self) -> bool:
        """Whether any tier may be asked now."""
        return any(tier.available() for tier in self.tiers)

    def writable(self) -> bool:
        """Whether any tier takes writes now."""
        return any(tier.writable() for tier in self.tiers)

    def _read_run(self, keys: list[str], value_bytes: int) -> list:
        values: list[bytes] = []
        for index, tier in enumerate(self.tiers):
            rest = keys[len(values) :]
            if not rest:
                break
            read = tier.start_read(rest, value_bytes)
            if read is None:  # down: the next tier may hold the run
                continue
            read.wait(tier.timeout_s)
            found = read.values() or []
            for key, value in zip(rest, found):
                for upper in self.tiers[:index]:  # promoted into the tiers above
                    upper.put(key, lambda value=value: bytes(block_bytes(value) or b""))
            values += found
        return values

    def put(self, key: str, make_value) -> bool:
        """Queue the block for every tier (built once, on the first tier's writer thread to
        need it); True when any tier took it."""
        built: list[bytes] = []

        def value() -> bytes:
            if not built:
                built.append(make_value())
            return built[0]

        return any([tier.put(key, value) for tier in self.tiers])

    def listen(self, listener) -> None:
        """Each tier tells `listener` of its own blocks, in its own medium."""
        for tier in self.tiers:
            tier.listen(listener)

    def pin(self, keys: list[str]) -> None:
        for tier in self.tiers:
            tier.pin(keys)

    def unpin(self, keys: list[str]) -> None:
        for tier in self.tiers:
            tier.unpin(keys)

    def discard(self, key: str) -> None:
        for tier in self.tiers:
            tier.discard(key)

    def stats(self) -> dict:
        """The tiered store's own counts (lookups, blocks used, refused), every tier's I/O summed,
        `up` while all tiers are, and each tier's counters under "tiers"."""
        own = vars(self.counters).copy()
        tiers = {tier.name: tier.stats() for tier in self.tiers}
        for name in ("found_blocks", "written_blocks", "written_bytes", "read_bytes", "dropped_blocks",
                     "errors", "read_round_trips", "write_batches", "outages"):
            own[name] = sum(counts[name] for counts in tiers.values())
        own["invalid_blocks"] += sum(counts["invalid_blocks"] for counts in tiers.values())
        own["up"] = all(counts["up"] for counts in tiers.values())
        return {**own, "tiers": tiers}

    def failure_count(self) -> int:
        return sum(tier.failure_count() for tier in self.tiers)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return all([tier.flush(timeout_s) for tier in self.tiers])

    def close(self) -> None:
        super().close()
        for tier in self.tiers:
            tier.close()
