"""Does a server (an engine, or a gateway in front of one) honour vLLM's ``priority`` field?

    .venv/bin/python scripts/priority_probe.py --url http://127.0.0.1:18100 [--model tiny] [--words 900]

Sends three distinct prompts of ``--words`` random words (about 5,000 tokens on the bench models), one token each,
0.2 s apart: A with priority 0, then B with priority 1000, then C with priority 1. While A prefills, B and C wait; an
engine that schedules by priority (vLLM with ``--scheduling-policy priority``) answers C before B, one that serves
first come first served (vLLM's default policy, or a gateway that drops the field) answers B before C. Prints the
order and each answer's time. Point ``--url`` at a gateway with a single replica behind it to check that the gateway
passes the field on (``cpmemory serve --engine-priority --upstream URL``, docs/server.md "Engine priority").
A measuring aid, not part of the package.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx


async def _one(client: httpx.AsyncClient, url: str, model: str, name: str, priority: int, delay: float, words: int,
               started: float, answered: list[tuple[str, float, int]]) -> None:
    await asyncio.sleep(delay)
    text = " ".join(f"{name}{random.randint(0, 10**6)}" for _ in range(words))
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1, "priority": priority}
    response = await client.post(f"{url.rstrip('/')}/v1/chat/completions", json=body, timeout=600)
    answered.append((name, time.perf_counter() - started, response.status_code))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--words", type=int, default=900)
    args = parser.parse_args()
    answered: list[tuple[str, float, int]] = []
    started = time.perf_counter()
    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(_one(client, args.url, args.model, name, priority, delay, args.words, started, answered)
                               for name, priority, delay in (("A", 0, 0.0), ("B", 1000, 0.2), ("C", 1, 0.4))))
    for name, seconds, status in answered:
        print(f"{name}: HTTP {status} after {seconds:.2f} s")
    order = "".join(name for name, _, _ in answered)
    if any(status != 200 for _, _, status in answered):
        print("some requests failed: see the HTTP status codes")
    elif order.index("C") < order.index("B"):
        print(f"order {order}: priority honoured (C, priority 1, before B, priority 1000, sent earlier)")
    else:
        print(f"order {order}: first come first served (the priority was ignored or dropped)")


if __name__ == "__main__":
    asyncio.run(main())
