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


PROMPT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world, what is it?"}]


class Engine:
    """The two engine endpoints ``discover`` reads: ``GET /v1/models`` and ``POST /tokenize`` (a stand-in for a
    remote server whose tokenizer is ``tokenize``; ``down`` answers nothing, like an engine not started yet)."""

    def __init__(self, root: object, tokenize=None, down: int = 0) -> None:
        self.root, self._tokenize, self.down, self.calls = root, tokenize, down, 0

    async def models(self) -> dict:
        self.calls += 1
        if self.calls <= self.down:
            from cpmemory.errors import EngineUnreachableError

            raise EngineUnreachableError("connection refused")
        entry = {"id": "tiny", "max_model_len": 4096}
        if self.root is not None:
            entry["root"] = self.root
        return {"object": "list", "data": [entry]}

    async def tokenize(self, messages, *, model=None) -> list[int]:
        return self._tokenize(messages)


async def test_the_engines_tokenizer_is_adopted_only_when_it_loads_here_and_tokenizes_as_the_engine(tmp_path):
    from cpmemory.engines.local_tokenizer import discover

    directory = str(build(tmp_path))
    same = LocalTokenizer(directory).tokenize_now
    found, why = await discover(Engine(directory, same))
    assert found is not None and found.tokenize_now(PROMPT) == same(PROMPT), why
    # an engine whose tokenization differs by one id (another template, another vocabulary)
    found, why = await discover(Engine(directory, lambda messages: [*same(messages), 0]))
    assert found is None and "differently" in why
    for root in (None, str(tmp_path / "elsewhere"), "no-such-org/no-such-model"):  # never downloaded
        found, why = await discover(Engine(root, same))
        assert found is None, why


async def test_the_proxy_adopts_the_engines_tokenizer_once_the_engine_answers(tmp_path):
    from cpmemory.server.app import ServerConfig, adopt_engine_tokenizer, create_app
    from cpmemory.server.budget import EngineBudget

    directory = str(build(tmp_path))
    app = create_app(ServerConfig(engines=["http://127.0.0.1:9"], tokenizer="auto"))
    service = app.state.service
    engine = Engine(directory, LocalTokenizer(directory).tokenize_now, down=2)
    service.engine_budget = EngineBudget(engine)
    assert service.metrics.local_tokenizer._value.get() == 0
    assert await adopt_engine_tokenizer(service, engine, retry_s=0.01)
    assert engine.calls == 3  # two refused, then found
    assert await service.engine_budget.count("tiny", PROMPT) == len(LocalTokenizer(directory).tokenize_now(PROMPT))
    assert service.metrics.local_tokenizer._value.get() == 1
    other = Engine(directory, lambda messages: [1, 2, 3])
    assert not await adopt_engine_tokenizer(service, other, retry_s=0.01) and other.calls == 1  # no retry
