"""The vLLM engine: token ids in, token ids + log-probs out, through a vLLM server (docs/architecture.md §6).

Prompts go to `/v1/completions` as token-id lists with `return_token_ids`; log-probs are vLLM's
`processed_logprobs`, as the HF engine records them except with top_p < 1 and greedy calls (see `generate`).
Servers outlive a rollout: a process-wide pool, new weights loaded in place (`VLLMServer.reload`), a kept
server asleep between rollouts on GPU; `shutdown_servers` stops them.
Design notes: docs/architecture.md §11 (agent_core/rollout/vllm_engine.py).
"""

from __future__ import annotations

import atexit
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import httpx

from agent_core.config import VLLMConfig
from agent_core.io.checkpoints import load_tokenizer
from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.engine import Generation, SamplingParams, check_request, seeds_of
from agent_core.rollout.vllm_checkpoints import architecture_key, lora_checkpoint
from agent_core.rollout.vllm_server import (
    ExternalVLLMServer, VLLMServer, VLLMServerError, vllm_python,
)

_POOL: dict[tuple, VLLMServer] = {}
_POOL_LOCK = threading.Lock()


class VLLMEngine:
    """Engine backed by a pooled vLLM server holding `policy_dir`'s weights.

    `max_concurrent_calls` generate calls may be in flight at once (the server batches them
    continuously). A seeded call sends one request per prompt, seeded with that prompt's seed
    (`seed + i`, or `prompt_seeds[i]`): vLLM applies a request's seed to every prompt in it, which
    would give a GRPO group identical samples.
    """

    def __init__(self, server: VLLMServer, tokenizer, *, max_batch_size: int = 64, max_concurrent_calls: int = 8):
        self.server = server
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_concurrent_calls = max_concurrent_calls
        self._requests = ThreadPoolExecutor(max_workers=max(4, max_batch_size), thread_name_prefix="vllm-request")
        self._closed = False
        with _POOL_LOCK:
            server.users += 1

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """One continuation per prompt, in order (see the Engine protocol).

        Log-probs: log_softmax(logits / temperature) at the sampled token with top_p = 1; with
        top_p < 1 they are taken after vLLM's top-p truncation (the HF engine's are before it);
        with temperature 0 they are the unscaled ones, as the HF engine records them.
        """
        check_request(prompts, params)
        if not prompts:
            return []
        _awake(self.server)
        stop_ids = list(params.stop_token_ids) or list(eos_token_ids(self.tokenizer))
        # ids outside the vocabulary can never be sampled (the HF engine simply never meets them); vLLM rejects them
        stop_ids = [t for t in stop_ids if 0 <= t < len(self.tokenizer)]
        seeds = seeds_of(params, len(prompts))
        if seeds is None:
            chunks = [(list(range(s, min(s + self.max_batch_size, len(prompts)))), None)
                      for s in range(0, len(prompts), self.max_batch_size)]
        else:
            chunks = [([i], seeds[i]) for i in range(len(prompts))]
        futures = [self._requests.submit(self._complete, [list(prompts[i]) for i in rows], params, stop_ids, seed)
                   for rows, seed in chunks]
        results: list[Generation] = []
        for future in futures:
            results.extend(future.result())
        return results

    def _complete(self, prompts: list[list[int]], params: SamplingParams, stop_ids: list[int],
                  seed: int | None) -> list[Generation]:
        body = {
            "model": self.server.model_name, "prompt": prompts, "max_tokens": params.max_new_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "top_k": 0, "logprobs": 0,
            "return_token_ids": True, "stop_token_ids": stop_ids, "ignore_eos": True,
            "skip_special_tokens": False, "min_p": 0.0, "repetition_penalty": 1.0,
        }
        if seed is not None:
            body["seed"] = seed
        answer = self.server.post("/v1/completions", body)
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts):
            raise VLLMServerError(f"vLLM returned {len(choices)} choices for {len(prompts)} prompts")
        return [_generation(choice, set(stop_ids)) for choice in choices]

    def close(self) -> None:
        """Release this engine. When it was the server's last one (the rollout ended, training is next) the
        server stays in the pool for the next rollout, asleep if it sleeps between rollouts, or is
        stopped when its options say not to keep it (`keep_server: false`: its memory goes back)."""
        if self._closed:
            return
        self._closed = True
        self._requests.shutdown(wait=False)
        with _POOL_LOCK:
            self.server.users -= 1
            last = self.server.users <= 0
        if not last:
            return  # another engine (a replica's next one) still serves from it
        if not self.server.options.keep_server:
            release_server(self.server)
        elif getattr(self.server, "sleeps_between_rollouts", False):
            _put_to_sleep(self.server)


def _put_to_sleep(server: VLLMServer) -> None:
    with _POOL_LOCK:
        if server.users > 0 or server.asleep or not server.alive:
            return
        started = time.perf_counter()
        try:
            server.sleep()
        except VLLMServerError as error:  # training can still run; it only has less memory
            print(f"vllm: the server on port {server.port} could not sleep ({error}); it keeps its memory")
            return
    print(f"vllm: the server on port {server.port} sleeps while training runs ({time.perf_counter() - started:.1f} s)")


def _awake(server: VLLMServer) -> None:
    """Wake `server` if it sleeps (level 1 kept its weights): no request may reach a sleeping server."""
    if getattr(server, "asleep", False):
        with _POOL_LOCK:
            _wake(server)


def _wake(server: VLLMServer) -> None:
    """(Under _POOL_LOCK.)"""
    if server.asleep:
        started = time.perf_counter()
        server.wake_up()
        print(f"vllm: woke the server on port {server.port} in {time.perf_counter() - started:.1f} s")


def _generation(choice: dict, stop_ids: set[int]) -> Generation:
    ids = [int(t) for t in choice["token_ids"]]
    logprobs = [float(lp) for lp in choice["logprobs"]["token_logprobs"]]
    if not ids or len(ids) != len(logprobs):
        raise VLLMServerError(f"vLLM returned {len(ids)} token ids and {len(logprobs)} log-probs for one prompt")
    # finish_reason "stop" from vLLM also covers stop strings; ours means "ended on a stop token"
    return Generation(ids, logprobs, "stop" if ids[-1] in stop_ids else "length")


def pooled_server(policy_dir: Path, max_model_len: int, options: VLLMConfig) -> VLLMServer:
    """A healthy, awake server serving `policy_dir` (its weights, or its LoRA adapter on its base model):
    reused, woken and loaded in place when possible."""
    policy_dir = Path(policy_dir)
    lora = lora_checkpoint(policy_dir)
    model_dir = lora.base_dir if lora else policy_dir
    key = (str(vllm_python(options)), architecture_key(model_dir), max_model_len, options)
    with _POOL_LOCK:
        server = _POOL.get(key)
        if server is not None and not server.alive:
            print(f"vllm: the server on port {server.port} had died; starting a new one. Its last output:\n"
                  f"{server.output_tail(10)}")
            server.stop()
            del _POOL[key]
            server = None
        if server is None:
            server = _start(model_dir, max_model_len, options, lora.rank if lora else None)
            _POOL[key] = server
        _wake(server)  # before anything else reaches it: a sleeping server has no weights on the GPU
        if server.loaded_dir != policy_dir:
            server = _POOL[key] = _load_weights(server, policy_dir)
        return server


def _start(model_dir: Path, max_model_len: int, options: VLLMConfig, lora_rank: int | None,
           restarts: int = 0) -> VLLMServer:
    return VLLMServer(model_dir, max_model_len, options, lora_rank=lora_rank, restarts=restarts).start()


def _load_weights(server: VLLMServer, policy_dir: Path) -> VLLMServer:
    """`server` serving `policy_dir`, loaded in place, or a restarted server serving it. A LoRA adapter
    needs a server started with --enable-lora on its base model for its rank: otherwise it restarts."""
    lora = lora_checkpoint(policy_dir)
    fits = lora is None or (server.lora_rank is not None and lora.rank <= server.lora_rank
                            and Path(server.model_dir).resolve() == lora.base_dir)
    if server.options.weight_sync == "reload" and fits:
        try:
            seconds = server.load(policy_dir)
            what = f"the adapter {policy_dir.name} as {server.adapter_name}" if lora else policy_dir.name
            print(f"vllm: loaded {what} into the running server in {seconds * 1000:.0f} ms")
            return server
        except (VLLMServerError, httpx.HTTPError) as error:
            print(f"vllm: in-place reload failed ({error}); restarting the server")
    started = time.perf_counter()
    server.stop()
    model_dir = lora.base_dir if lora else policy_dir
    fresh = _start(model_dir, server.max_model_len, server.options, lora.rank if lora else None, server.restarts + 1)
    if lora:
        fresh.load_adapter(policy_dir)
    print(f"vllm: restarted the server with {policy_dir.name} in {time.perf_counter() - started:.0f} s")
    return fresh


_EXTERNAL: dict[str, ExternalVLLMServer] = {}


def external_engine(url: str, policy_dir: Path, options) -> "VLLMEngine":
    """An engine over the external server at `url`, holding `policy_dir`'s weights (loaded in place
    when it holds others). options: the EngineOptions of the rollout."""
    with _POOL_LOCK:
        server = _EXTERNAL.get(url)
        if server is None:
            server = _EXTERNAL[url] = ExternalVLLMServer(Path(policy_dir), options.max_model_len, options.vllm,
                                                         url=url).start()
            server.loaded_dir = None  # unknown: what it serves is replaced by the policy below
        if server.loaded_dir != Path(policy_dir):
            server.load(Path(policy_dir))  # a LoRA adapter needs the server started with --enable-lora
    return VLLMEngine(server, load_tokenizer(Path(policy_dir)), max_batch_size=options.max_batch_size,
                      max_concurrent_calls=options.vllm.max_concurrent_calls)


def release_server(server) -> None:
    """Stop `server` and drop it from the pool, if it is a pooled one (an external server is left alone)."""
    with _POOL_LOCK:
        keys = [key for key, pooled in _POOL.items() if pooled is server]
        for key in keys:
            del _POOL[key]
    if keys:
        server.stop()
        print(f"vllm: stopped the server on port {server.port} (rollout.vllm.keep_server: false)")


def shutdown_servers() -> None:
    """Stop every pooled vLLM server (flows call this when they end; also run at exit)."""
    with _POOL_LOCK:
        servers = list(_POOL.values())
        _POOL.clear()
    for server in servers:
        server.stop()


def server_stats() -> list[dict]:
    """Per pooled server: port, loaded checkpoint, in-place reloads and restarts (for reports and tests)."""
    with _POOL_LOCK:
        return [{"port": s.port, "loaded_dir": str(s.loaded_dir), "reloads": s.reloads, "restarts": s.restarts,
                 "adapter": s.adapter_name, "sleeps": s.sleeps, "asleep": s.asleep} for s in _POOL.values()]


atexit.register(shutdown_servers)
