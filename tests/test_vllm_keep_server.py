"""rollout.vllm.keep_server on stand-in servers (fast); tests/test_vllm_flow.py runs the real server."""

from __future__ import annotations

from agent_core.rollout.vllm_server import VLLMOptions


def test_an_engine_whose_server_is_kept_leaves_it_in_the_pool_and_one_that_is_not_stops_it():
    """The switch itself: a closed engine stops its pooled server only when it is not to be kept."""
    from agent_core.rollout import vllm_engine

    class StandIn:
        port, stopped = 0, 0

        def __init__(self, keep: bool):
            self.options = VLLMOptions(keep_server=keep)

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
