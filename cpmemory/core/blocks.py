"""Context blocks: the unit cpmemory reorders, schedules and de-duplicates.

A block has a stable caller-chosen ``id``, a ``text`` and optional ``metadata``. Its ``content_hash`` depends on the
text only, so:

* same id + different text  -> a *changed* block (never deduplicated against its old version);
* same text under another id -> the same content (deduplicated like the original).

Block ids never reach the prompt. The prompt names a block by its ``label``, derived from the content hash
(``"D" + 7 hex digits``), so labels are identical across conversations (prefix sharing works across sessions),
stable within a conversation, and cannot carry injected text whatever the id contains.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cpmemory.errors import InvalidBlockError

LABEL_HEX_DIGITS = 7


def content_hash(text: str) -> str:
    """Return the hex content hash of ``text`` (blake2b-128). Pure, O(len(text))."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def label_for_hash(digest: str, digits: int = LABEL_HEX_DIGITS) -> str:
    """Return the prompt label of a content hash, e.g. ``"D3f9a0c1"``."""
    return "D" + digest[:digits]


@dataclass(frozen=True, slots=True)
class Block:
    """One context block (a retrieved document, a memory, a tool output).

    Attributes:
        id: stable identifier chosen by the caller (any string; never shown to the model).
        text: the content shown to the model.
        metadata: optional caller data carried through untouched (not part of equality or hash).
    """

    id: str
    text: str
    metadata: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str):
            raise InvalidBlockError(f"block id must be a string, got {type(self.id).__name__}")
        if not isinstance(self.text, str):
            raise InvalidBlockError(f"block {self.id!r}: text must be a string, got {type(self.text).__name__}")

    @property
    def content_hash(self) -> str:
        """Hash of the text only (see module docstring)."""
        return content_hash(self.text)

    @property
    def label(self) -> str:
        """The label the prompt uses for this block."""
        return label_for_hash(self.content_hash)


BlockLike = Block | Mapping[str, Any] | tuple[Any, str]


def to_block(value: BlockLike) -> Block:
    """Coerce a ``Block``, a mapping ``{"id", "text", "metadata"?}`` or an ``(id, text)`` pair into a Block.

    Integer ids are accepted and converted with ``str``; any other non-string id raises InvalidBlockError.
    """
    if isinstance(value, Block):
        return value
    if type(value) is dict or isinstance(value, Mapping):  # a plain dict first: the ABC check costs more
        if "id" not in value or "text" not in value:
            raise InvalidBlockError(f"a block mapping needs 'id' and 'text' keys, got {sorted(map(str, value))}")
        block_id, text, metadata = value["id"], value["text"], value.get("metadata")
    elif isinstance(value, tuple) and len(value) == 2:
        (block_id, text), metadata = value, None
    else:
        raise InvalidBlockError(f"cannot make a block from {type(value).__name__}")
    if isinstance(block_id, int) and not isinstance(block_id, bool):
        block_id = str(block_id)
    return Block(block_id, text, metadata)


RENAME_MARK = "#"
"""A repeated id with another text is renamed ``"<id>#<hex digits of the text's content hash>"``."""


@dataclass(frozen=True, slots=True)
class ResolvedBlocks:
    """A caller's block list with unique ids, and where each caller item went (:func:`resolve_blocks`).

    Attributes:
        blocks: the blocks, ids unique, in relevance order (the order of their first item).
        item_block: for each caller item, the index of its block in ``blocks``.
    """

    blocks: tuple[Block, ...]
    item_block: tuple[int, ...]

    def first_item(self, block_index: int) -> int:
        """The rank of the first caller item of a block. O(n)."""
        return self.item_block.index(block_index)

    def duplicate_of(self, rank: int) -> int | None:
        """The rank of the earlier item this item repeats (same id, same text), or None."""
        first = self.first_item(self.item_block[rank])
        return None if first == rank else first


def _as_list(values: Iterable[BlockLike]) -> list[Block]:
    if isinstance(values, (str, bytes, Mapping)):
        raise InvalidBlockError("blocks must be a list of blocks, not a single string or mapping")
    if not isinstance(values, Iterable):
        raise InvalidBlockError(f"blocks must be a list of blocks, got {type(values).__name__}")
    return [to_block(value) for value in values]


def _free_id(block: Block, taken: set[str]) -> str:
    digest = block.content_hash
    for digits in (8, 16, len(digest)):
        candidate = f"{block.id}{RENAME_MARK}{digest[:digits]}"
        if candidate not in taken:
            return candidate
    number = 2
    while f"{block.id}{RENAME_MARK}{digest}{RENAME_MARK}{number}" in taken:
        number += 1
    return f"{block.id}{RENAME_MARK}{digest}{RENAME_MARK}{number}"


def resolve_blocks(values: Iterable[BlockLike]) -> ResolvedBlocks:
    """Coerce ``values`` into Blocks with unique ids: the one rule for repeated ids (facade, proxy, adapters).

    * an id seen before with the same text -> the same block (the item is a duplicate of the first);
    * an id seen before with another text -> its own block, renamed ``"<id>#<8 hex digits of its content hash>"``
      (longer, then numbered, when that id is taken by any item of the list or an earlier rename), so it keeps its
      own label and decision and the same text gets the same id on every turn;
    * anything else -> the block as given.

    Does not mutate anything. O(n). Raises InvalidBlockError on the first unusable value, before returning anything.
    """
    given = _as_list(values)
    taken = {block.id for block in given}
    where: dict[tuple[str, str], int] = {}  # (caller id, text) -> block index
    first_text: dict[str, str] = {}
    blocks: list[Block] = []
    item_block: list[int] = []
    for block in given:
        key = (block.id, block.text)
        if key not in where:
            if first_text.setdefault(block.id, block.text) != block.text:
                renamed = _free_id(block, taken)
                taken.add(renamed)
                block = Block(renamed, block.text, block.metadata)
            where[key] = len(blocks)
            blocks.append(block)
        item_block.append(where[key])
    return ResolvedBlocks(tuple(blocks), tuple(item_block))


def normalize_blocks(values: Iterable[BlockLike]) -> list[Block]:
    """Coerce ``values`` into Blocks with unique ids (:func:`resolve_blocks`: a repeated id with the same text is
    kept once, with another text it is renamed and kept).

    Does not mutate anything. O(n). Raises InvalidBlockError on the first unusable value, before returning anything.
    """
    return list(resolve_blocks(values).blocks)
