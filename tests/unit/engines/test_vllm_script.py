"""`.ci/vllm.sh dtype`: the dtype the real-engine servers get, and the KV bytes that keep their caches' tokens."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / ".ci" / "vllm.sh"


def dtype(*args: str, **env: str) -> list[str]:
    result = subprocess.run(["bash", str(SCRIPT), "dtype", *args], env={**os.environ, **env}, capture_output=True,
                            text=True, check=True, timeout=30)
    return result.stdout.split()


def test_float32_doubles_the_kv_bytes_so_the_cache_holds_the_same_tokens() -> None:
    assert dtype("35651584", CPM_VLLM_DTYPE="float32") == ["float32", "71303168"]
    assert dtype("35651584", CPM_VLLM_DTYPE="bfloat16") == ["bfloat16", "35651584"]


def test_the_default_follows_the_cpus_bf16_instructions() -> None:
    env = {key: value for key, value in os.environ.items() if key != "CPM_VLLM_DTYPE"}
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if not flags:
        pytest.skip("no /proc/cpuinfo")
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    result = subprocess.run(["bash", str(SCRIPT), "dtype", "4194304"], env=env, capture_output=True, text=True,
                            check=True, timeout=30)
    assert result.stdout.split() == (["bfloat16", "4194304"] if native else ["float32", "8388608"])
