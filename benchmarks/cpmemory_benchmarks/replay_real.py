"""Replay a sequence of prompts through a real engine and measure TTFT and prefix-cache reuse.

The benchmark command (``cpmemory bench replay --engine URL``) calls :func:`measure` once per strategy, with the
prompts that strategy produced, in execution order. Each prompt is streamed with ``max_tokens=1`` (the time to
the first token is the prefill time, which is what prefix reuse saves) and ``temperature=0``. With
``reset_cache`` the engine's prefix cache is emptied first (``POST /reset_prefix_cache``, vLLM dev mode), so
every strategy starts cold and the figures of one run compare.

Example::

    from cpmemory_benchmarks.replay_real import measure
    figures = measure([[{"role": "user", "content": "..."}], ...], "http://127.0.0.1:8000")
    figures["ttft_mean_ms"], figures["cached_tokens"]
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cpmemory.engines.client import ChatResult, EngineClient, EngineSettings
from cpmemory.errors import EngineError

Prompt = Sequence[Mapping[str, Any]]
ProgressCallback = Callable[[int, int, ChatResult], None]


def summarize(results: Sequence[ChatResult]) -> dict[str, Any]:
    """Aggregate per-request results: TTFT mean / p50 / p90 in ms, summed prompt and cached tokens."""
    ttfts = [result.ttft_s * 1000.0 for result in results if result.ttft_s is not None]
    prompt_tokens = sum(result.prompt_tokens or 0 for result in results)
    cached_tokens = sum(result.cached_tokens or 0 for result in results)
    ordered = sorted(ttfts)
    return {
        "requests": len(results),
        "ttft_mean_ms": statistics.fmean(ttfts) if ttfts else None,
        "ttft_p50_ms": statistics.median(ttfts) if ttfts else None,
        "ttft_p90_ms": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] if ordered else None,
        "ttft_total_ms": sum(ttfts),
        "cached_tokens": cached_tokens,
        "prompt_tokens": prompt_tokens,
        "cache_hit_ratio": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
    }


def measure(prompts: Sequence[Prompt], base_url: str, *, model: str = "tiny", reset_cache: bool = True,
            request_ids: Sequence[str] | None = None, cache_salt: str | None = None,
            timeout_s: float = 600.0, transport: Any = None,
            progress: ProgressCallback | None = None) -> dict[str, Any]:
    """Send each prompt in order (streamed, ``max_tokens=1``); return TTFT and cached-token figures.

    Args:
        prompts: chat message lists, in execution order.
        base_url: the engine (e.g. ``http://127.0.0.1:8000``).
        model: the served model name.
        reset_cache: empty the engine's prefix cache first (needs VLLM_SERVER_DEV_MODE=1 on the server).
        request_ids: one id per prompt (ties requests to index leaves); generated when None.
        cache_salt: a tenant's cache salt, sent with every request.
        timeout_s: read timeout per request.
        transport: an httpx transport replacing the network (tests).
        progress: called after each request with (done, total, result).

    Returns:
        ``{"requests", "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "ttft_total_ms", "cached_tokens",
        "prompt_tokens", "cache_hit_ratio", "reset": bool}``.

    Raises:
        EngineError: the engine failed a request (the replay stops: a partial figure would mislead), or
            ``reset_cache`` was asked and the engine refused it.
        ValueError: ``request_ids`` does not match ``prompts`` in length.
    """
    if request_ids is not None and len(request_ids) != len(prompts):
        raise ValueError("request_ids must have one id per prompt")
    settings = EngineSettings(base_url=base_url, model=model, timeout_s=timeout_s)
    with EngineClient(settings, transport=transport) as client:
        if reset_cache and not client.reset_prefix_cache():
            raise EngineError(f"{base_url} refused /reset_prefix_cache (start it with VLLM_SERVER_DEV_MODE=1)")
        results: list[ChatResult] = []
        for position, messages in enumerate(prompts):
            request_id = request_ids[position] if request_ids is not None else None
            result = client.chat(messages, request_id=request_id, max_tokens=1, stream=True,
                                 cache_salt=cache_salt, extra={"temperature": 0})
            results.append(result)
            if progress is not None:
                progress(position + 1, len(prompts), result)
    figures = summarize(results)
    figures["reset"] = reset_cache
    return figures


def replay_real(base_url: str, prompts: Sequence[Prompt], **options: Any) -> dict[str, Any]:
    """Alias of :func:`measure` with the URL first (the form ``cpmemory_benchmarks.replay`` calls)."""
    return measure(prompts, base_url, **options)
