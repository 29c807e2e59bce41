"""The ContextPilot distance between two contexts, scalar and vectorised.

For contexts ``C_i`` and ``C_j`` (sequences of block keys, first occurrence of a key wins) with shared blocks
``S = C_i ∩ C_j`` and ``p_i(k)`` the position of block ``k`` in ``C_i``::

    d_ij = 1 - |S| / max(|C_i|, |C_j|) + alpha * sum_{k in S} |p_i(k) - p_j(k)| / |S|      if S is not empty
    d_ij = 1                                                                                  otherwise

Overlap dominates; the position term only breaks ties (alpha defaults to 0.001).

The vectorised functions work on an :class:`EncodedContexts` (block keys mapped to dense ints, CSR layout) so the
batch build never loops in Python per pair:

* :func:`condensed_distances` computes the full condensed matrix (the input of scipy's ``linkage``) in row blocks:
  for a block of rows it fills a lookup table ``row x block -> position + 1``, gathers it at every (context, slot)
  of the batch and reduces per context with cumulative sums. O(N * nnz) work, O(N^2) memory for the result.
* :func:`pair_distances` computes the exact distance for an explicit list of pairs (the sparse build above the
  exact-linkage size): a sorted ``context * V + block`` key array answers "position of block b in context j" by
  binary search. O(P * K log nnz) for P pairs of contexts of K blocks.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_ALPHA = 0.001
_ROW_BLOCK_ELEMENTS = 4_000_000
_SMALL_CONTEXT = 32  # contexts up to this many blocks use the K x K comparison in pair_distances  # gathered int32 cells per row block (bounds the temporary memory to ~16 MB each)


def unique_keys(context: Iterable[Hashable]) -> list[Hashable]:
    """Return ``context`` without repeated keys, keeping the first (best-ranked) occurrence. O(len)."""
    return list(dict.fromkeys(context))


def context_distance(a: Sequence[Hashable], b: Sequence[Hashable], alpha: float = DEFAULT_ALPHA) -> float:
    """Return the paper's distance between two contexts (pure, O(|a| + |b|)).

    Repeated keys inside a context are ignored after their first occurrence. Two empty contexts share nothing and
    are at distance 1.
    """
    pos_a = {key: i for i, key in enumerate(dict.fromkeys(a))}
    pos_b = {key: i for i, key in enumerate(dict.fromkeys(b))}
    shared = [key for key in pos_a if key in pos_b]
    if not shared:
        return 1.0
    position_sum = sum(abs(pos_a[key] - pos_b[key]) for key in shared)
    return 1.0 - len(shared) / max(len(pos_a), len(pos_b)) + alpha * position_sum / len(shared)


@dataclass(frozen=True, slots=True)
class EncodedContexts:
    """Contexts with block keys mapped to ints ``0..V-1``, in CSR layout (one row per context).

    Attributes:
        indptr: row ``i`` spans ``indices[indptr[i]:indptr[i + 1]]`` (int64, length N + 1).
        indices: block ints, each row in its context's order without repeats (int32).
        positions: the position of each entry inside its own row (int32).
        lengths: number of distinct blocks per context (int64).
        vocabulary: the block keys, ``vocabulary[b]`` is the key of block int ``b``.
    """

    indptr: np.ndarray
    indices: np.ndarray
    positions: np.ndarray
    lengths: np.ndarray
    vocabulary: list[Hashable]

    @property
    def size(self) -> int:
        """Number of contexts."""
        return int(self.lengths.shape[0])

    @property
    def vocabulary_size(self) -> int:
        """Number of distinct blocks."""
        return len(self.vocabulary)

    def row(self, i: int) -> np.ndarray:
        """Block ints of context ``i`` in order."""
        return self.indices[self.indptr[i] : self.indptr[i + 1]]


def encode_contexts(contexts: Sequence[Sequence[Hashable]], *, deduplicated: bool = False) -> EncodedContexts:
    """Map every block key to an int and lay the contexts out as CSR. O(total blocks); pure.

    Repeated keys inside one context keep their first occurrence only (``deduplicated=True`` promises there are
    none and skips that pass).
    """
    key_to_int: dict[Hashable, int] = {}
    unique = contexts if deduplicated else [list(dict.fromkeys(context)) for context in contexts]
    lengths = np.fromiter((len(keys) for keys in unique), dtype=np.int64, count=len(unique))
    setdefault = key_to_int.setdefault
    flat = [setdefault(key, len(key_to_int)) for keys in unique for key in keys]
    indptr = np.zeros(len(contexts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=indptr[1:])
    row_start = np.repeat(indptr[:-1], lengths)
    positions = (np.arange(indptr[-1], dtype=np.int64) - row_start).astype(np.int32)
    return EncodedContexts(indptr, np.asarray(flat, dtype=np.int32), positions, lengths, list(key_to_int))


def _distance_from_sums(
    overlap: np.ndarray, position_sum: np.ndarray, longest: np.ndarray, alpha: float
) -> np.ndarray:
    """Turn overlap counts, position sums and max lengths into distances (1 where nothing is shared)."""
    shared = overlap > 0
    safe_overlap = np.where(shared, overlap, 1)
    safe_longest = np.maximum(longest, 1)
    value = 1.0 - overlap / safe_longest + alpha * position_sum / safe_overlap
    return np.where(shared, value, 1.0)


def _padded(encoded: EncodedContexts) -> np.ndarray | None:
    """Return the contexts as an (N, Kmax) int32 array padded with the sentinel block ``V``, or None if padding
    would more than double the work (very uneven lengths)."""
    width = int(encoded.lengths.max(initial=0))
    if width == 0 or encoded.size * width > 2 * int(encoded.indptr[-1]) + encoded.size:
        return None
    padded = np.full((encoded.size, width), encoded.vocabulary_size, dtype=np.int32)
    row_of_entry = np.repeat(np.arange(encoded.size), encoded.lengths)
    padded[row_of_entry, encoded.positions] = encoded.indices
    return padded


def _lookup_table(encoded: EncodedContexts, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` as a table ``row x block -> position + 1`` (0 when absent; one spare sentinel column)."""
    dtype = np.int16 if int(encoded.lengths.max(initial=0)) < np.iinfo(np.int16).max else np.int32
    lookup = np.zeros((stop - start, encoded.vocabulary_size + 1), dtype=dtype)
    row_of_entry = np.repeat(np.arange(stop - start), encoded.lengths[start:stop])
    lo, hi = encoded.indptr[start], encoded.indptr[stop]
    lookup[row_of_entry, encoded.indices[lo:hi]] = encoded.positions[lo:hi] + 1
    return lookup


def _row_block_sums(
    encoded: EncodedContexts, padded: np.ndarray | None, start: int, stop: int
) -> tuple[np.ndarray, np.ndarray]:
    """Overlap counts and position sums of rows ``start:stop`` against the contexts ``start + 1:``."""
    lookup = _lookup_table(encoded, start, stop)
    if padded is not None:  # equal-ish lengths: a dense (rows, n, K) gather reduced on its last axis
        slots = np.arange(1, padded.shape[1] + 1, dtype=lookup.dtype)
        gathered = lookup[:, padded[start + 1 :]]
        hit = gathered > 0
        delta = np.abs(gathered - slots)
        delta[~hit] = 0
        return hit.sum(axis=-1, dtype=np.int32), delta.sum(axis=-1, dtype=np.int64)
    col_lo = encoded.indptr[start + 1]
    gathered = lookup[:, encoded.indices[col_lo:]].astype(np.int32)  # rows x entries
    hit = gathered > 0
    delta = np.abs(gathered - 1 - encoded.positions[col_lo:])
    delta[~hit] = 0
    bounds = encoded.indptr[start + 1 :] - col_lo
    return _segment_sums(hit.astype(np.int32), bounds), _segment_sums(delta, bounds)


def _segment_sums(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Sum ``values`` (rows x entries) over the column segments ``bounds[c]:bounds[c + 1]`` (empty segments -> 0)."""
    cumulative = np.zeros((values.shape[0], values.shape[1] + 1), dtype=np.int64)
    np.cumsum(values, axis=1, out=cumulative[:, 1:])
    return cumulative[:, bounds[1:]] - cumulative[:, bounds[:-1]]


def condensed_distances(encoded: EncodedContexts, alpha: float = DEFAULT_ALPHA) -> np.ndarray:
    """Return the condensed pairwise distance vector (scipy ``pdist`` layout, float64). Pure.

    Work O(N * nnz / 2) vectorised in row blocks; memory O(N^2 / 2) for the result plus one row block.
    """
    n = encoded.size
    out = np.empty(n * (n - 1) // 2, dtype=np.float64)
    padded = _padded(encoded)
    width = max(int(encoded.indptr[-1]) if padded is None else padded.size, 1)
    rows_per_block = max(1, _ROW_BLOCK_ELEMENTS // width)
    offset = 0
    for start in range(0, n - 1, rows_per_block):
        stop = min(n - 1, start + rows_per_block)
        overlap, position_sum = _row_block_sums(encoded, padded, start, stop)
        longest = np.maximum.outer(encoded.lengths[start:stop], encoded.lengths[start + 1 :])
        block = _distance_from_sums(overlap, position_sum, longest, alpha)
        for local in range(stop - start):  # keep only the upper triangle: row i against i+1..n-1
            width = n - 1 - (start + local)
            out[offset : offset + width] = block[local, local:]
            offset += width
    return out


def _pair_distances_padded(
    encoded: EncodedContexts, padded: np.ndarray, left: np.ndarray, right: np.ndarray, alpha: float
) -> np.ndarray:
    """Small contexts: compare every slot of the left context with every slot of the right one (K x K per pair)."""
    width = padded.shape[1]
    slots = np.arange(width)
    out = np.empty(left.size, dtype=np.float64)
    chunk = max(1, _ROW_BLOCK_ELEMENTS // (width * width))
    for start in range(0, left.size, chunk):
        a = padded[left[start : start + chunk]]
        b = padded[right[start : start + chunk]]
        b[b == encoded.vocabulary_size] += 1  # distinct padding on each side: padding never matches
        same = a[:, :, None] == b[:, None, :]  # a block occurs at most once per context: <= 1 match per row
        matched = same.any(axis=2)
        partner = same.argmax(axis=2)
        overlap = matched.sum(axis=1)
        position_sum = np.where(matched, np.abs(partner - slots), 0).sum(axis=1)
        longest = np.maximum(
            encoded.lengths[left[start : start + chunk]], encoded.lengths[right[start : start + chunk]]
        )
        out[start : start + chunk] = _distance_from_sums(overlap, position_sum, longest, alpha)
    return out


def pair_distances(
    encoded: EncodedContexts, left: np.ndarray, right: np.ndarray, alpha: float = DEFAULT_ALPHA
) -> np.ndarray:
    """Return the exact distance of each pair ``(left[p], right[p])`` (float64). Pure.

    For every block of the left context the position in the right context is found by binary search in the
    sorted ``context * V + block`` keys: O(P * K * log nnz) without a Python loop per pair.
    """
    left = np.asarray(left, dtype=np.int64)
    right = np.asarray(right, dtype=np.int64)
    if left.size == 0:
        return np.zeros(0, dtype=np.float64)
    padded = _padded(encoded)
    if padded is not None and padded.shape[1] <= _SMALL_CONTEXT:
        return _pair_distances_padded(encoded, padded, left, right, alpha)
    vocabulary = np.int64(encoded.vocabulary_size)
    row_of_entry = np.repeat(np.arange(encoded.size, dtype=np.int64), encoded.lengths)
    keys = row_of_entry * vocabulary + encoded.indices
    order = np.argsort(keys, kind="stable")
    sorted_keys, sorted_positions = keys[order], encoded.positions[order]
    counts = encoded.lengths[left]
    pair_of_entry = np.repeat(np.arange(left.size), counts)
    entry = np.repeat(encoded.indptr[left], counts) + (
        np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    )
    probe = right[pair_of_entry] * vocabulary + encoded.indices[entry]
    found_at = np.minimum(np.searchsorted(sorted_keys, probe), sorted_keys.size - 1)
    hit = sorted_keys[found_at] == probe
    delta = np.where(hit, np.abs(sorted_positions[found_at] - encoded.positions[entry]), 0)
    overlap = np.bincount(pair_of_entry, weights=hit, minlength=left.size)
    position_sum = np.bincount(pair_of_entry, weights=delta, minlength=left.size)
    longest = np.maximum(encoded.lengths[left], encoded.lengths[right])
    return _distance_from_sums(overlap, position_sum, longest, alpha)
