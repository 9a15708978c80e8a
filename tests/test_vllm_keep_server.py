"""rollout.vllm.keep_server on stand-in servers (fast); tests/test_vllm_flow.py runs the real server,
tests/test_vllm_gpu_path.py the sleep that replaces the stop on a GPU."""

from __future__ import annotations

from agent_core.config import VLLMConfig


def test_an_engine_whose_server_is_kept_leaves_it_in_the_pool_and_one_that_is_not_stops_it():
    """The switch itself: a closed engine stops its pooled server only when it is not to be kept."""
    from agent_core.rollout import vllm_engine

    class StandIn:
        port, stopped, users, asleep = 0, 0, 0, False

        def __init__(self, keep: bool):
            self.options = VLLMConfig(keep_server=keep)

        def stop(self):
            self.stopped += 1

    kept, released = StandIn(True), StandIn(False)
    vllm_engine._POOL.update({"kept": kept, "released": released})
    try:
        for server in (kept, released):
            vllm_engine.VLLMEngine(server, tokenizer=None).close()
        assert (kept.stopped, released.stopped) == (0, 1)
        assert list(vllm_engine._POOL) == ["kept"]
    finally:
        vllm_engine._POOL.pop("kept", None)
        vllm_engine._POOL.pop("released", None)


def test_a_server_that_is_not_kept_is_stopped_only_when_its_last_engine_closes():
    """A replica builds its next engine before closing the old one, on the same pooled server: closing
    the old one must not stop the server the new one generates with."""
    from agent_core.rollout import vllm_engine

    class StandIn:
        port, stopped, users, asleep = 0, 0, 0, False
        options = VLLMConfig(keep_server=False)

        def stop(self):
            self.stopped += 1

    server = StandIn()
    vllm_engine._POOL["shared"] = server
    try:
        old, new = vllm_engine.VLLMEngine(server, tokenizer=None), vllm_engine.VLLMEngine(server, tokenizer=None)
        old.close()
        assert server.stopped == 0 and "shared" in vllm_engine._POOL
        new.close()
        assert server.stopped == 1 and "shared" not in vllm_engine._POOL
    finally:
        vllm_engine._POOL.pop("shared", None)
