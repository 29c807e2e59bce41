"""The engine's chat tokenization, in the proxy's process: what ``POST /tokenize`` returns, without the round trip.

The proxy needs a prompt's token ids to key it by the engine's block hashes: before routing (prefix score from the
replicas' KV events) and after an answer (eviction sync). Asking the engine (``/tokenize``) costs a request to an
API server that is busy with the engine's own work: about 105 ms a call on the bench replicas under load, against
3 ms of proxy overhead without it. Given the model's tokenizer (the same directory or Hugging Face id the engine
serves), :class:`LocalTokenizer` builds the same ids here: the model's chat template applied with the generation
prompt (vLLM's default for ``/tokenize`` and for chat completions), then encoded without special tokens (the
template writes them). Equality with the engine's ``/tokenize`` is checked against a real vLLM server
(``tests/e2e/test_vllm_kv_sync.py``).

Needs ``transformers`` (``pip install 'cpmemory[tokenizer]'``); loading reads only local files unless the name is
a Hugging Face id. Encoding runs in a worker thread (a 15,000-token prompt takes about 15 ms on one core), so the
event loop keeps serving. Thread-safe for encoding (the fast tokenizer is).
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from cpmemory.errors import EngineError, InvalidInputError, MissingDependencyError


class LocalTokenizer:
    """Chat prompts to token ids as the engine builds them (see the module docstring)."""

    def __init__(self, name_or_path: str) -> None:
        """Load the tokenizer and its chat template (raises InvalidInputError when it cannot be loaded or has no
        template; MissingDependencyError without ``transformers``)."""
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise MissingDependencyError("tokenizer", "transformers") from exc
        try:
            self._tokenizer: Any = AutoTokenizer.from_pretrained(name_or_path)
        except (OSError, ValueError) as exc:
            raise InvalidInputError(f"cannot load the tokenizer {name_or_path!r}: {exc}") from exc
        if not getattr(self._tokenizer, "chat_template", None):
            raise InvalidInputError(f"the tokenizer {name_or_path!r} has no chat template")
        self.name = name_or_path

    def tokenize_now(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of a chat prompt (template applied, generation prompt added). Raises EngineError when the
        template rejects the messages (as the engine's ``/tokenize`` would answer 400)."""
        try:
            text = self._tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                                       add_generation_prompt=True)
            return list(self._tokenizer.encode(text, add_special_tokens=False))
        except Exception as exc:  # the template's own errors (jinja2 TemplateError, raise_exception, bad roles)
            raise EngineError(f"local tokenizer {self.name!r}: {exc}") from exc

    async def tokenize(self, messages: Sequence[Mapping[str, Any]] | None = None, *, model: str | None = None
                       ) -> list[int]:
        """:meth:`tokenize_now` in a worker thread; the signature of ``AsyncEngineClient.tokenize`` (``model``
        is ignored: one tokenizer serves one model)."""
        return await asyncio.to_thread(self.tokenize_now, list(messages or ()))
