"""PagedCache: keys and values in fixed-size blocks of one pool, shared between sequences.

Each layer stores (num_blocks, block_size, H_kv, D); a `BlockAllocator` (plain Python) says
which blocks each sequence (batch row) owns. Token p of a row lives in slot
`table[p // block_size] * block_size + p % block_size`. `begin` reserves a forward's blocks
(`forward`); `update` writes the new rows to their slots and gathers each row's visible keys
and values (whole blocks, right-padded to the longest row), with a mask that hides the padding.
Rows may hold different numbers of tokens: without an attention_mask each row appends at its own
length; padding columns of an HF-style attention_mask are not stored at all, so a row's token p
always sits at position p, and a prompt prefix cached in full blocks can be attached to a new row
instead of recomputed. `row_state` / `load_row_state` read a row out and put one back (prompt
cache files).

The gather copies every visible block once per layer and step (what a paged attention kernel
avoids by reading the blocks in place); a single row whose blocks are consecutive in the pool
(a fresh pool hands them out in order) is returned as a view, without a copy.

Modules: `cache` (PagedCache), `layer` (PagedLayer, one layer's block storage), `forward` (where
a forward's rows go, what it reads, its mask), `rows` (a row read out and put back, prefix costs,
prefill inputs), `storage` (the forward's Step, writes and gathers), `batch` (PagedBatch, a step
of many rows for the engine). The block tables are `kvcache.blocks`.
"""

from ..errors import OutOfBlocksError
from .batch import PagedBatch
from .cache import PagedCache
from .layer import PagedLayer
from .rows import RowState, attachable_blocks, prefill_inputs

__all__ = ["OutOfBlocksError", "PagedBatch", "PagedCache", "PagedLayer", "RowState", "attachable_blocks",
           "prefill_inputs"]
