"""The `policy:` section: the initial policy, and LoRA adapters on it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from agent_core.config._base import Section


class PolicyLoraConfig(Section):
    """LoRA adapters (peft) on the policy: only they train; the reference is the same module with
    them disabled; a checkpoint is the adapter plus the base model's path (agent_core/training/lora.py)."""

    rank: int = Field(16, ge=1, description="rank r of each adapter's A (r x in) and B (out x r) matrices")
    alpha: float = Field(32.0, gt=0, description="scaling numerator: the adapter's update is (alpha / rank) * B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training")
    target_modules: tuple[str, ...] = Field(
        ("q_proj", "k_proj", "v_proj", "o_proj"), min_length=1,
        description="names (last component) of the Linear layers that get an adapter, e.g. the attention "
        "projections; add gate_proj, up_proj, down_proj for the MLP too")


class PolicyConfig(Section):
    """Where the initial policy comes from.

    tiny: a Llama-architecture model built from scratch with a BPE tokenizer trained on the task's
    text (seconds), then pretrained to copy (`pretrain_steps`: ~90 s on 2 cores at the default size).
    path: any local transformers checkpoint directory. smollm2: the
    SmolLM2-135M-Instruct directory made by `make smollm2` (or `path` if given).
    A `path` with source tiny is refused at load, not ignored: a path never switches the source.
    """

    source: Literal["tiny", "path", "smollm2"] = Field(
        "tiny", description="tiny: build a small model from scratch (seconds); path: a local checkpoint at `path`; "
        "smollm2: the folder `make smollm2` makes")
    path: str | None = Field(
        None, description="the checkpoint folder of source path (or smollm2); refused with source tiny, which "
        "builds its model from scratch: set policy.source=path too"
    )
    vocab_size: int = Field(1024, ge=300, description="tiny: target size of the BPE vocabulary trained on the task's "
                            "text (fewer if the text has too few merges); must hold bytes and special tokens")
    hidden_size: int = Field(128, ge=8, description="tiny: width of the model (divisible by num_heads)")
    num_layers: int = Field(4, ge=1, description="tiny: transformer layers")
    num_heads: int = Field(4, ge=1, description="tiny: attention heads per layer")
    intermediate_size: int = Field(344, ge=8, description="tiny: width of each layer's MLP")
    seed: int = Field(0, description="tiny: seed of the weight initialisation and of the induction pretraining")
    pretrain_steps: int = Field(
        1000, ge=0, description="tiny: steps of induction pretraining (copy a repeated token span) before the warm "
        "start, the copying skill a pretrained model brings (agent_core/training/pretrain.py); 0 = none"
    )
    pretrain_lr: float = Field(1e-3, gt=0, description="tiny: learning rate of the induction pretraining")
    lora: PolicyLoraConfig | None = Field(
        None, description="train LoRA adapters instead of every weight (unset: full fine-tuning); the initial "
        "policy stays the full base model, which the adapters and the KL reference share")

    @model_validator(mode="after")
    def _path_needs_its_source(self) -> "PolicyConfig":
        # Refused rather than implied: an implied source would depend on whether some layer (a shipped
        # config says `source: tiny`) spelled the default out, and a silently ignored path trains the
        # wrong model for minutes before anyone notices.
        if self.source == "tiny" and self.path:
            raise ValueError(f"policy.path={self.path} is set but policy.source is 'tiny', which builds a model from "
                             "scratch and would ignore it: set policy.source=path to start from that checkpoint "
                             "(smollm2 for a converted SmolLM2 folder), or remove policy.path")
        return self
