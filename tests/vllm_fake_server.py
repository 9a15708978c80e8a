"""A stand-in for vLLM's OpenAI API server, run as `python -m vllm.entrypoints.openai.api_server` by
`fake_vllm_package` (tests/test_vllm_gpu_path.py): the real command line and environment, the endpoints
our server client calls, and a log of every call (one JSON line each, $FAKE_VLLM_LOG).

What it enforces, as vLLM does or as a GPU needs: /sleep only sleeps with --enable-sleep-mode (on
CPU it is a no-op); the LoRA endpoints exist only with VLLM_ALLOW_RUNTIME_LORA_UPDATING and
--enable-lora; an adapter name is loaded once; a request names the served model or a loaded
adapter. A completion, a weight reload or an adapter load while asleep is answered 503 and logged
as a violation (on a GPU the weights are not there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

_LOCK = threading.Lock()


def _log(event: dict) -> None:
    with _LOCK, open(os.environ["FAKE_VLLM_LOG"], "a") as log:
        log.write(json.dumps({"pid": os.getpid(), **event}) + "\n")


class _State:
    def __init__(self, args, extra: list[str]):
        self.args, self.extra = args, extra
        self.asleep = False
        self.adapters: dict[str, str] = {}


def _handler(state: _State):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _answer(self, code: int, body) -> None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            path = urlparse(self.path).path
            if path == "/health":
                return self._answer(200, "")
            if path == "/is_sleeping":
                return self._answer(200, {"is_sleeping": state.asleep})
            self._answer(404, {"error": path})

        def do_POST(self):
            url = urlparse(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"null")
            event = {"call": url.path, "query": parse_qs(url.query), "asleep": state.asleep}
            code, answer = self._dispatch(url.path, event, body)
            event["status"] = code
            _log(event)
            self._answer(code, answer)

        def _dispatch(self, path: str, event: dict, body):
            lora_api = (os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true")
                        and state.args.enable_lora)
            if state.asleep and path in ("/v1/completions", "/collective_rpc", "/v1/load_lora_adapter"):
                event["violation"] = f"{path} while asleep"
                return 503, {"error": "asleep"}
            if path == "/sleep":
                state.asleep = state.args.enable_sleep_mode  # vLLM's CPU build: a no-op
                return 200, {"status": "sleeping", "level": int(event["query"].get("level", ["1"])[0])}
            if path == "/wake_up":
                state.asleep = False
                return 200, {"status": "awake"}
            if path in ("/collective_rpc", "/reset_prefix_cache"):
                event["body"] = body
                return 200, {"results": [0]} if path == "/collective_rpc" else ""
            if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") and not lora_api:
                return 404, {"detail": "Not Found"}
            if path == "/v1/load_lora_adapter":
                event["name"], event["path"] = body["lora_name"], body["lora_path"]
                if body["lora_name"] in state.adapters:
                    return 400, {"error": f"The lora adapter '{body['lora_name']}' has already been loaded."}
                if not (Path(body["lora_path"]) / "adapter_config.json").is_file():
                    return 400, {"error": "no adapter_config.json"}
                state.adapters[body["lora_name"]] = body["lora_path"]
                return 200, f"Success: LoRA adapter '{body['lora_name']}' added successfully."
            if path == "/v1/unload_lora_adapter":
                event["name"] = body["lora_name"]
                if state.adapters.pop(body["lora_name"], None) is None:
                    return 404, {"error": "unknown adapter"}
                return 200, f"Success: LoRA adapter '{body['lora_name']}' removed successfully."
            if path == "/v1/completions":
                return self._complete(event, body)
            return 404, {"error": path}

        def _complete(self, event: dict, body):
            event["model"] = body["model"]
            if body["model"] != state.args.served_model_name and body["model"] not in state.adapters:
                return 404, {"error": f"The model `{body['model']}` does not exist."}
            stop = (body.get("stop_token_ids") or [1])[0]
            choices = [{"index": i, "token_ids": [5, stop], "logprobs": {"token_logprobs": [-0.5, -0.25]}}
                       for i, _ in enumerate(body["prompt"])]
            return 200, {"choices": choices}

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--served-model-name")
    parser.add_argument("--port", type=int)
    parser.add_argument("--enable-sleep-mode", action="store_true")
    parser.add_argument("--enable-lora", action="store_true")
    args, extra = parser.parse_known_args()
    _log({"call": "start", "argv": sys.argv[1:],
          "env": {k: os.environ.get(k) for k in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_SERVER_DEV_MODE")}})
    server = ThreadingHTTPServer(("127.0.0.1", args.port), _handler(_State(args, extra)))
    server.serve_forever()


if __name__ == "__main__":
    main()
