"""vLLM worker extension: reload a checkpoint's weights in place, then re-pack shared output layers.

Imported by vLLM's worker processes inside the vLLM virtualenv (`--worker-extension-cls
agentr1_vllm_ext.WeightReloadExtension`, this directory on PYTHONPATH); it must import nothing of
the pipeline. Called through `POST /collective_rpc {"method": "reload_policy_weights", ...}`.

Why the re-pack: vLLM's in-place `reload_weights` copies new values into the parameters, but on the
CPU backend an embedding-shaped layer used as the output head keeps a packed copy of its weight,
made once after loading (`UnquantizedEmbeddingMethod.process_weights_after_loading`). With tied
input/output embeddings (SmolLM2, small Qwen2.5) nothing re-packs that copy, so the server would
keep sampling from the old head. Re-running that step for every embedding layer fixes it; on GPU
it is a no-op.
"""

from __future__ import annotations


class WeightReloadExtension:
    def reload_policy_weights(self, weights_path: str) -> int:
        """Load `weights_path` into this worker's model; returns how many embedding layers were re-packed."""
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        repacked = 0
        for module in self.model_runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod) and getattr(module, "weight", None) is not None:
                method.process_weights_after_loading(module)
                repacked += 1
        return repacked
