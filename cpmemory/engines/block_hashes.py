"""Reproduce vLLM's chained prefix-cache block hashes offline.

vLLM (v1, 0.32) names every full KV block of a prompt by a hash chained over the whole prefix::

    hash_0 = H((NONE_HASH, tokens[0:B], extra_0))
    hash_i = H((hash_{i-1}, tokens[i*B:(i+1)*B], extra_i))

where ``B`` is the block size (``/metrics`` ``vllm:cache_config_info{block_size=...}``), ``H`` is the configured
``prefix_caching_hash_algo`` and ``NONE_HASH = H("vllm-none-hash")`` (or ``H(PYTHONHASHSEED)`` when the server
has that variable set). ``extra_i`` is ``None`` unless the request has a LoRA adapter, multi-modal inputs or a
``cache_salt``; a cache salt adds ``(("cache_salt", salt),)`` to the first block only. Only full blocks are
hashed. KV events publish each hash as the low 64 bits of the digest (an unsigned int, big endian), unless the
server runs with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` (then the raw digest bytes).

``sha256`` serialises with :mod:`pickle` (highest protocol) and ``sha256_cbor`` with canonical CBOR. The CBOR
encoder here covers exactly the value shapes a hash key can take (bytes, str, int, None, tuples), so no CBOR
package is needed. The real-engine suite checks the result against live ``BlockStored`` events.

Everything here is pure (no IO); the cost is one SHA-256 per block of ``block_size`` tokens.
"""
from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from cpmemory.errors import InvalidInputError

HashAlgorithm = Literal["sha256", "sha256_cbor"]
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_LOW_64_BITS = (1 << 64) - 1


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _cbor_head(major: int, argument: int) -> bytes:
    """Encode a CBOR item head in its shortest form (canonical CBOR, RFC 8949 section 4.2.1)."""
    if argument < 24:
        return bytes([major << 5 | argument])
    for additional, size, fmt in ((24, 1, ">B"), (25, 2, ">H"), (26, 4, ">I"), (27, 8, ">Q")):
        if argument < 1 << (8 * size):
            return bytes([major << 5 | additional]) + struct.pack(fmt, argument)
    raise InvalidInputError(f"integer too large for CBOR: {argument}")


def cbor_encode(value: Any) -> bytes:
    """Canonical CBOR for the value shapes of a block-hash key (bytes, str, int, None, bool, tuple/list).

    Raises:
        InvalidInputError: for any other type (floats, dicts, objects never occur in a hash key).
    """
    if value is None:
        return b"\xf6"
    if value is True or value is False:
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        encoded = value.encode("utf-8")
        return _cbor_head(3, len(encoded)) + encoded
    if isinstance(value, (tuple, list)):
        return _cbor_head(4, len(value)) + b"".join(cbor_encode(item) for item in value)
    raise InvalidInputError(f"cannot CBOR-encode a {type(value).__name__} in a block-hash key")


def _sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor_encode(value)).digest()


_HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {"sha256": _sha256_pickle, "sha256_cbor": _sha256_cbor}
SUPPORTED_ALGORITHMS = frozenset(_HASH_FUNCTIONS)


def external_hash(digest: bytes) -> int:
    """The form a KV event carries by default: the low 64 bits of the digest as an unsigned int."""
    return int.from_bytes(digest, "big") & _LOW_64_BITS


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Computes the block hashes a vLLM server assigns to a token sequence.

    Attributes:
        block_size: tokens per KV block (128 on the CPU backend).
        algorithm: the server's ``prefix_caching_hash_algo`` ("sha256" by default).
        none_hash_seed: the seed of the chain's root; the server's PYTHONHASHSEED when it sets one.
    """

    block_size: int
    algorithm: HashAlgorithm = "sha256"
    none_hash_seed: str = DEFAULT_NONE_HASH_SEED

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise InvalidInputError(f"block_size must be a positive int, got {self.block_size!r}")
        if self.algorithm not in _HASH_FUNCTIONS:
            raise InvalidInputError(
                f"unsupported hash algorithm {self.algorithm!r}; supported: {sorted(_HASH_FUNCTIONS)}"
            )

    def chain(self, parent: bytes | None, block_token_ids: Sequence[int], *,
              cache_salt: str | None = None) -> bytes:
        """Digest of one full block after ``parent`` (None: the first block of a prompt).

        ``cache_salt`` only applies to a first block, exactly as in vLLM.
        """
        hash_function = _HASH_FUNCTIONS[self.algorithm]
        if parent is None:
            parent = hash_function(self.none_hash_seed)
            extra = (("cache_salt", cache_salt),) if cache_salt else None
        else:
            extra = None
        return hash_function((parent, tuple(int(token) for token in block_token_ids), extra))

    def digests(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> list[bytes]:
        """Raw digests of every full block of ``token_ids``, in prompt order. O(len(token_ids))."""
        result: list[bytes] = []
        parent: bytes | None = None
        for index in range(len(token_ids) // self.block_size):
            start = index * self.block_size
            parent = self.chain(parent, token_ids[start:start + self.block_size], cache_salt=cache_salt)
            result.append(parent)
        return result

    def hashes(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> list[int]:
        """Block hashes as KV events publish them (low 64 bits, unsigned), in prompt order."""
        return [external_hash(digest) for digest in self.digests(token_ids, cache_salt=cache_salt)]


def normalize_event_hash(value: Any) -> int:
    """Map a hash from a KV event (int, or raw digest bytes) to the 64-bit int form used as a key.

    Raises:
        InvalidInputError: when the value is neither an int nor bytes.
    """
    if isinstance(value, bool):
        raise InvalidInputError("a block hash cannot be a bool")
    if isinstance(value, int):
        return value & _LOW_64_BITS
    if isinstance(value, (bytes, bytearray)):
        return external_hash(bytes(value))
    raise InvalidInputError(f"a block hash must be an int or bytes, got {type(value).__name__}")
