"""Sans-IO readers of vLLM's operational endpoints: ``/metrics`` (Prometheus text: cache configuration, prefix-cache
counters) and ``/reset_prefix_cache``. The engine client (:mod:`cpmemory.engines.client`) does the IO."""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cpmemory.errors import EngineError


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The engine's KV-cache configuration, from ``/metrics`` ``vllm:cache_config_info``."""

    block_size: int
    hash_algorithm: str
    prefix_caching: bool
    num_blocks: int | None


_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Parse Prometheus text exposition into ``(name, labels, value)`` samples (comments skipped)."""
    samples = []
    for line in text.splitlines():
        match = _METRIC_LINE.match(line)
        if not match or line.startswith("#"):
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        try:
            samples.append((match.group(1), labels, float(match.group(3))))
        except ValueError:
            continue
    return samples


def metric_total(samples: Iterable[tuple[str, dict[str, str], float]], name: str) -> float | None:
    """Sum of every sample named ``name`` (over label sets); None when absent."""
    values = [value for sample_name, _labels, value in samples if sample_name == name]
    return sum(values) if values else None


def parse_cache_config(text: str) -> CacheConfig:
    """The KV-cache configuration from ``/metrics``. Raises EngineError when ``vllm:cache_config_info`` is absent."""
    for name, labels, _value in parse_metrics(text):
        if name == "vllm:cache_config_info" and labels.get("block_size", "").isdigit():
            blocks = labels.get("num_gpu_blocks", "")
            return CacheConfig(block_size=int(labels["block_size"]),
                               hash_algorithm=labels.get("prefix_caching_hash_algo", "sha256"),
                               prefix_caching=labels.get("enable_prefix_caching", "True") == "True",
                               num_blocks=int(blocks) if blocks.isdigit() else None)
    raise EngineError("the engine's /metrics has no vllm:cache_config_info with a block_size")


def reset_succeeded(response: Any) -> bool:
    """Whether a ``/reset_prefix_cache`` answer reports success (an empty or non-JSON 200 counts as success)."""
    try:
        payload = response.json()
    except ValueError:
        return True
    return not (isinstance(payload, dict) and payload.get("success") is False)
