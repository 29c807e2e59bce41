"""The sans-IO half of the Redis store: its configuration, the Lua sources, and how each operation is encoded as
a script call and its reply decoded (shared by the synchronous and asyncio stores in :mod:`cpmemory.stores.redis_store`)."""
from __future__ import annotations

import functools
import json
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cpmemory.errors import (
    ReservationExpiredError,
    UnknownReservationError,
)
from cpmemory.stores.base import (
    DEFAULT_MAX_TRANSCRIPT_TURNS,
    ConversationKey,
    ConversationState,
    Reservation,
    ReserveRequest,
    SeenBlock,
    TurnRecord,
)
from cpmemory.stores.keys import DEFAULT_PREFIX, KeyScheme, check_prefix, decode_text, encode_text

SCRIPT_NAMES: tuple[str, ...] = ("reserve", "commit", "abort", "load", "decide")
_UNKNOWN, _EXPIRED = -1, -2


class RedisStoreConfig(BaseModel):
    """Settings of the Redis session store.

    Attributes:
        prefix: key prefix (1-64 of ``[A-Za-z0-9_.:-]``); one per deployment or test run.
        ttl_s: conversation time-to-live in seconds, refreshed on every call (0 = never expires).
        socket_timeout_s: per-command socket timeout of clients built by ``from_url`` / :meth:`client_kwargs`;
            past it the call fails with StoreUnavailableError and the facade serves the turn pass-through.
        connect_timeout_s: connect timeout of those clients (a refused connection fails at once; this bounds a
            black-holed host, and must leave room for a burst of new connections on a busy server).
        retries: redis-py retries of those clients; the direct runner retries a ``ConnectionError`` this many
            times, at least once (a stale pooled socket after a server restart).
        max_transcript_turns: turns kept per conversation; commit trims older ones in the same script, with the
            seen entries pointing into them (see cpmemory.stores.base, "Bounded transcript").
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefix: str = DEFAULT_PREFIX
    ttl_s: float = Field(default=24 * 3600.0, ge=0)
    socket_timeout_s: float = Field(default=0.2, gt=0)
    connect_timeout_s: float = Field(default=0.5, gt=0)
    retries: int = Field(default=1, ge=0, le=10)
    max_transcript_turns: int = Field(default=DEFAULT_MAX_TRANSCRIPT_TURNS, ge=1)

    @field_validator("prefix")
    @classmethod
    def _valid_prefix(cls, value: str) -> str:
        return check_prefix(value)

    def client_kwargs(self, *, asyncio: bool = False) -> dict[str, Any]:
        """Keyword arguments for a redis-py client honouring the timeouts and retries above (``asyncio``: for a
        ``redis.asyncio`` client, which takes its own ``Retry``)."""
        from redis.backoff import NoBackoff

        if asyncio:
            from redis.asyncio.retry import Retry
        else:
            from redis.retry import Retry  # type: ignore[assignment]

        return {
            "socket_timeout": self.socket_timeout_s,
            "socket_connect_timeout": self.connect_timeout_s,
            "retry": Retry(NoBackoff(), self.retries),
            "decode_responses": False,
        }


def load_script_sources() -> dict[str, str]:
    """Read the Lua scripts shipped with the package: ``{name: common.lua + name.lua}``. Reads files only."""
    folder = resources.files("cpmemory.stores").joinpath("lua")
    common = folder.joinpath("common.lua").read_text(encoding="utf-8")
    return {name: common + "\n" + folder.joinpath(f"{name}.lua").read_text(encoding="utf-8") for name in SCRIPT_NAMES}


def new_reservation_id() -> str:
    """A fresh, unguessable reservation id (24 hex characters)."""
    return secrets.token_hex(12)


def _json_bytes(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def _json_load(raw: bytes | str) -> Any:
    return json.loads(decode_text(raw))


def _encode_seen(label: str, block_id: str) -> bytes:
    """Seen payload ``<label byte length>:<label><block id>`` (commit.lua prepends ``<turn>:``)."""
    label_bytes = encode_text(label)
    return b"%d:%s%s" % (len(label_bytes), label_bytes, encode_text(block_id))


# A seen entry never changes once written (a later showing writes a new value), and a conversation's later turns
# read mostly the same ones: decoded entries are cached (decoding on every turn shows
# on the hot path).
@functools.lru_cache(maxsize=16_384)
def _decode_seen(content_hash: str, raw: bytes | str) -> SeenBlock:
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    turn, size, rest = data.split(b":", 2)
    cut = int(size)
    return SeenBlock(
        block_id=decode_text(rest[cut:]), content_hash=content_hash, label=decode_text(rest[:cut]), turn=int(turn)
    )


def _decode_path(raw: bytes | str | None) -> tuple[int, ...]:
    return tuple(_json_load(raw)) if raw else ()


def _decode_turns(entries: Sequence[Any]) -> tuple[tuple[dict[str, str], ...], tuple[int, ...]]:
    """Log entries (one JSON array of messages per turn) -> (messages, messages per turn)."""
    messages: list[dict[str, str]] = []
    sizes: list[int] = []
    for raw in entries:
        turn = _json_load(raw)
        turn = turn if isinstance(turn, list) else [turn]
        messages.extend(turn)
        sizes.append(len(turn))
    return tuple(messages), tuple(sizes)


def _pairs(flat: Sequence[Any]) -> Iterator[tuple[Any, Any]]:
    return zip(flat[0::2], flat[1::2])


@dataclass(frozen=True, slots=True)
class ScriptCall:
    """One script invocation: which script, its KEYS and its ARGV (sans-IO)."""

    script: str
    keys: tuple[str, ...]
    args: tuple[Any, ...]


class RedisSessionCodec:
    """Builds script calls and decodes replies; no IO, shared by the sync and async stores."""

    __slots__ = ("_key_names", "keys", "max_turns", "ttl_ms")

    def __init__(self, config: RedisStoreConfig) -> None:
        self.keys = KeyScheme(config.prefix)
        self.ttl_ms = round(config.ttl_s * 1000)
        self.max_turns = config.max_transcript_turns
        # Two blake2b digests per call add up on the hot path; recent conversations' key names are cached.
        self._key_names = functools.lru_cache(maxsize=4096)(self._names)

    def _names(self, key: ConversationKey) -> tuple[str, ...]:
        return self.keys.keys(key).all()

    def key_names(self, key: ConversationKey) -> tuple[str, ...]:
        """The Redis keys of one conversation (``KEYS`` of every script). Pure; cached."""
        return self._key_names(key)

    def reserve_call(self, key: ConversationKey, request: ReserveRequest, reservation_id: str) -> ScriptCall:
        """The reserve script call for ``request`` under the new ``reservation_id``."""
        seen_fields = ["s:" + content_hash for _, content_hash in request.blocks]
        id_fields = [b"i:" + encode_text(block_id) for block_id, _ in request.blocks]
        timeout_ms = max(1, round(request.reservation_timeout_s * 1000))
        window = -1 if not request.include_transcript else max(0, request.history_turns or 0)
        head = (self.ttl_ms, reservation_id, timeout_ms, window, "turns", "path")
        return ScriptCall("reserve", self._key_names(key), (*head, *seen_fields, *id_fields))

    def parse_reserve(self, reply: Sequence[Any], request: ReserveRequest, reservation_id: str) -> Reservation:
        """Decode the reserve reply into a Reservation restricted to the request's hashes and ids."""
        values, transcript_raw, start = reply
        count = len(request.blocks)
        seen: dict[str, SeenBlock] = {}
        previous: dict[str, str] = {}
        seen_values, previous_values = values[2 : 2 + count], values[2 + count :]
        for (block_id, content_hash), seen_value, previous_hash in zip(request.blocks, seen_values, previous_values):
            if seen_value is not None and content_hash not in seen:
                seen[content_hash] = _decode_seen(content_hash, seen_value)
            if previous_hash is not None:  # decode_text, inline (once per block, every turn)
                previous[block_id] = (previous_hash if isinstance(previous_hash, str)
                                      else previous_hash.decode("utf-8", "surrogatepass"))
        transcript = None
        sizes: tuple[int, ...] = ()
        if request.include_transcript:
            transcript, sizes = _decode_turns(transcript_raw or ())
        return Reservation(
            reservation_id=reservation_id,
            turn=int(values[0] or 0),
            seen=seen,
            previous_hash_for_id=previous,
            transcript=transcript,
            last_search_path=_decode_path(values[1]),
            transcript_start=int(start or 0),
            turn_sizes=sizes,
        )

    def commit_call(self, key: ConversationKey, reservation_id: str, record: TurnRecord) -> ScriptCall:
        """The commit script call making ``record`` durable under ``reservation_id``."""
        entry = _json_bytes([dict(message) for message in record.messages])
        shown: list[Any] = []
        names: list[bytes] = []
        for block in record.shown:
            payload = _encode_seen(block.label, block.block_id)
            id_field = b"i:" + encode_text(block.block_id)
            shown.extend(("s:" + block.content_hash, payload, id_field))
            names.extend((b"s:" + encode_text(block.content_hash), id_field))
        tail = (b"".join(b"%d:%s" % (len(name), name) for name in names), self.max_turns, max(0, record.trim_before))
        head = (
            self.ttl_ms,
            reservation_id,
            encode_text(key.tenant),
            encode_text(key.conversation),
            json.dumps(list(record.search_path), separators=(",", ":")),
        )
        return ScriptCall(
            "commit", self._key_names(key), (*head, 1, entry, len(record.shown), *shown, *tail)
        )

    @staticmethod
    def parse_commit(reply: Any, reservation_id: str) -> int:
        """Decode the commit reply: the turn number, or the typed error for an unknown / expired reservation."""
        turn = int(reply)
        if turn == _UNKNOWN:
            raise UnknownReservationError(f"unknown reservation {reservation_id!r} (never made, or released)")
        if turn == _EXPIRED:
            raise ReservationExpiredError(f"reservation {reservation_id!r} expired before commit; nothing recorded")
        return turn

    def abort_call(self, key: ConversationKey, reservation_id: str) -> ScriptCall:
        """The abort script call."""
        return ScriptCall("abort", self._key_names(key), (self.ttl_ms, reservation_id))

    def load_call(self, key: ConversationKey) -> ScriptCall:
        """The load script call (whole conversation)."""
        return ScriptCall("load", self._key_names(key), (self.ttl_ms,))

    @staticmethod
    def parse_load(reply: Sequence[Any]) -> ConversationState:
        """Decode the load reply into a ConversationState."""
        state_flat, log, paths, open_count = reply
        turns, seen, ids = 0, {}, {}
        for raw_field, value in _pairs(state_flat):
            field = decode_text(raw_field)
            if field.startswith("s:"):
                seen[field[2:]] = _decode_seen(field[2:], value)
            elif field.startswith("i:"):
                ids[field[2:]] = decode_text(value)
            elif field == "turns":
                turns = int(value)
        return ConversationState(
            turns=turns,
            seen=seen,
            ids=ids,
            transcript=_decode_turns(log)[0],
            search_paths=tuple(_decode_path(raw) for raw in paths),
            open_reservations=int(open_count),
        )
