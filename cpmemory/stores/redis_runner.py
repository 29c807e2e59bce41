"""How the Redis store's scripts reach the server (IO): straight on pooled sockets for a synchronous client
(:class:`DirectScriptRunner` on a standalone ``redis.Redis``, :class:`ClusterScriptRunner` on each node of a
``redis.cluster.RedisCluster``), else pipelined ``EVALSHA`` through redis-py (:func:`run_pipelined`,
:func:`run_pipelined_async`), per node on a cluster.

Why not redis-py's ``Script`` in a pipeline: its pipeline checks the scripts with ``SCRIPT EXISTS`` before every
execute, one more round trip per call; here ``EVALSHA`` goes first and only a ``NOSCRIPT`` reply (a server that has
not seen the script yet) loads it. A synchronous cluster pipeline refuses ``EVALSHA`` (the method; the command
itself routes by its keys), so synchronous cluster calls go to their node's own client (one pipeline per node);
the asyncio cluster pipeline sends ``EVALSHA`` through ``execute_command`` (one pipeline per node, redirections
followed by redis-py). A request's calls share the tenant's hash tag (:mod:`cpmemory.stores.keys`), so they are
one node and one round trip.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any

from cpmemory.stores.keys import decode_text
from cpmemory.stores.redis_codec import ScriptCall


class DirectScriptRunner:
    """Runs the registered scripts on connections kept out of a standalone ``redis.Redis`` client's pool.

    Why: on loopback, redis-py's generic command path (pool checkout with a readiness poll and locks, the retry
    wrapper, observability hooks and event dispatch) costs about as much as the round trip itself. The hot path
    only needs ``EVALSHA`` on a connected socket, so each thread takes a connection from a small idle stack
    (``list.pop``/``append`` are atomic), sends, reads, and puts it back. A connection that failed is disconnected and
    handed back to the pool; a ``ConnectionError`` (a stale socket after a server restart, or a refused connect)
    is retried on a fresh connection ``retries`` times (at least once). ``NOSCRIPT`` loads the script on the same
    connection and retries, so a restarted server recovers by itself. After a fork the idle stack is dropped.
    The idle stack belongs to the pool, shared by every runner (store) on it: many stores on one client hold no
    more connections than run at once, so they never run a bounded pool dry.
    """

    def __init__(self, client: Any, scripts: dict[str, Any], retries: int) -> None:
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import NoScriptError

        self._pool = client.connection_pool
        self._scripts = scripts
        self._idle: list[Any] = _idle_stack(self._pool)
        self._pid = os.getpid()
        self._attempts = 1 + max(1, retries)
        self._retryable = RedisConnectionError
        self._no_script = NoScriptError
        self._pack = _command_packer()

    def __call__(self, call: ScriptCall) -> Any:
        """Run one script call: one round trip (three the first time a server sees the script)."""
        script = self._scripts[call.script]
        return self._on_connection(lambda connection: self._evalsha(connection, script, call))

    def run_many(self, calls: Sequence[ScriptCall]) -> list[Any]:
        """Run several script calls in one round trip (one write, then the replies in order).

        A reply that is an error is returned as the exception (the caller decides); a ``NOSCRIPT`` reply loads
        that script and runs its call again on the same connection (the first time a server sees the script).
        """
        return self._on_connection(lambda connection: self._pipelined(connection, calls))

    def _on_connection(self, send: Callable[[Any], Any]) -> Any:
        """Run ``send`` on an idle connection, retrying a retryable error on a fresh one; a broken connection goes
        back to the pool disconnected, a healthy one to the idle stack."""
        for attempt in range(self._attempts):
            connection = self._checkout()
            try:
                reply = send(connection)
            except BaseException as error:
                connection.disconnect()
                self._pool.release(connection)
                if isinstance(error, self._retryable) and attempt + 1 < self._attempts:
                    continue
                raise
            self._idle.append(connection)
            return reply
        raise AssertionError("unreachable")  # pragma: no cover

    def _pipelined(self, connection: Any, calls: Sequence[ScriptCall]) -> list[Any]:
        from redis.exceptions import ResponseError

        packed = [("EVALSHA", self._scripts[c.script].sha, len(c.keys), *c.keys, *c.args) for c in calls]
        connection.send_packed_command(self._pack(connection, packed))
        replies: list[Any] = []
        for _ in calls:
            try:
                replies.append(connection.read_response())
            except ResponseError as error:  # NoScriptError is one; the other replies are still read
                replies.append(error)
        for position, (call, reply) in enumerate(zip(calls, replies)):
            if isinstance(reply, self._no_script):
                try:
                    replies[position] = self._evalsha(connection, self._scripts[call.script], call)
                except ResponseError as error:
                    replies[position] = error
        return replies

    def _checkout(self) -> Any:
        if self._pid != os.getpid():  # never share a parent's sockets
            self._idle, self._pid = _idle_stack(self._pool), os.getpid()
        try:
            return self._idle.pop()
        except IndexError:
            return self._pool.get_connection()

    def _evalsha(self, connection: Any, script: Any, call: ScriptCall) -> Any:
        try:
            command = ("EVALSHA", script.sha, len(call.keys), *call.keys, *call.args)
            connection.send_packed_command(self._pack(connection, [command]))
            return connection.read_response()
        except self._no_script:
            connection.send_command("SCRIPT", "LOAD", script.script)
            script.sha = decode_text(connection.read_response())
            connection.send_command("EVALSHA", script.sha, len(call.keys), *call.keys, *call.args)
            return connection.read_response()

    def close(self) -> None:
        """Hand the idle connections back to the pool."""
        while True:
            try:
                connection = self._idle.pop()
            except IndexError:
                return
            self._pool.release(connection)


_IDLE_ATTRIBUTE = "_cpmemory_idle_connections"


def _command_packer() -> Callable[[Any, Sequence[tuple[Any, ...]]], Any]:
    """Packs commands into one write. With hiredis, straight to ``hiredis.pack_command`` (half the cost of
    redis-py's ``pack_commands``, which re-inspects every argument; the arguments here are str, bytes and int)."""
    try:
        import hiredis
    except ImportError:
        return lambda connection, commands: connection.pack_commands(commands)
    pack = hiredis.pack_command
    return lambda connection, commands: [b"".join([pack(command) for command in commands])]


def _idle_stack(pool: Any) -> list[Any]:
    """The idle connections of ``pool`` shared by the DirectScriptRunners on it, one stack per process."""
    entry = getattr(pool, _IDLE_ATTRIBUTE, None)
    if entry is None or entry[0] != os.getpid():
        entry = (os.getpid(), [])
        setattr(pool, _IDLE_ATTRIBUTE, entry)
    return entry[1]


_AGAIN = object()  # a call ClusterScriptRunner runs again through the cluster client


def _standalone_with_pool(client: Any) -> bool:
    import redis

    return isinstance(client, redis.Redis) and isinstance(getattr(client, "connection_pool", None),
                                                          redis.ConnectionPool)


class ClusterScriptRunner:
    """Runs the registered scripts on a synchronous ``RedisCluster`` through a :class:`DirectScriptRunner` per
    node: the node of the call's first key (its slot, from the client's slot map) gets the call straight on one of
    its pooled sockets, as on a standalone server.

    Why: redis-py's cluster command path (slot lookup, command policies, the retry loop, observability hooks) and a
    node pipeline cost more than the loopback round trip itself. What redis-py does better is kept: a reply that is
    a cluster redirection or refusal (``MOVED``, ``ASK``, ``TRYAGAIN``, ``CLUSTERDOWN``), or a node that cannot be
    reached (``ConnectionError`` after the direct runner's own retry), runs that call again through the cluster
    client's ``Script``, which follows the redirection, refreshes its slot map (the next call goes to the new node)
    and retries with the client's policy. Thread-safe (one runner per node, created once; the idle stacks are the
    node pools').
    """

    def __init__(self, client: Any, scripts: dict[str, Any], retries: int) -> None:
        from redis.exceptions import AskError, ClusterDownError, RedisClusterException, TryAgainError
        from redis.exceptions import ConnectionError as RedisConnectionError

        self._client = client
        self._scripts = scripts
        self._retries = retries
        self._runners: dict[str, tuple[Any, DirectScriptRunner | None]] = {}  # node name -> (its pool, runner)
        # what the cluster client handles better: redirections (MovedError is an AskError), refusals, a lost node
        self._again = (AskError, TryAgainError, ClusterDownError, RedisConnectionError)
        self._no_slot = RedisClusterException  # e.g. SlotNotCoveredError: the client refreshes its map

    def _runner(self, key: str) -> DirectScriptRunner | None:
        """The direct runner of the node holding ``key``'s slot (None: let the cluster client route the call)."""
        try:
            node = self._client.get_node_from_key(key)
            connection = node.redis_connection or self._client.get_redis_connection(node)
        except self._no_slot:
            return None
        entry = self._runners.get(node.name)
        if entry is None or entry[0] is not connection.connection_pool:  # a new node, or its client was replaced
            runner = (DirectScriptRunner(connection, self._scripts, self._retries)
                      if _standalone_with_pool(connection) else None)
            entry = self._runners[node.name] = (connection.connection_pool, runner)
        return entry[1]

    def _through_client(self, call: ScriptCall) -> Any:
        return self._scripts[call.script](keys=call.keys, args=call.args)

    def __call__(self, call: ScriptCall) -> Any:
        """Run one script call: one round trip on the slot's node (redirections: through the cluster client)."""
        runner = self._runner(call.keys[0])
        if runner is None:
            return self._through_client(call)
        try:
            return runner(call)
        except self._again:
            return self._through_client(call)

    def run_many(self, calls: Sequence[ScriptCall]) -> list[Any]:
        """Run several calls, one pipeline per node (one round trip when they share a slot, as a request's calls
        do); error replies are returned as exceptions, redirected calls run again through the cluster client."""
        from redis.exceptions import ResponseError

        by_runner: dict[int, tuple[DirectScriptRunner | None, list[int]]] = {}
        for position, call in enumerate(calls):
            runner = self._runner(call.keys[0])
            by_runner.setdefault(id(runner), (runner, []))[1].append(position)
        replies: list[Any] = [None] * len(calls)
        for runner, positions in by_runner.values():
            part: list[Any] = [_AGAIN] * len(positions)
            if runner is not None:
                with contextlib.suppress(*self._again):  # a lost node: every call through the cluster client
                    part = runner.run_many([calls[position] for position in positions])
            for position, reply in zip(positions, part):
                if reply is _AGAIN or isinstance(reply, self._again):
                    try:
                        reply = self._through_client(calls[position])
                    except ResponseError as error:
                        reply = error
                replies[position] = reply
        return replies

    def close(self) -> None:
        """Hand every node runner's idle connections back to its pool."""
        for _, runner in list(self._runners.values()):
            if runner is not None:
                runner.close()


def direct_runner(client: Any, scripts: dict[str, Any],
                  retries: int) -> DirectScriptRunner | ClusterScriptRunner | None:
    """A DirectScriptRunner for a standalone synchronous client with a standard pool, a ClusterScriptRunner for a
    synchronous ``RedisCluster``; None otherwise (the store then goes through redis-py)."""
    from redis.cluster import RedisCluster

    if isinstance(client, RedisCluster):
        return ClusterScriptRunner(client, scripts, retries)
    if _standalone_with_pool(client):
        return DirectScriptRunner(client, scripts, retries)
    return None


def _retry_missing(replies: list[Any], calls: Sequence[ScriptCall], scripts: dict[str, Any], client: Any) -> list[Any]:
    """Run again, through redis-py's ``Script`` (which loads it), each call whose reply was ``NOSCRIPT``."""
    from redis.exceptions import NoScriptError, ResponseError

    for position, reply in enumerate(replies):
        if isinstance(reply, NoScriptError):
            call = calls[position]
            try:
                replies[position] = scripts[call.script](keys=call.keys, args=call.args, client=client)
            except ResponseError as error:
                replies[position] = error
    return replies


def _pipeline(client: Any, calls: Sequence[ScriptCall], scripts: dict[str, Any]) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for call in calls:
        pipe.evalsha(scripts[call.script].sha, len(call.keys), *call.keys, *call.args)
    return _retry_missing(pipe.execute(raise_on_error=False), calls, scripts, client)


def run_pipelined(client: Any, calls: Sequence[ScriptCall], scripts: dict[str, Any]) -> list[Any]:
    """Run ``calls`` on a synchronous redis-py client: one round trip per node (error replies as exceptions)."""
    if not hasattr(client, "nodes_manager"):
        return _pipeline(client, calls, scripts)
    from redis.exceptions import ResponseError

    by_node: dict[str, tuple[Any, list[int]]] = {}
    for position, call in enumerate(calls):
        node = client.get_node_from_key(call.keys[0])
        by_node.setdefault(node.name, (node, []))[1].append(position)
    replies: list[Any] = [None] * len(calls)
    for node, positions in by_node.values():
        part = _pipeline(client.get_redis_connection(node), [calls[i] for i in positions], scripts)
        for position, reply in zip(positions, part):
            if isinstance(reply, ResponseError) and str(reply).startswith(("MOVED", "ASK")):
                call = calls[position]  # the slot moved: the cluster client routes it (and refreshes its map)
                try:
                    reply = scripts[call.script](keys=call.keys, args=call.args)
                except ResponseError as error:
                    reply = error
            replies[position] = reply
    return replies


async def run_pipelined_async(client: Any, calls: Sequence[ScriptCall], scripts: dict[str, Any]) -> list[Any]:
    """Run ``calls`` on an asyncio redis-py client: one pipeline (a cluster: one per node, at once; redis-py
    follows a redirection), then each ``NOSCRIPT`` call again through its ``Script`` (which loads it)."""
    from redis.exceptions import NoScriptError, ResponseError

    async def one(call: ScriptCall) -> Any:
        try:
            return await scripts[call.script](keys=call.keys, args=call.args)
        except ResponseError as error:
            return error

    pipe = client.pipeline(transaction=False)
    for call in calls:  # execute_command: a cluster pipeline refuses the evalsha method, not the command
        pipe.execute_command("EVALSHA", scripts[call.script].sha, len(call.keys), *call.keys, *call.args)
    replies = list(await pipe.execute(raise_on_error=False))
    for position, reply in enumerate(replies):
        if isinstance(reply, NoScriptError):
            replies[position] = await one(calls[position])
    return replies
