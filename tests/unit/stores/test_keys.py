"""Key naming: hostile ids map to safe, fixed-length keys in one cluster slot per tenant (its conversations and
its shared decision state)."""
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
def test_keys_are_safe_fixed_length_and_share_the_tenant_s_slot(tenant: str, conversation: str) -> None:
    scheme = KeyScheme("cpm")
    names = scheme.keys(ConversationKey(tenant, conversation)).all()
    assert len(names) == len(FIELDS)
    tag = names[0][len("cpm:{") : names[0].index("}")]
    conversation_hash = names[0][len(f"cpm:{{{tag}}}:") : -len(":state")]
    for name, field in zip(names, FIELDS):
        assert name == f"cpm:{{{tag}}}:{conversation_hash}:{field}"
        assert name.isascii() and " " not in name and "*" not in name
    assert len(tag) == 32 and len(conversation_hash) == 32 and tag == scheme.tag(tenant)
    decisions = scheme.decision_keys(tenant)
    assert all(name.startswith(f"cpm:{{{tag}}}:ord3:") for name in decisions)
    # one slot: a request's conversation call and its tenant's decision call go to one cluster node together
    assert {_slot(name) for name in names + decisions} == {_slot(names[0])}
    assert not set(names) & set(decisions)


@settings(max_examples=200, deadline=None)
@given(identifiers, identifiers, identifiers, identifiers)
def test_distinct_conversations_get_distinct_keys(t1: str, c1: str, t2: str, c2: str) -> None:
    scheme = KeyScheme("cpm")
    same = (t1, c1) == (t2, c2)
    first, second = scheme.keys(ConversationKey(t1, c1)).all(), scheme.keys(ConversationKey(t2, c2)).all()
    assert (first == second) == same and (bool(set(first) & set(second))) == same
    assert (scheme.tag(t1) == scheme.tag(t2)) == (t1 == t2)


def test_tenant_and_conversation_do_not_alias() -> None:
    scheme = KeyScheme("cpm")
    assert scheme.keys(ConversationKey("a", "b:c")).state != scheme.keys(ConversationKey("a:b", "c")).state
    assert scheme.keys(ConversationKey("x", "y")).state != scheme.keys(ConversationKey("y", "x")).state
    assert scheme.tag("x") != scheme.tag("y")


@pytest.mark.parametrize("prefix", ["", "a{b", "a}b", "x" * 65, "with space", "ü"])
def test_bad_prefixes_are_rejected(prefix: str) -> None:
    with pytest.raises(InvalidIdentifierError):
        KeyScheme(prefix)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(codec=None), max_size=50))
def test_text_encoding_round_trips_even_lone_surrogates(value: str) -> None:
    assert decode_text(encode_text(value)) == value
