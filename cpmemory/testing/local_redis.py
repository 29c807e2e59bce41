"""Throw-away local Redis servers and a 3-master Redis Cluster, started with ``redis-server`` on spare ports.

Used by the store tests (fixtures), the fault test (kill -9 / restart on the same port) and ``cpmemory bench
store`` (cluster row). Nothing is persisted (``--save "" --appendonly no``); every process is stopped by its own
PID. Needs ``redis-server`` and ``redis-cli`` on PATH (:func:`redis_binaries_available`).
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # typing.Self is Python 3.11+
    from typing_extensions import Self

from cpmemory.errors import StoreUnavailableError

_CLUSTER_BUS_OFFSET = 10000


def redis_binaries_available() -> bool:
    """True when both ``redis-server`` and ``redis-cli`` are on PATH."""
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def spare_port(*, with_cluster_bus: bool = False) -> int:
    """Return a free loopback port (and, if asked, a free cluster-bus port at +10000). Racy by nature."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if with_cluster_bus and (port + _CLUSTER_BUS_OFFSET > 65535 or not _port_is_free(port + _CLUSTER_BUS_OFFSET)):
            continue
        return port
    raise OSError("no spare port found")


def ping(port: int, timeout_s: float = 0.2) -> bool:
    """True if a Redis server answers PING on 127.0.0.1:``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as connection:
            connection.sendall(b"PING\r\n")
            return connection.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class LocalRedisServer:
    """One ``redis-server`` process on a spare (or given) port, in a temporary directory.

    Usable as a context manager. ``kill()`` sends SIGKILL (a crash); ``start()`` again restarts it on the same
    port with empty state.
    """

    def __init__(self, port: int | None = None, *, cluster: bool = False, workdir: Path | None = None) -> None:
        self.port = port if port is not None else spare_port(with_cluster_bus=cluster)
        self.cluster = cluster
        self._own_dir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix=f"cpm-redis-{self.port}-"))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def _command(self) -> list[str]:
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no"]
        if self.cluster:
            command += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf",
                        "--cluster-node-timeout", "2000"]
        return command

    def start(self, timeout_s: float = 10.0) -> LocalRedisServer:
        """Start the server and wait until it answers PING. Raises StoreUnavailableError if it does not."""
        if self.cluster:  # a restarted cluster node must not find its old identity
            (self.workdir / f"nodes-{self.port}.conf").unlink(missing_ok=True)
        self._process = subprocess.Popen(self._command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ping(self.port):
                return self
            if self._process.poll() is not None:
                break
            time.sleep(0.02)
        self.stop()
        raise StoreUnavailableError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        """SIGKILL the server (simulates a crash) and wait for it to exit."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(timeout=10)
        self._process = None

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after 5 s)."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=5)
        self._process = None

    def close(self) -> None:
        """Stop the server and remove its temporary directory."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        if self._process is None:
            self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class LocalRedisCluster:
    """A local Redis Cluster of ``masters`` master nodes (no replicas), built with ``redis-cli --cluster create``."""

    def __init__(self, masters: int = 3) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="cpm-redis-cluster-"))
        self.nodes: list[LocalRedisServer] = []
        self.masters = masters

    @property
    def url(self) -> str:
        """URL of the first node (redis-py's cluster client discovers the others)."""
        return self.nodes[0].url

    def start(self, timeout_s: float = 30.0) -> LocalRedisCluster:
        """Start the nodes, create the cluster, and wait until every node reports ``cluster_state:ok``."""
        try:
            for _ in range(self.masters):
                node = LocalRedisServer(cluster=True, workdir=self.workdir)
                self.nodes.append(node.start())
            addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
            subprocess.run(
                ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
                check=True, capture_output=True, timeout=timeout_s,
            )
            self._wait_ok(time.monotonic() + timeout_s)
        except (subprocess.SubprocessError, OSError, StoreUnavailableError) as error:
            self.close()
            raise StoreUnavailableError(f"could not create a local Redis Cluster: {error}") from error
        return self

    def _wait_ok(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            states = [
                subprocess.run(["redis-cli", "-p", str(node.port), "cluster", "info"], capture_output=True,
                               text=True, timeout=5, check=False).stdout
                for node in self.nodes
            ]
            if all("cluster_state:ok" in state for state in states):
                return
            time.sleep(0.1)
        raise StoreUnavailableError("the local Redis Cluster did not reach cluster_state:ok")

    def close(self) -> None:
        """Stop every node and remove the working directory."""
        for node in self.nodes:
            node.stop()
        self.nodes.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
