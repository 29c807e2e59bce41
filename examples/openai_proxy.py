"""A three-turn conversation through ``cpmemory serve`` with the official ``openai`` SDK.

Start an engine and the proxy first (no GPU needed: ``cpmemory mock-engine`` answers like a vLLM server)::

    cpmemory mock-engine --port 8000 &
    cpmemory serve --engine http://127.0.0.1:8000 --port 8080 &
    python examples/openai_proxy.py            # needs: pip install openai

Each call is an ordinary ``client.chat.completions.create``; the retrieved documents ride in
``extra_body={"cpmemory": {...}}`` and what cpmemory did comes back in ``response.model_extra["cpmemory"]``.
The client sends its whole history each turn, as OpenAI clients do (sending only the new question works too).
A document the conversation already sent becomes a short reference instead of its full text, and the engine's
prefix cache holds the earlier turns' prompt. ``--base-url`` points at another proxy; ``CPMEMORY_API_KEY`` is sent
as the API key when the proxy was started with ``--api-key``.
"""
from __future__ import annotations

import argparse
import os
import time

DOCUMENTS = {
    "rhone": "The Rhone rises in the Swiss Alps, crosses Lake Geneva and flows through Lyon to the Mediterranean.",
    "saone": "The Saone joins the Rhone in Lyon after flowing south from the Vosges mountains.",
    "lyon": "Lyon, the third-largest city of France, lies where the Rhone and the Saone meet.",
    "alps": "Mont Blanc, on the border of France and Italy, is the highest peak of the Alps.",
}
TURNS = [
    ("Where does the Rhone flow?", ["rhone", "lyon"]),
    ("Which river joins it in Lyon?", ["saone", "rhone", "lyon"]),
    ("Where does the Rhone start?", ["alps", "rhone"]),
]


def wait_until_ready(base_url: str, timeout_s: float = 60.0) -> None:
    """Wait for the proxy's readiness endpoint (it answers 200 once an engine and the store can serve)."""
    import httpx  # installed with the openai SDK

    ready_url = base_url.rstrip("/").removesuffix("/v1") + "/readyz"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(ready_url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"the proxy at {ready_url} is not ready: start it with cpmemory serve (see above)")
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1", help="the proxy's OpenAI base URL")
    parser.add_argument("--conversation", default="openai-quickstart", help="the cpmemory conversation id")
    arguments = parser.parse_args()
    try:
        from openai import OpenAI
    except ImportError:
        raise SystemExit("this example needs the openai SDK: pip install openai") from None

    wait_until_ready(arguments.base_url)
    client = OpenAI(base_url=arguments.base_url, api_key=os.environ.get("CPMEMORY_API_KEY", "not-needed"))
    model = client.models.list().data[0].id  # the proxy relays the engine's model list
    print(f"model {model} through {arguments.base_url}")
    history: list[dict[str, str]] = [{"role": "system", "content": "Answer from the documents, briefly."}]
    for number, (question, document_ids) in enumerate(TURNS, start=1):
        history.append({"role": "user", "content": question})
        response = client.chat.completions.create(
            model=model, messages=history, max_tokens=64,  # type: ignore[arg-type]
            extra_body={"cpmemory": {"conversation_id": arguments.conversation,
                                     "blocks": [{"id": name, "text": DOCUMENTS[name]} for name in document_ids]}})
        answer = response.choices[0].message.content or ""
        history.append({"role": "assistant", "content": answer})
        info = (response.model_extra or {})["cpmemory"]
        statuses = ", ".join(f"{decision['block_id']} {decision['status']}" for decision in info["decisions"])
        print(f"turn {info['turn']}: {statuses} | prompt {info['prompt_tokens']} tokens, "
              f"{info['cached_tokens']} cached, {info['tokens_deduplicated']} deduplicated")
        print(f"  answer: {answer}")
        if number == len(TURNS):
            print(f"conversation {info['conversation_id']}: {number} turns committed" if info["committed"]
                  else "the last turn was not committed (see the proxy's log)")


if __name__ == "__main__":
    main()
