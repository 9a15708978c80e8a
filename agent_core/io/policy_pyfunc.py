"""The code of every registered policy model (MLflow "models from code"; docs/architecture.md §8).

`agent_core.io.model_registry.save_policy_model` copies this file into each logged model, so nothing here
imports agent_core, and nothing in the pipeline imports this module (MLflow executes it and looks for the
`set_model` call at the bottom). The one artifact, "checkpoint", is a transformers `save_pretrained`
directory; `predict` takes prompts or chat conversations and returns one string (new tokens only) per prompt.
Design notes: docs/architecture.md §11 (agent_core/io/policy_pyfunc.py).
"""

from __future__ import annotations

from typing import Any

from mlflow.models import set_model
from mlflow.pyfunc import PythonModel

DEFAULT_PARAMS = {"max_new_tokens": 128, "temperature": 0.0, "top_p": 1.0}


def _is_message(item: Any) -> bool:
    return isinstance(item, dict) and "role" in item and "content" in item


def _is_conversation(item: Any) -> bool:
    return isinstance(item, (list, tuple)) and len(item) > 0 and all(_is_message(m) for m in item)


def _plain(value: Any) -> Any:
    """numpy arrays (and scalars), as pandas and MLflow's scoring server hand them over, as lists."""
    return value.tolist() if hasattr(value, "tolist") else value


def _one(item: Any) -> str | list[dict]:
    """One prompt: a raw string or a conversation (list of messages)."""
    item = _plain(item)
    if isinstance(item, str) or _is_conversation(item):
        return item if isinstance(item, str) else [dict(m) for m in item]
    if isinstance(item, dict):
        for key in ("messages", "prompt"):
            if key in item and item[key] is not None:
                return _one(item[key])
    raise ValueError(
        f"cannot read a prompt from {str(item)[:200]!r}: give a string, a list of {{'role', 'content'}} "
        "messages, or a record with a 'prompt' or 'messages' field"
    )


def prompts_of(model_input: Any) -> list[str | list[dict]]:
    """Every prompt in `model_input`, in order (see the module docstring for the accepted shapes)."""
    if hasattr(model_input, "to_dict") and hasattr(model_input, "columns"):  # a pandas DataFrame
        columns = [c for c in ("messages", "prompt") if c in model_input.columns] or list(model_input.columns[:1])
        return [_one(row[columns[0]]) for row in model_input.to_dict(orient="records")]
    model_input = _plain(model_input)
    if isinstance(model_input, str) or _is_conversation(model_input):
        return [_one(model_input)]
    if isinstance(model_input, dict):
        key = next((k for k in ("messages", "prompt") if k in model_input), None)
        if key is None:
            raise ValueError(f"a dict input needs a 'prompt' or 'messages' key, got keys {sorted(model_input)}")
        values = _plain(model_input[key])
        single = isinstance(values, str) or _is_conversation(values)
        return [_one(values)] if single else [_one(v) for v in values]
    return [_one(item) for item in model_input]


class PolicyModel(PythonModel):
    """A causal LM policy from its checkpoint directory; generation as in module docstring."""

    def load_context(self, context) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = context.artifacts["checkpoint"]
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()

    def predict(self, context, model_input, params: dict[str, Any] | None = None) -> list[str]:
        settings = {**DEFAULT_PARAMS, **{k: v for k, v in (params or {}).items() if v is not None}}
        return [self._generate(prompt, settings) for prompt in prompts_of(model_input)]

    def _token_ids(self, prompt: str | list[dict]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        rendered = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]

    def _generate(self, prompt: str | list[dict], settings: dict[str, Any]) -> str:
        """One prompt at a time: no padding, so nothing depends on the tokenizer's padding side."""
        import torch
        from transformers import GenerationConfig

        ids = self._token_ids(prompt)
        if not ids:
            raise ValueError("empty prompt: nothing to continue")
        temperature = float(settings["temperature"])
        ids_config = self.model.generation_config
        eos = ids_config.eos_token_id if ids_config.eos_token_id is not None else self.tokenizer.eos_token_id
        pad = ids_config.pad_token_id if ids_config.pad_token_id is not None else eos
        # An explicit config: the checkpoint's carries only token ids (agent_core/training/model.py),
        # so transformers' sampling defaults (top_k=50) must not fill in the rest.
        generation = GenerationConfig(
            max_new_tokens=int(settings["max_new_tokens"]), do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None, top_p=float(settings["top_p"]) if temperature > 0 else None,
            top_k=None, eos_token_id=eos, pad_token_id=pad,
        )
        input_ids = torch.tensor([ids], dtype=torch.long)
        with torch.no_grad():
            output = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=generation)
        return self.tokenizer.decode(output[0, len(ids):].tolist(), skip_special_tokens=True)


set_model(PolicyModel())
