"""The agent program bench/gateway.py runs through the gateway: standard library only (it starts in
tens of milliseconds, so what is timed is the gateway path, not a client library's import).

It behaves like the benchmark's random policy in the in-process loop: it asks for a completion,
appends the reply and the next observation the prompt's metadata gives ("observations": the texts
the in-process loop's episode of the same prompt saw, with their role), and asks again, until the
gateway refuses (the episode's call budget, rollout.max_steps) or the observations run out. Its
answer is the last reply's text.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request


def ask(messages: list[dict]) -> str | None:
    """The reply's text, or None when the gateway refuses (a budget's 400)."""
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "policy", "messages": messages}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.load(response)["choices"][0]["message"]["content"] or ""
    except urllib.error.HTTPError as error:
        if error.code == 400:
            return None
        raise


def main() -> int:
    prompt = json.load(sys.stdin)
    messages = list(prompt["messages"])
    observations = prompt["metadata"].get("observations", [])
    answer = ""
    for k in range(len(observations) + 1):
        reply = ask(messages)
        if reply is None:
            break
        answer = reply
        if k < len(observations):
            role, text = observations[k]
            messages += [{"role": "assistant", "content": reply}, {"role": role, "content": text}]
    print(json.dumps({"answer": answer}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
