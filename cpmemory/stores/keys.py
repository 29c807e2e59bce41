"""Safe Redis key names for one conversation's state and one tenant's shared decision state.

Layout (``P`` is the configurable prefix, ``T`` and ``C`` are fixed-length hashes of the tenant and the
conversation id)::

    P:{T}:C:state    hash   "turns" -> committed turns; "path" -> last search path (JSON);
                            "tenant" / "conversation" -> the raw ids (inspection only);
                            "s:<content_hash>" -> "<turn>:<len(label)>:<label><block_id>"   (seen blocks)
                            "i:<block_id utf-8>" -> content hash                      (last hash per id)
                            "t:<turn>" -> the "s:" / "i:" fields that turn showed, length-prefixed (for trims)
    P:{T}:C:log      list   one entry per stored turn: its messages as a JSON array (the last LLEN turns)
    P:{T}:C:paths    list   search path of each stored turn (JSON)
    P:{T}:C:res      zset   open reservation id -> deadline (server ms)
    P:{T}:C:done     zset   committed reservation id -> turn; "x:<id>" -> turn at expiry (expired marker)
    P:{T}:ord3:*     one tenant's shared decision state (the online orderer's trie and counts; see decide.lua)

Seen blocks, ids and the counters share one hash so that ``reserve`` reads all it needs with one ``HMGET``
(every ``redis.call`` in a script costs a few microseconds). The hash tag is the tenant's: every key of one tenant,
its conversations' and its decision state's, sits in one Redis Cluster slot, so each Lua script touches a single
slot and a request's two script calls (its conversation's and its tenant's decisions) go to one node in one
round trip. Different tenants hash to different slots (and so spread over the cluster's nodes). Raw ids never
appear in key names: any string (braces, colons, ``*``, spaces, 1 KB, unicode, lone surrogates) maps to the same
32 hex characters. The tenant hash is part of every key, so no call made for one tenant can name another tenant's
keys. Pure module: no IO.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from cpmemory.errors import InvalidIdentifierError
from cpmemory.types import ConversationKey

DEFAULT_PREFIX = "cpm"
FIELDS: tuple[str, ...] = ("state", "log", "paths", "res", "done")
DECISION_FIELDS: tuple[str, ...] = ("trie", "meta", "freq", "reqs", "fifo")
_PREFIX_PATTERN = re.compile(r"[A-Za-z0-9_.:\-]{1,64}")
_HASH_BYTES = 16


def encode_text(value: str) -> bytes:
    """Encode an id or text for Redis, keeping lone surrogates (hostile ids) round-trippable. Pure."""
    return value.encode("utf-8", "surrogatepass")


def decode_text(value: bytes | str) -> str:
    """Inverse of :func:`encode_text`; accepts ``str`` from clients created with ``decode_responses=True``."""
    if isinstance(value, str):
        return value
    return value.decode("utf-8", "surrogatepass")


def _digest(kind: bytes, value: str) -> str:
    return hashlib.blake2b(encode_text(value), digest_size=_HASH_BYTES, person=kind).hexdigest()


def check_prefix(prefix: str) -> str:
    """Validate a key prefix: 1-64 characters of ``[A-Za-z0-9_.:-]`` (never a brace, so never a hash tag)."""
    if not isinstance(prefix, str) or not _PREFIX_PATTERN.fullmatch(prefix):
        raise InvalidIdentifierError(
            f"key prefix must be 1-64 characters of letters, digits, '_', '.', ':' or '-', got {prefix!r}"
        )
    return prefix


@dataclass(frozen=True, slots=True)
class ConversationKeys:
    """The Redis key names of one conversation, in the order the Lua scripts expect them (``KEYS[1..5]``)."""

    state: str
    log: str
    paths: str
    res: str
    done: str

    def all(self) -> tuple[str, ...]:
        """Every key, in ``FIELDS`` order (the ``KEYS`` contract of the Lua scripts)."""
        return (self.state, self.log, self.paths, self.res, self.done)


@dataclass(frozen=True, slots=True)
class KeyScheme:
    """Maps a ConversationKey to its key names under ``prefix``. Pure; O(len(ids))."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        check_prefix(self.prefix)

    @staticmethod
    def tag(tenant: str) -> str:
        """The hash tag (without braces) of every key of ``tenant``: the tenant's hash (one cluster slot). Pure."""
        return _digest(b"cpm-tenant", tenant)

    def keys(self, key: ConversationKey) -> ConversationKeys:
        """The key names of one conversation: ``P:{T}:C:<field>`` (the tenant's hash tag). Pure."""
        base = f"{self.prefix}:{{{self.tag(key.tenant)}}}:{_digest(b'cpm-conv', key.conversation)}:"
        return ConversationKeys(*(base + name for name in FIELDS))

    def decision_keys(self, tenant: str) -> tuple[str, ...]:
        """The keys of one tenant's shared decision state (``decide.lua``'s ``KEYS``), under the tenant's hash tag:
        ``P:{T}:ord3:trie|meta|freq|reqs|fifo`` (``ord3``: the version of decide.lua's layout; never 32 hex
        characters, so never a conversation's hash). Pure."""
        base = f"{self.prefix}:{{{self.tag(tenant)}}}:ord3:"
        return tuple(base + name for name in DECISION_FIELDS)

    def pattern(self) -> str:
        """A SCAN pattern matching every key under this prefix (for cleanup tools and tests)."""
        return f"{self.prefix}:{{*"
