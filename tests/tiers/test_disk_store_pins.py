"""The disk tier's pins are counted (a saved conversation and --kv-pin may pin one block): a block
stays evicted last while any pin holds it, and is evicted as any other once the last is undone."""

from __future__ import annotations

from kvcache.tiers.disk_store import DiskBlockStore

SPACE = "0" * 32
VALUE = b"x" * 1000


def _key(index: int) -> str:
    return f"kvcache:{SPACE}:{index:032x}"


def _write(store: DiskBlockStore, indexes) -> None:
    for index in indexes:
        assert store.put(_key(index), lambda: VALUE)
    assert store.flush(10.0)


def test_a_block_pinned_twice_stays_until_both_pins_are_undone(tmp_path):
    store = DiskBlockStore(tmp_path, max_bytes=3 * len(VALUE))
    try:
        _write(store, [0])
        store.pin([_key(0)])
        store.pin([_key(0)])
        _write(store, [1, 2, 3])  # past the folder's size: the oldest unpinned go
        assert store.holds(_key(0)) and not store.holds(_key(1))
        store.unpin([_key(0)])
        _write(store, [4, 5, 6])
        assert store.holds(_key(0))  # (one pin still holds it)
        store.unpin([_key(0)])
        _write(store, [7, 8, 9])
        assert not store.holds(_key(0)) and store.holds(_key(9))
        store.unpin([_key(0)])  # (one too many: nothing held, nothing breaks)
    finally:
        store.close()
