"""vime.devtools.make_tiny_model: small random checkpoints of each family, with the real tokenizer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vime.backends.base import SamplingParams, Sequence
from vime.backends.torch_rollout import TorchRolloutEngine
from vime.devtools.make_tiny_model import ARCHS, full_config, make_tiny_model
from vime.devtools.shared_data import shared_data

TOKENIZER = shared_data() / "qwen3-tokenizer"
CLASSES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}


@pytest.fixture(scope="module")
def tokenizer() -> Path:
    if not (TOKENIZER / "tokenizer.json").is_file():
        pytest.skip(f"the Qwen3 tokenizer is not at {TOKENIZER} (the shared data folder is absent on this machine)")
    return TOKENIZER


@pytest.mark.parametrize("arch", ARCHS)
def test_a_tiny_model_of_each_family_loads_and_generates(arch, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = make_tiny_model(arch, tokenizer, tmp_path / arch, seed=1)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokens = AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == CLASSES[arch]
    assert model.config.vocab_size % 64 == 0 and model.config.vocab_size >= len(tokens) == 151_669
    assert model.config.eos_token_id == tokens.eos_token_id == tokens.convert_tokens_to_ids("<|im_end|>")
    if arch != "qwen3":
        assert any("experts" in name for name, _ in model.named_parameters())
    prompt = tokens.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                        enable_thinking=False)
    ids = prompt if isinstance(prompt, list) else prompt["input_ids"]
    assert tokens.decode(ids).endswith("<think>\n\n</think>\n\n")
    engine = TorchRolloutEngine(str(folder), seed=0)
    sequence = Sequence(0, list(ids), SamplingParams(max_new_tokens=3))
    engine.add([sequence])
    while engine.busy:
        engine.step()
    assert len(sequence.response_ids) == len(sequence.logprobs) == 3
    with torch.no_grad():
        logits = model(torch.tensor([ids + sequence.response_ids[:2]])).logits[0, len(ids) - 1:-1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(sequence.response_ids[:2]).unsqueeze(-1))
    assert torch.allclose(expected.squeeze(-1), torch.tensor(sequence.logprobs[:2]), atol=1e-4)


def test_the_command_line_says_what_is_missing(tmp_path):
    result = subprocess.run([sys.executable, "-m", "vime.devtools.make_tiny_model", "--arch", "qwen3",
                             "--tokenizer", str(tmp_path), "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "no tokenizer_config.json" in result.stderr


def test_a_real_shape_keeps_its_width_at_a_reduced_depth(tokenizer, tmp_path):
    """``--shape qwen3-30b-a3b --layers 4`` is Qwen3-30B-A3B's published config but for its depth (the weights
    are not built here: even one layer of it is a gigabyte), and the family must match the shape's."""
    config = full_config("qwen3-30b-a3b", 4)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
            config.norm_topk_prob, config.tie_word_embeddings, config.vocab_size) == \
        ("qwen3_moe", 4, 2048, 32, 4, 768, 128, 8, True, False, 151936)
    assert full_config("qwen3-4b").num_hidden_layers == 36
    result = subprocess.run([sys.executable, "-m", "vime.devtools.make_tiny_model", "--arch", "qwen3", "--shape",
                             "qwen3-30b-a3b", "--tokenizer", str(tokenizer), "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "is a qwen3_moe model: pass --arch qwen3_moe" in result.stderr
