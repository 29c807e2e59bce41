"""Key naming: hostile ids map to safe, fixed-length keys in one cluster slot per conversation."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.errors import InvalidIdentifierError
from cpmemory.stores.keys import FIELDS, KeyScheme, decode_text, encode_text
from cpmemory.types import ConversationKey

identifiers = st.text(min_size=1, max_size=1024)


def _slot(key: str) -> int:
    from redis.crc import key_slot

    return key_slot(key.encode())


@settings(max_examples=200, deadline=None)
@given(identifiers, identifiers)
def test_keys_are_safe_fixed_length_and_share_one_slot(tenant: str, conversation: str) -> None:
    names = KeyScheme("cpm").keys(ConversationKey(tenant, conversation)).all()
    assert len(names) == len(FIELDS)
    tag = names[0][len("cpm:{") : names[0].index("}")]
    for name, field in zip(names, FIELDS):
        assert name == f"cpm:{{{tag}}}:{field}"
        assert name.isascii() and " " not in name and "*" not in name
    assert len(tag) == 65 and {_slot(name) for name in names} == {_slot(names[0])}


@settings(max_examples=200, deadline=None)
@given(identifiers, identifiers, identifiers, identifiers)
def test_distinct_conversations_get_distinct_keys(t1: str, c1: str, t2: str, c2: str) -> None:
    scheme = KeyScheme("cpm")
    same = (t1, c1) == (t2, c2)
    assert (scheme.tag(ConversationKey(t1, c1)) == scheme.tag(ConversationKey(t2, c2))) == same


def test_tenant_and_conversation_do_not_alias() -> None:
    scheme = KeyScheme("cpm")
    assert scheme.tag(ConversationKey("a", "b:c")) != scheme.tag(ConversationKey("a:b", "c"))
    assert scheme.tag(ConversationKey("x", "y")) != scheme.tag(ConversationKey("y", "x"))


@pytest.mark.parametrize("prefix", ["", "a{b", "a}b", "x" * 65, "with space", "ü"])
def test_bad_prefixes_are_rejected(prefix: str) -> None:
    with pytest.raises(InvalidIdentifierError):
        KeyScheme(prefix)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(codec=None), max_size=50))
def test_text_encoding_round_trips_even_lone_surrogates(value: str) -> None:
    assert decode_text(encode_text(value)) == value
