"""The engine's chat tokenization, in the proxy's process: what ``POST /tokenize`` returns, without the round trip.

The proxy needs a prompt's token ids to key it by the engine's block hashes: before routing (prefix score from the
replicas' KV events) and after an answer (eviction sync). Asking the engine (``/tokenize``) costs a request to an
API server that is busy with the engine's own work: under load that round trip costs far more than all the rest
of the proxy's work. Given the model's tokenizer (the same directory or Hugging Face id the engine
serves), :class:`LocalTokenizer` builds the same ids here: the model's chat template applied with the generation
prompt (vLLM's default for ``/tokenize`` and for chat completions), then encoded without special tokens (the
template writes them). Equality with the engine's ``/tokenize`` is checked against a real vLLM server
(``tests/e2e/test_vllm_kv_sync.py``).

Needs ``transformers`` (``pip install 'cpmemory[tokenizer]'``); loading reads only local files unless the name is
a Hugging Face id. Encoding runs in a worker thread (a long prompt takes milliseconds of CPU), so the event loop
keeps serving. Thread-safe for encoding (the fast tokenizer is).
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from cpmemory.engines.openai_wire import model_entry
from cpmemory.errors import EngineError, InvalidInputError, MissingDependencyError

PROBE: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "cpmemory tokenizer probe."},
    {"role": "user", "content": "Hello, world! 1,234 tokens? Ünïcödé, tabs\tand\nnew lines."},
    {"role": "assistant", "content": "Hi: (an answer)."},
    {"role": "user", "content": "And again, once more."},
)
"""A chat the engine and a candidate local tokenizer must tokenize to the same ids (:func:`discover`)."""


class LocalTokenizer:
    """Chat prompts to token ids as the engine builds them (see the module docstring)."""

    def __init__(self, name_or_path: str, *, local_only: bool = False) -> None:
        """Load the tokenizer and its chat template (raises InvalidInputError when it cannot be loaded or has no
        template; MissingDependencyError without ``transformers``). ``local_only``: never download (a Hugging Face
        id loads only from the local cache)."""
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise MissingDependencyError("tokenizer", "transformers") from exc
        try:
            self._tokenizer: Any = AutoTokenizer.from_pretrained(name_or_path, local_files_only=local_only)
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


async def discover(client: Any, model: str | None = None) -> tuple[LocalTokenizer | None, str]:
    """The engine's own tokenizer, loaded in this process, when the engine allows it; else None. Returns it and why.

    ``client`` is an ``AsyncEngineClient``. The engine's ``GET /v1/models`` names where its model came from (vLLM's
    ``root``: a directory or a Hugging Face id); when that loads here without a download (a directory on this
    machine, or an id in the local Hugging Face cache) and its chat tokenization of :data:`PROBE` equals the engine's
    ``POST /tokenize``, it is the engine's tokenizer. Raises EngineError when the engine did not answer (try later).
    """
    chosen = model_entry(await client.models(), model)
    root = chosen.get("root") if chosen is not None else None
    if chosen is None or not isinstance(root, str) or not root:
        return None, "the engine names no model root in /v1/models"
    try:
        local = await asyncio.to_thread(LocalTokenizer, root, local_only=True)
    except (InvalidInputError, MissingDependencyError) as error:
        return None, f"{root!r} does not load here: {error}"
    engine_ids = await client.tokenize(list(PROBE), model=model or chosen.get("id"))
    try:
        local_ids = await local.tokenize(PROBE)
    except EngineError as error:
        return None, f"{root!r} cannot tokenize the probe: {error}"
    if list(engine_ids) != local_ids:
        return None, f"{root!r} tokenizes differently from the engine's /tokenize"
    return local, f"the engine's tokenizer, loaded from {root!r}"
