"""The pool's block events for routers that score replicas by the KV blocks they hold (llm-d's
precise prefix scorer, NVIDIA Dynamo's KV router), in vLLM's format, so they route to kvcache
replicas unchanged.

Wire: a ZeroMQ PUB socket, bound at the endpoint (subscribers connect to the replica) or
connected to it (a router's indexer binds one SUB socket that every replica connects to, as
llm-d's does); each message is three frames, [topic, sequence number (8 bytes,
big-endian, from 0), payload]; the payload is a msgpack array [timestamp (s), [events]], an event
an array whose first element names it:
    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]
A block hash is the first 8 bytes of kvcache's 16-byte chained digest as an integer below 2**63;
parent_block_hash is None for a sequence's first block; lora_id is None. medium says where the
blocks are: "CPU" for the pool (it lives in host memory), "DISK" and "REDIS" for the tiers below
it (`kvcache.tiers`), so a router can weigh a replica's hits by tier. One batch per engine step
that changed what the pool can find; AllBlocksCleared first (a restarted replica holds nothing)
and last (one that stops). A tier's events go out as their own batch when its thread reports
them: BlockStored when a write lands (a demotion: kvcache writes a block to its tiers once it is
whole, so this comes before the pool evicts it, whose BlockRemoved "CPU" follows; or a promotion
of a block a read found in Redis into the disk tier), BlockRemoved when the tier evicts or
deletes it (a Redis key its TTL expires goes unannounced); a disk folder's blocks from before
a restart are BlockStored "DISK" when the engine starts. A block loaded from a tier into the
pool (a promotion) is BlockStored "CPU" when it becomes findable there, as a computed one is. A
tier's BlockStored carries its parent and tokens when this replica wrote the block, else None and
no tokens (as vLLM's offloading connector sends its blocks).

Replay (optional, vLLM's replay endpoint): a ROUTER socket bound at a second endpoint keeps the
last `replay_batches` batches; a subscriber that sees a gap in the sequence numbers sends the
first number it missed (8 bytes, big-endian; from a DEALER socket: a REQ socket takes only the
first message of an answer) and is answered, on the same connection, with one message [empty
delimiter, sequence number, payload] per kept batch from that number on, then [empty delimiter,
2**64 - 1 (-1 as a signed number), empty payload] to say the replay is over. A request that is
not 8 bytes gets the end marker alone. One request is answered between two published batches, and
a subscriber that does not read an answer as fast as it comes (its queue full) loses the rest of
that answer, end marker included: it asks again.
"""

from __future__ import annotations

import os
import queue
import re
import stat
import threading
import time
from collections import deque

from kvcache.engine.observers import StepObserver

#: what --kv-events accepts: a ZeroMQ endpoint to bind or connect to
ENDPOINT = re.compile(r"^(tcp://(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.*-]+):\d{1,5}|ipc://.+)$")
MEDIUM = "CPU"
REPLAY_BATCHES = 10_000  # the batches a replay socket keeps (vLLM's default buffer)
REPLAY_END = (2**64 - 1).to_bytes(8, "big")  # -1 as a signed 64-bit number: the replay is over
_REPLAY_POLL_S = 0.02  # how long the sending thread waits for a batch before it looks for requests
_STOP = object()


def external_hash(digest: bytes) -> int:
    """A block's hash as routers read it: the digest's first 8 bytes, big-endian, below 2**63
    (a signed 64-bit integer in any decoder)."""
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def check_endpoint(endpoint: str, flag: str = "--kv-events") -> str:
    """`endpoint` when it is tcp://HOST:PORT with a port from 1 to 65535, or ipc://PATH where
    nothing is or a socket is; ValueError naming `flag` and what was given. (libzmq takes a port
    modulo 65536 and 0 as any free port, and unlinks what is at PATH before binding there.)"""
    if not isinstance(endpoint, str) or not ENDPOINT.match(endpoint):
        raise ValueError(f"{flag} must be a ZeroMQ endpoint, tcp://HOST:PORT or ipc://PATH; "
                         f"got {endpoint!r}")
    if endpoint.startswith("tcp://"):
        port = int(endpoint.rpartition(":")[2])
        if not 1 <= port <= 65535:
            raise ValueError(f"{flag}: the port must be from 1 to 65535, got {port} ({endpoint})")
        return endpoint
    path = endpoint[len("ipc://"):]
    if path.startswith("@"):  # (Linux's abstract namespace: no file)
        return endpoint
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return endpoint
    except OSError as error:
        raise ValueError(f"{flag}: cannot look at {endpoint}: {error.strerror}") from None
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"{flag}: {endpoint} exists and is not a socket (binding there would delete "
                         "it); give a path where nothing is")
    return endpoint


class KVEventPublisher(StepObserver):
    """Checks `endpoint` and that pyzmq and msgpack are installed (ValueError naming the flag),
    then binds a PUB socket at `endpoint` now (a taken port is an OSError here, not later), or with
    `connect` connects it to a subscriber that binds there, and sends batches from a thread of its
    own. As the pool's `BlockListener` it only collects (the step calls `stored` and `removed`);
    `flush` hands the step's events to the sending thread.

    topic: the first frame of every message (vLLM's default is empty; llm-d's scorer subscribes
    to a topic of its own, e.g. kv@POD@MODEL). replay: an endpoint to bind the replay socket at
    (module docstring), keeping the last `replay_batches` batches; None: no replay."""

    def __init__(self, endpoint: str, topic: str = "", *, connect: bool = False, replay: str | None = None,
                 replay_batches: int = REPLAY_BATCHES) -> None:
        check_endpoint(endpoint)
        if replay is not None:
            check_endpoint(replay, "--kv-events-replay")
        try:
            import msgpack
            import zmq
        except ImportError:
            raise ValueError("--kv-events needs pyzmq and msgpack: pip install 'kvcache[events]'") from None
        self.endpoint, self.topic = endpoint, topic.encode()
        self.block_size = 0  # set by `attach`
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._context = zmq.Context()
        self._replay = None
        try:
            # (at close, a second to send what is queued)
            self._socket = self._open(zmq.PUB, endpoint, connect, "--kv-events", {zmq.LINGER: 1000})
            if replay is not None:  # (a whole replay fits in the queue: none of it dropped)
                self._replay = self._open(zmq.ROUTER, replay, False, "--kv-events-replay",
                                          {zmq.SNDHWM: replay_batches + 1, zmq.ROUTER_MANDATORY: 1})
        except OSError:
            self._context.destroy(0)
            raise
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=replay_batches)  # (number, payload)
        self.batches = 0  # batches flushed: their sequence numbers are 0 .. batches - 1
        self._pending: list[list] = []
        self._collecting = threading.Lock()  # the step's events and the tiers' (their own threads)
        self._batches: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._send, name="kvcache-kv-events", daemon=True)
        self._thread.start()
        self.cleared()
        self.flush()

    def _open(self, kind: int, endpoint: str, connect: bool, flag: str, options: dict | None = None):
        """A socket of `kind` with these options, bound at (or connected to) `endpoint`; OSError
        naming `flag`."""
        import zmq

        socket = self._context.socket(kind)
        for option, value in (options or {}).items():
            socket.setsockopt(option, value)
        try:
            (socket.connect if connect else socket.bind)(endpoint)
        except zmq.ZMQError as error:
            socket.close(0)
            verb = "connect to" if connect else "bind"
            raise OSError(f"{flag}: cannot {verb} {endpoint}: {error}") from None
        return socket

    def attach(self, allocator, connector=None) -> None:
        """Follow `allocator` (a `kvcache.blocks.BlockAllocator`): its blocks' events are ours;
        and `connector`'s tiers (a `kvcache.tiers.connector.KVConnector`), in their media."""
        self.block_size = allocator.block_size
        allocator.listener = self
        if connector is not None:
            connector.listen(self)

    # ---- the allocator's listener (and the tiers', with their medium) -----------------------------
    def stored(self, digests: list[bytes], parent: bytes | None, token_ids: list[int], *,
               medium: str = MEDIUM) -> None:
        """BlockStored for the chain `digests` (see `BlockListener.stored`) in `medium`."""
        with self._collecting:
            self._pending.append([
                "BlockStored", [external_hash(d) for d in digests],
                None if parent is None else external_hash(parent), token_ids, self.block_size, None, medium,
            ])

    def removed(self, digest: bytes, *, medium: str = MEDIUM) -> None:
        """BlockRemoved for `digest` in `medium`, merged into the previous event when that removed
        blocks of the same medium too."""
        with self._collecting:
            last = self._pending[-1] if self._pending else None
            if last is not None and last[0] == "BlockRemoved" and last[2] == medium:
                last[1].append(external_hash(digest))
            else:
                self._pending.append(["BlockRemoved", [external_hash(digest)], medium])

    def cleared(self) -> None:
        """AllBlocksCleared: a router forgets every block of this replica."""
        with self._collecting:
            self._pending.append(["AllBlocksCleared"])

    # ---- sending ---------------------------------------------------------------------------------
    def flush(self) -> None:
        """Hand the events collected since the last flush to the sending thread, as one batch
        (from the engine's thread at the end of a step, or a tier's thread after its write)."""
        with self._collecting:
            if self._pending:
                events, self._pending = self._pending, []
                self._batches.put(self._pack([time.time(), events]))
                self.batches += 1

    def step_ended(self) -> None:
        """An engine step is over: the blocks it made findable or evicted go out as one batch."""
        self.flush()

    def _send(self) -> None:
        """The sending thread: every batch published in order (and kept for replay); between
        batches, replay requests answered. The only user of the sockets."""
        sequence, wait = 0, None if self._replay is None else _REPLAY_POLL_S
        while True:
            try:
                payload = self._batches.get(timeout=wait)
            except queue.Empty:
                payload = None
            if payload is _STOP:
                return
            if payload is not None:
                self._socket.send_multipart([self.topic, sequence.to_bytes(8, "big"), payload])
                if self._replay is not None:
                    self._kept.append((sequence, payload))
                sequence += 1
            if self._replay is not None:
                self._answer_replay()

    def _answer_replay(self) -> None:
        """Answer one waiting replay request, if any (module docstring): the kept batches from the
        number asked for, then the end marker; never blocks (a full queue or a client gone ends
        that answer)."""
        import zmq

        if not self._replay.poll(0):
            return
        frames = self._replay.recv_multipart()
        client, asked = frames[0], frames[-1]
        answer = []
        if len(frames) >= 2 and len(asked) == 8:
            first = int.from_bytes(asked, "big")
            answer = [(n.to_bytes(8, "big"), payload) for n, payload in self._kept if n >= first]
        try:
            for number, payload in [*answer, (REPLAY_END, b"")]:
                self._replay.send_multipart([client, b"", number, payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # (its queue is full, or it left: it asks again)
            return

    def close(self) -> None:
        """Publish AllBlocksCleared (this replica's blocks go away with it), then close."""
        if not self._thread.is_alive():
            return
        self.cleared()
        self.flush()
        self._batches.put(_STOP)
        self._thread.join(5.0)
        self._socket.close()
        if self._replay is not None:
            self._replay.close(0)
        self._context.term()
