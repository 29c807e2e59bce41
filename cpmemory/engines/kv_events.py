"""vLLM KV-cache events: decoding into small tagged structs and a ZMQ subscriber thread.

Wire format (vLLM 0.32, ``--kv-events-config '{"publisher": "zmq", ...}'``), one ZMQ multipart message per batch::

    [topic (bytes), sequence (8-byte big-endian unsigned), msgpack payload]
    payload = [timestamp, [event, ...], data_parallel_rank]      (rank omitted when unset)
    event   = {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., "token_ids": [...],
               "block_size": 128, "extra_keys": [...], "medium": "GPU", ...}
            | {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}
            | {"type": "AllBlocksCleared"}

Events may also arrive as arrays tagged by their type name (``["BlockRemoved", [hashes], "GPU"]``, the
msgspec array-like form); both are accepted. Unknown event types are skipped and counted, not errors.

Notes measured on the live server: events are published once per engine step, so an ``AllBlocksCleared``
caused by ``POST /reset_prefix_cache`` is only seen after the next request runs; a prefix-cache hit emits no
event. The sequence number counts batches; a jump means batches were dropped (the subscriber's high-water mark,
a reconnect, a publisher restart) and the mirror of the cache can no longer be trusted: the handler's
``handle_gap`` is called so it can resynchronise.

Error semantics: :func:`decode_frames` raises :class:`~cpmemory.errors.KVEventError` for a malformed frame.
The :class:`KVEventSubscriber` thread never dies of bad input: malformed frames and handler failures are counted
(see :class:`SubscriberStats`) and logged.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cpmemory.engines.block_hashes import normalize_event_hash
from cpmemory.errors import InvalidInputError, KVEventError, MissingDependencyError

logger = logging.getLogger(__name__)

BlockHashKey = int


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks newly stored in the engine's prefix cache, chained after ``parent_block_hash``."""

    block_hashes: tuple[BlockHashKey, ...]
    parent_block_hash: BlockHashKey | None
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple[Any, ...] | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from the engine's prefix cache."""

    block_hashes: tuple[BlockHashKey, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (``/reset_prefix_cache``, a restart of the cache)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published batch: its sequence number, timestamp, decoded events and unknown-type count."""

    sequence: int
    timestamp: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None
    skipped_events: int = 0


# Field order of the array-like (msgspec array_like=True) form, after the type tag.
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _as_mapping(raw: Any) -> dict[str, Any] | None:
    """Return the event as a field mapping with a "type" key, or None for an unknown type."""
    if isinstance(raw, dict):
        fields = {key.decode() if isinstance(key, bytes) else key: value for key, value in raw.items()}
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        names = _ARRAY_FIELDS.get(raw[0])
        if names is None:
            return None
        fields = dict(zip(names, raw[1:]))
        fields["type"] = raw[0]
    else:
        raise KVEventError(f"an event must be a map or a tagged array, got {type(raw).__name__}")
    kind = fields.get("type")
    if not isinstance(kind, str):
        raise KVEventError("an event has no string 'type' tag")
    return fields if kind in _ARRAY_FIELDS else None


def _hashes(value: Any, what: str) -> tuple[BlockHashKey, ...]:
    if not isinstance(value, (list, tuple)):
        raise KVEventError(f"{what} must be a list")
    try:
        return tuple(normalize_event_hash(item) for item in value)
    except InvalidInputError as error:
        raise KVEventError(f"{what}: {error}") from error


def decode_event(raw: Any) -> KVEvent | None:
    """Decode one msgpack-decoded event; None for an event type this module does not know.

    Raises:
        KVEventError: the event is malformed (missing or mistyped fields).
    """
    fields = _as_mapping(raw)
    if fields is None:
        return None
    kind = fields["type"]
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    hashes = _hashes(fields.get("block_hashes"), f"{kind}.block_hashes")
    medium = fields.get("medium")
    if kind == "BlockRemoved":
        return BlockRemoved(block_hashes=hashes, medium=medium)
    token_ids = fields.get("token_ids")
    block_size = fields.get("block_size")
    if not isinstance(token_ids, (list, tuple)) or not all(isinstance(token, int) for token in token_ids):
        raise KVEventError("BlockStored.token_ids must be a list of ints")
    if not isinstance(block_size, int) or block_size <= 0:
        raise KVEventError("BlockStored.block_size must be a positive int")
    parent = fields.get("parent_block_hash")
    extra = fields.get("extra_keys")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else _hashes([parent], "parent_block_hash")[0],
        token_ids=tuple(token_ids),
        block_size=block_size,
        extra_keys=tuple(extra) if isinstance(extra, (list, tuple)) else None,
        medium=medium,
    )


def _msgpack():
    try:
        import msgpack
    except ImportError as error:
        raise MissingDependencyError("engines", "msgpack") from error
    return msgpack


def decode_frames(frames: Sequence[bytes]) -> EventBatch:
    """Decode one multipart message ``[topic, sequence, payload]`` into an :class:`EventBatch`.

    Raises:
        KVEventError: wrong frame count, a sequence that is not 8 bytes, or an undecodable payload.
    """
    msgpack = _msgpack()

    if len(frames) != 3:
        raise KVEventError(f"expected 3 frames [topic, sequence, payload], got {len(frames)}")
    _topic, sequence_bytes, payload = frames
    if len(sequence_bytes) != 8:
        raise KVEventError(f"sequence frame must be 8 bytes, got {len(sequence_bytes)}")
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as error:
        raise KVEventError(f"payload is not valid msgpack: {error}") from error
    if not isinstance(batch, (list, tuple)) or len(batch) < 2 or not isinstance(batch[1], (list, tuple)):
        raise KVEventError("payload must be [timestamp, [events], data_parallel_rank?]")
    timestamp = batch[0]
    if not isinstance(timestamp, (int, float)):
        raise KVEventError("batch timestamp must be a number")
    rank = batch[2] if len(batch) > 2 and isinstance(batch[2], int) else None
    decoded = [decode_event(event) for event in batch[1]]
    events = tuple(event for event in decoded if event is not None)
    return EventBatch(
        sequence=int.from_bytes(sequence_bytes, "big"),
        timestamp=float(timestamp),
        events=events,
        data_parallel_rank=rank,
        skipped_events=len(decoded) - len(events),
    )


def encode_frames(batch: EventBatch, topic: str = "kv-events") -> list[bytes]:
    """Encode a batch in the wire format vLLM publishes (the inverse of :func:`decode_frames`; for tests, mocks)."""
    msgpack = _msgpack()

    events: list[dict[str, Any]] = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            events.append({"type": "BlockStored", "block_hashes": list(event.block_hashes),
                           "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                           "block_size": event.block_size, "lora_id": None, "medium": event.medium,
                           "lora_name": None,
                           "extra_keys": list(event.extra_keys) if event.extra_keys is not None else None})
        elif isinstance(event, BlockRemoved):
            events.append({"type": "BlockRemoved", "block_hashes": list(event.block_hashes),
                           "medium": event.medium})
        else:
            events.append({"type": "AllBlocksCleared"})
    payload = [batch.timestamp, events]
    if batch.data_parallel_rank is not None:
        payload.append(batch.data_parallel_rank)
    return [topic.encode(), batch.sequence.to_bytes(8, "big"), msgpack.packb(payload, use_bin_type=True)]


class KVEventHandler(Protocol):
    """Receives decoded batches (in sequence order) and gap notices from a subscriber."""

    def handle_batch(self, batch: EventBatch) -> None:
        """Apply one batch of events."""

    def handle_gap(self, expected: int, received: int) -> None:
        """Batches ``expected .. received-1`` were lost (or the publisher restarted): resynchronise."""


@dataclass(slots=True)
class SequenceTracker:
    """Detects gaps in batch sequence numbers. Mutates ``last``; O(1) per batch."""

    last: int | None = None

    def observe(self, sequence: int) -> int | None:
        """Record ``sequence``; return the expected number when it is not the successor of the last one.

        The first batch seen is never a gap (a subscriber joins a running stream). A sequence number that goes
        backwards (publisher restart) is reported as a gap too.
        """
        expected = None if self.last is None else self.last + 1
        self.last = sequence
        if expected is None or sequence == expected:
            return None
        return expected


@dataclass(slots=True)
class SubscriberStats:
    """Counters of a subscriber (read them from any thread; values are plain ints)."""

    batches: int = 0
    events: int = 0
    malformed_frames: int = 0
    skipped_events: int = 0
    gaps: int = 0
    handler_errors: int = 0
    last_error: str | None = field(default=None)


class FrameProcessor:
    """Decodes frames, tracks the sequence, and feeds a handler; the transport-free core of the subscriber.

    Not thread-safe: one thread feeds it (the subscriber's).
    """

    def __init__(self, handler: KVEventHandler) -> None:
        self.handler = handler
        self.stats = SubscriberStats()
        self._tracker = SequenceTracker()

    def process(self, frames: Sequence[bytes]) -> EventBatch | None:
        """Handle one multipart message; never raises. Returns the batch, or None when it was malformed."""
        try:
            batch = decode_frames(frames)
        except KVEventError as error:
            self.stats.malformed_frames += 1
            self.stats.last_error = str(error)
            logger.warning("dropping malformed KV-event frame: %s", error)
            return None
        try:
            expected = self._tracker.observe(batch.sequence)
            if expected is not None:
                self.stats.gaps += 1
                logger.warning("KV-event sequence gap: expected %d, got %d; resynchronising",
                               expected, batch.sequence)
                self.handler.handle_gap(expected, batch.sequence)
            self.handler.handle_batch(batch)
        except Exception as error:
            self.stats.handler_errors += 1
            self.stats.last_error = f"{type(error).__name__}: {error}"
            logger.exception("KV-event handler failed")
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.stats.skipped_events += batch.skipped_events
        return batch


SUBSCRIBE_SETTLE_S = 0.05
"""After the handshake, how long the subscription is given to reach the publisher before ``start`` returns (without
it, a burst published right after the handshake could still lose batches on a loaded machine; none with it)."""


class KVEventSubscriber:
    """A daemon thread that subscribes to one vLLM KV-event publisher (ZMQ SUB) and feeds a handler.

    No network activity happens before :meth:`start`. Stop it with :meth:`stop` (or use it as a context
    manager); stopping joins the thread within about ``poll_interval_s``.
    """

    def __init__(self, endpoint: str, handler: KVEventHandler, *, topic: str = "kv-events",
                 poll_interval_s: float = 0.1) -> None:
        """Args:
            endpoint: the publisher, e.g. ``tcp://127.0.0.1:5557`` (the server binds ``tcp://*:5557``).
            handler: receives batches and gap notices, on the subscriber thread.
            topic: the ZMQ topic prefix to subscribe to ("" for every topic).
            poll_interval_s: how often the thread checks for a stop request.
        """
        self.endpoint = endpoint
        self.topic = topic
        self.poll_interval_s = poll_interval_s
        self._processor = FrameProcessor(handler)
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def stats(self) -> SubscriberStats:
        """Live counters."""
        return self._processor.stats

    def start(self, connect_timeout_s: float = 5.0) -> KVEventSubscriber:
        """Start the thread and wait until the connection to the publisher is established (its ZMTP handshake
        done, so the subscription is on its way: a batch published after this returns is received), at most
        ``connect_timeout_s`` (a publisher not up yet is joined later, as ZMQ reconnects). Returns self.

        Without the wait, what the engine published before the subscription reached it (milliseconds, seconds when
        the machine is loaded) was lost without a gap to show for it: ZMQ's slow joiner. The proxy's views then missed the first prompts'
        blocks."""
        try:
            import zmq  # noqa: F401
        except ImportError as error:
            raise MissingDependencyError("engines", "pyzmq") from error
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name=f"kv-events {self.endpoint}", daemon=True)
        self._thread.start()
        if not self._connected.wait(connect_timeout_s):
            logger.warning("KV-event publisher %s not reached within %.0f s; its events flow once it is (ZMQ "
                           "reconnects)", self.endpoint, connect_timeout_s)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the thread to stop and join it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def __enter__(self) -> KVEventSubscriber:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        import zmq

        context: Any = zmq.Context.instance()
        socket = context.socket(zmq.SUB)
        monitor: Any = None
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.RCVHWM, 100_000)
            monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            socket.setsockopt_string(zmq.SUBSCRIBE, self.topic)
            socket.connect(self.endpoint)
            poller = zmq.Poller()
            poller.register(socket, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            timeout_ms = int(self.poll_interval_s * 1000)
            while not self._stop.is_set():
                ready = dict(poller.poll(timeout_ms))
                if monitor is not None and monitor in ready:  # connected: the subscription went out with the handshake
                    monitor.recv_multipart()
                    poller.unregister(monitor)
                    socket.disable_monitor()
                    monitor.close(0)
                    monitor = None
                    self._stop.wait(SUBSCRIBE_SETTLE_S)  # the subscription, sent after the handshake, reaches the publisher
                    self._connected.set()
                if socket in ready:
                    self._processor.process(socket.recv_multipart())
        except zmq.ZMQError as error:
            self.stats.last_error = f"ZMQError: {error}"
            logger.error("KV-event subscriber for %s stopped: %s", self.endpoint, error)
        finally:
            self._connected.set()
            if monitor is not None:
                monitor.close(0)
            socket.close(0)
