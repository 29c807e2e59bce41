"""LocalTokenizer: the served model's chat tokenization in the proxy (a small real tokenizer built per test)."""
from __future__ import annotations

import asyncio

import pytest

from cpmemory.engines.local_tokenizer import LocalTokenizer
from cpmemory.errors import EngineError, InvalidInputError

pytest.importorskip("transformers")
from tests.chat_tokenizer import WORDS  # noqa: E402 - after the skip
from tests.chat_tokenizer import build_chat_tokenizer as build


def test_the_template_is_applied_with_the_generation_prompt_and_no_extra_special_tokens(tmp_path):
    local = LocalTokenizer(str(build(tmp_path)))
    ids = local.tokenize_now([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world?"}])
    index = {w: i for i, w in enumerate(WORDS)}
    expected = ["<s>", "system", ":", "be", "brief", "</s>", "<s>", "user", ":", "hello", "world", "?", "</s>",
                "<s>", "assistant", ":"]
    assert ids == [index[w] for w in expected]  # no BOS added in front of the template's own <s>
    assert asyncio.run(local.tokenize([{"role": "user", "content": "hi"}], model="ignored")) == \
        [index[w] for w in ["<s>", "user", ":", "hi", "</s>", "<s>", "assistant", ":"]]


def test_a_template_error_is_an_engine_error_like_a_rejected_tokenize(tmp_path):
    local = LocalTokenizer(str(build(tmp_path)))
    with pytest.raises(EngineError, match="unknown role tool"):
        local.tokenize_now([{"role": "tool", "content": "x"}])


def test_a_missing_tokenizer_or_template_fails_at_load(tmp_path):
    with pytest.raises(InvalidInputError, match="cannot load"):
        LocalTokenizer(str(tmp_path / "nowhere"))
    with pytest.raises(InvalidInputError, match="no chat template"):
        LocalTokenizer(str(build(tmp_path, template=None)))
