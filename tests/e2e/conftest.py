"""Real processes on loopback: mock engine replicas and the proxy (`cpmemory serve`), started and stopped by PID."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PROXY_SETTINGS = HERE / "proxy.toml"  # what every proxy process here runs with (an engine timeout tests can wait out)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_http(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


class Process:
    """One child process on a loopback port; stop() kills it by PID."""

    def __init__(self, args: list[str], port: int, health_path: str) -> None:
        self.args, self.port, self.health_path = args, port, health_path
        self.popen: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Process:
        self.popen = subprocess.Popen(self.args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_http(self.url + self.health_path)
        except TimeoutError:
            self.stop()
            raise
        return self

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.kill(self.popen.pid, sig)
            self.popen.wait(timeout=10)
        self.popen = None


def engine_process(port: int | None = None, *extra: str) -> Process:
    port = port or free_port()
    return Process([sys.executable, str(HERE / "engine_server.py"), str(port), *extra], port, "/health")


def proxy_process(engines: list[str], *extra: str, port: int | None = None) -> Process:
    port = port or free_port()
    args = [sys.executable, "-m", "cpmemory.cli", "serve", "--port", str(port), "--config", str(PROXY_SETTINGS)]
    for url in engines:
        args += ["--engine", url]
    return Process(args + list(extra), port, "/healthz")


def gateway_process(replicas: list[str], port: int | None = None) -> Process:
    port = port or free_port()
    return Process([sys.executable, str(HERE / "gateway_server.py"), str(port), *replicas], port, "/health")


class Launcher:
    """Makes processes and stops every one of them at teardown."""

    def __init__(self) -> None:
        self.made: list[Process] = []

    def engine(self, *extra: str) -> Process:
        self.made.append(engine_process(None, *extra))
        return self.made[-1]

    @staticmethod
    def free_port() -> int:
        return free_port()

    def gateway(self, replicas: list[str]) -> Process:
        self.made.append(gateway_process(replicas))
        return self.made[-1]

    def proxy(self, engines: list[str], *extra: str) -> Process:
        self.made.append(proxy_process(engines, *extra))
        return self.made[-1]


@pytest.fixture
def processes() -> Iterator[Launcher]:
    launcher = Launcher()
    yield launcher
    for process in launcher.made:
        process.stop()
