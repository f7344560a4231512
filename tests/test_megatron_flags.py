"""Megatron's model flags (slime's MODEL_ARGS) checked against the checkpoint's config.json (issue 33, item 4).

The MODEL_ARGS arrays are slime's scripts/models/*.sh as they are; the configs are the published config.json
fields of the models they are for (Qwen/Qwen3-4B, Qwen/Qwen3-30B-A3B, zai-org/GLM-4.5-Air), typed in."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vime.config import RunConfig
from vime.megatron_flags import add_megatron_flags, check, given

transformers = pytest.importorskip("transformers")

QWEN3_4B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560,
    "initializer_range": 0.02, "intermediate_size": 9728, "max_position_embeddings": 40960, "max_window_layers": 36,
    "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
GLM45_AIR_CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 10944,
    "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1408,
    "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 128,
    "n_shared_experts": 1, "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
    "num_hidden_layers": 46, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_qk_norm": False, "vocab_size": 151552,
}

# slime's scripts/models/qwen3-4B.sh (${MODEL_ARGS_ROTARY_BASE:-1000000} as its default)
QWEN3_4B_MODEL_ARGS = [
    "--swiglu", "--num-layers", "36", "--hidden-size", "2560", "--ffn-hidden-size", "9728",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6", "--rotary-base", "1000000", "--vocab-size", "151936", "--kv-channels", "128",
    "--qk-layernorm",
]
# slime's scripts/models/qwen3-30B-A3B.sh; its --moe-layer-freq "'([1]*48)'" reaches the program with the quotes
QWEN3_30B_A3B_MODEL_ARGS = [
    "--disable-bias-linear", "--qk-layernorm", "--group-query-attention", "--num-attention-heads", "32",
    "--num-query-groups", "4", "--kv-channels", "128", "--num-layers", "48", "--hidden-size", "2048",
    "--ffn-hidden-size", "6144", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--norm-epsilon", "1e-6", "--rotary-percent", "1.0", "--swiglu", "--untie-embeddings-and-output-weights",
    "--vocab-size", "151936", "--rotary-base", "1000000",
    "--moe-ffn-hidden-size", "768", "--moe-router-score-function", "softmax", "--moe-token-dispatcher-type",
    "alltoall", "--moe-router-topk", "8", "--moe-layer-freq", "'([1]*48)'", "--num-experts", "128",
    "--moe-grouped-gemm", "--moe-token-drop-policy", "probs", "--moe-router-dtype", "fp32", "--moe-permute-fusion",
    "--moe-aux-loss-coeff", "0",
]
# slime's scripts/models/glm4.5-106B-A12B.sh (N_DENSE_LAYERS=1, N_MOE_LAYERS=45 expanded)
GLM45_AIR_MODEL_ARGS = [
    "--disable-bias-linear", "--group-query-attention", "--num-attention-heads", "96", "--num-query-groups", "8",
    "--kv-channels", "128", "--num-layers", "46", "--hidden-size", "4096", "--ffn-hidden-size", "10944",
    "--add-qkv-bias", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--rotary-percent", "0.5",
    "--swiglu", "--untie-embeddings-and-output-weights", "--vocab-size", "151552", "--rotary-base", "1000000",
    "--moe-ffn-hidden-size", "1408", "--moe-shared-expert-intermediate-size", "1408", "--moe-router-pre-softmax",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-token-dispatcher-type", "alltoall",
    "--moe-router-topk", "8", "--moe-layer-freq", "[0]*1+[1]*45", "--num-experts", "128", "--moe-grouped-gemm",
    "--moe-router-dtype", "fp32", "--moe-permute-fusion", "--moe-aux-loss-coeff", "0",
]
# slime's run scripts' MISC_ARGS, Megatron's flags too
MISC_ARGS = ["--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
             "--attention-softmax-in-fp32", "--attention-backend", "flash"]


def checked(flags: list[str], config: dict, run: RunConfig | None = None) -> None:
    """Check ``flags`` against ``config`` as the run's preflight does; ValueError on a disagreement."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_flags(parser)
    hf_config = transformers.AutoConfig.for_model(**config)
    check(given(parser.parse_args(flags)), hf_config, run or RunConfig(), "M/config.json")


@pytest.mark.parametrize("flags, config", [(QWEN3_4B_MODEL_ARGS, QWEN3_4B_CONFIG),
                                           (QWEN3_30B_A3B_MODEL_ARGS, QWEN3_30B_A3B_CONFIG),
                                           (GLM45_AIR_MODEL_ARGS, GLM45_AIR_CONFIG)],
                         ids=["qwen3-4B", "qwen3-30B-A3B", "glm4.5-106B-A12B"])
def test_slimes_model_args_agree_with_their_checkpoints(flags, config):
    checked([*flags, *MISC_ARGS], config)


def test_model_args_of_another_model_are_refused_naming_every_field():
    """The 30B's MODEL_ARGS against the 4B's checkpoint: one message, each flag with the field and its value."""
    with pytest.raises(ValueError) as refused:
        checked(QWEN3_30B_A3B_MODEL_ARGS, QWEN3_4B_CONFIG)
    said = str(refused.value)
    assert said.startswith("these Megatron model flags disagree with M/config.json: ")
    for expected in ("--num-query-groups 4: config.json's num_key_value_heads is 8",
                     "--num-layers 48: config.json's num_hidden_layers is 36",
                     "--hidden-size 2048: config.json's hidden_size is 2560",
                     "--ffn-hidden-size 6144: config.json's intermediate_size is 9728",
                     "--untie-embeddings-and-output-weights: config.json's tie_word_embeddings is True",
                     "--moe-ffn-hidden-size 768: config.json's moe_intermediate_size is absent",
                     "--num-experts 128: config.json's num_experts is absent",
                     "--moe-layer-freq '([1]*48)': config.json's number of MoE layers is 0 of 36"):
        assert expected in said, said
    for agreeing in ("--kv-channels", "--norm-epsilon", "--vocab-size", "--rotary-base", "--moe-grouped-gemm"):
        assert agreeing not in said


def test_a_padded_vocabulary_is_accepted_a_smaller_one_refused():
    """Megatron pads --vocab-size up anyway; fewer rows than the checkpoint's would leave tokens out."""
    checked(["--vocab-size", "152064"], QWEN3_4B_CONFIG)
    with pytest.raises(ValueError, match=r"--vocab-size 151552: config.json's vocab_size is 151936"):
        checked(["--vocab-size", "151552"], QWEN3_4B_CONFIG)


def test_switches_and_floats_are_checked_against_the_fields():
    with pytest.raises(ValueError, match=r"--add-qkv-bias: config.json's attention_bias is False"):
        checked(["--add-qkv-bias"], QWEN3_4B_CONFIG)
    with pytest.raises(ValueError, match=r"--qk-layernorm: config.json's use_qk_norm is False"):
        checked(["--qk-layernorm"], GLM45_AIR_CONFIG)
    with pytest.raises(ValueError, match=r"--rotary-percent 1.0: config.json's partial_rotary_factor is 0.5"):
        checked(["--rotary-percent", "1.0"], GLM45_AIR_CONFIG)
    with pytest.raises(ValueError, match=r"--norm-epsilon 1e-05: config.json's rms_norm_eps is 1e-06"):
        checked(["--norm-epsilon", "1e-5"], QWEN3_4B_CONFIG)
    with pytest.raises(ValueError, match=r"--moe-router-score-function sigmoid: config.json's model_type is "
                                         r"qwen3_moe"):
        checked(["--moe-router-score-function", "sigmoid"], QWEN3_30B_A3B_CONFIG)
    with pytest.raises(ValueError, match=r"--moe-router-pre-softmax: config.json's norm_topk_prob is True"):
        checked(["--moe-router-pre-softmax"], QWEN3_30B_A3B_CONFIG)


def test_qk_layernorm_is_read_per_family():
    """Qwen3 has it without a config field; a Qwen2 or Llama checkpoint has no such field and no QK norm, so the
    flag on one is refused; GLM-4.5 says it in use_qk_norm."""
    checked(["--qk-layernorm"], QWEN3_4B_CONFIG)
    for config in ({"model_type": "qwen2"}, {"model_type": "llama"}):
        with pytest.raises(ValueError, match=r"--qk-layernorm: config.json's use_qk_norm is absent"):
            checked(["--qk-layernorm"], config)
    with pytest.raises(ValueError, match=r"--qk-layernorm: config.json's use_qk_norm is False"):
        checked(["--qk-layernorm"], {**GLM45_AIR_CONFIG, "use_qk_norm": False})
    checked(["--qk-layernorm"], {**GLM45_AIR_CONFIG, "use_qk_norm": True})


def test_switches_left_out_of_model_args_are_checked_as_off():
    """MODEL_ARGS without --untie-embeddings-and-output-weights describe a tied model: refused on the 30B's untied
    checkpoint (and without --swiglu, a GELU one); without --num-layers, --hidden-size or --num-attention-heads (no
    whole model described) the flags given are checked alone."""
    untied = [flag for flag in QWEN3_30B_A3B_MODEL_ARGS if flag != "--untie-embeddings-and-output-weights"]
    with pytest.raises(ValueError, match=r"no --untie-embeddings-and-output-weights: config.json's "
                                         r"tie_word_embeddings is False"):
        checked(untied, QWEN3_30B_A3B_CONFIG)
    with pytest.raises(ValueError, match=r"no --swiglu: config.json's hidden_act is silu"):
        checked([flag for flag in QWEN3_4B_MODEL_ARGS if flag != "--swiglu"], QWEN3_4B_CONFIG)
    checked(["--vocab-size", "151936", "--moe-grouped-gemm"], QWEN3_30B_A3B_CONFIG)  # no flag Megatron requires
    with pytest.raises(ValueError, match=r"no --group-query-attention: .*no --swiglu: .*no --qk-layernorm: "):
        checked(["--num-layers", "36"], QWEN3_4B_CONFIG)


def test_what_vime_does_otherwise_is_refused_by_name():
    """Performance flags are accepted (the 30B's --moe-grouped-gemm above); a value that changes the loss or the
    routing, or asks for DeepEP, is refused with vime's value, in a message of its own kind."""
    with pytest.raises(ValueError) as refused:
        checked(["--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "flex", "--hidden-dropout", "0.1",
                 "--moe-router-load-balancing-type", "sinkhorn"], QWEN3_30B_A3B_CONFIG)
    said = str(refused.value)
    assert said.startswith("these Megatron flags ask for what vime does not do: ")
    for expected in ("--moe-aux-loss-coeff 0.01 (vime adds no load-balancing loss", "vime runs 0.0",
                     "--moe-token-dispatcher-type flex (both move the same tokens", "DeepEP's",
                     "vime runs one of allgather, alltoall", "--hidden-dropout 0.1 (vime trains without dropout",
                     "--moe-router-load-balancing-type sinkhorn (sinkhorn routes otherwise"):
        assert expected in said, said


def test_moe_layer_freq_is_read_as_megatron_reads_it():
    checked(["--moe-layer-freq", "1"], QWEN3_30B_A3B_CONFIG)
    checked(["--moe-layer-freq", "([1]*48)"], QWEN3_30B_A3B_CONFIG)
    with pytest.raises(ValueError, match=r"--moe-layer-freq \[1\]\*46: config.json's number of MoE layers is 45 "
                                         r"of 46, from layer 1"):
        checked(["--moe-layer-freq", "[1]*46"], GLM45_AIR_CONFIG)
    with pytest.raises(ValueError, match=r"nor a pattern of \[0\]/\[1\] lists"):
        checked(["--moe-layer-freq", "[__import__('os').getpid()]"], QWEN3_30B_A3B_CONFIG)


@pytest.mark.parametrize("value", ["0", "-2", "two", "[2]*48", "[[1]]*48", "[1]*48+1", "[1]*[1]", "[" * 100_000,
                                   "(" * 100_000 + "[1]" + ")" * 100_000, "[1]+" * 100_000 + "[1]"])
def test_a_malformed_moe_layer_freq_is_refused_naming_it(value):
    """0 (a division by zero), what is not a 0/1 pattern, and nesting past Python's recursion limit (in the parser
    or the evaluation): each the same ValueError naming the flag (the preflight's exit 2), never another exception."""
    with pytest.raises(ValueError, match=r"--moe-layer-freq .*: not an int >= 1 \(every N-th layer an MoE\) nor a "
                                         r"pattern of \[0\]/\[1\] lists"):
        checked(["--moe-layer-freq", value], QWEN3_30B_A3B_CONFIG)


@pytest.mark.parametrize("value", ["[1]*100000000000", "100000000000*[1]", "[1]*49", "([1]*48)*48"])
def test_a_moe_layer_freq_longer_than_the_model_disagrees_unbuilt(value):
    """A * operand beyond the 48 layers is a pattern longer than the model: refused as a disagreement, at once
    (a list of 10^11 entries would take the preflight's memory and time)."""
    with pytest.raises(ValueError, match=r"--moe-layer-freq .*: config.json's number of MoE layers is 48 of 48"):
        checked(["--moe-layer-freq", value], QWEN3_30B_A3B_CONFIG)


def test_expert_tensor_parallel_size_follows_vimes_layout():
    """slime's 30B layout (TP 4, EP 8) shares each expert among 1 rank, as vime does; a dense model has none."""
    layout = RunConfig().replace(train_backend="megatron", tensor_model_parallel_size=4, data_parallel_size=2,
                                 expert_model_parallel_size=8)
    checked(["--expert-tensor-parallel-size", "1"], QWEN3_30B_A3B_CONFIG, layout)
    checked(["--expert-tensor-parallel-size", "1"], QWEN3_4B_CONFIG, layout)
    with pytest.raises(ValueError, match=r"--expert-tensor-parallel-size 4 \(the ranks sharing each expert .*vime "
                                         r"runs 1\)"):
        checked(["--expert-tensor-parallel-size", "4"], QWEN3_30B_A3B_CONFIG, layout)


def test_the_command_line_refuses_a_wrong_checkpoint_before_the_run_folder(tmp_path):
    """Through vime.scenario: checked in the preflight of --dry-run and of a run alike, exit 2, no run folder."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_4B_CONFIG))
    (model / "tokenizer_config.json").write_text("{}")
    (model / "model.safetensors").write_text("")  # what the run's folder check looks for; never read
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "1+1", "label": "2"}) + "\n")
    for dry_run in (["--dry-run"], []):
        result = subprocess.run([sys.executable, "-m", "vime.scenario", "arithmetic", *dry_run, "--model-path",
                                 str(model), "--data", str(data), "--num-layers", "48", "--swiglu",
                                 "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stderr
        assert "--num-layers 48: config.json's num_hidden_layers is 36" in result.stderr, result.stderr
        assert "--swiglu" not in result.stderr
        assert not (tmp_path / "run").exists()
    assert Path(model / "config.json").is_file()


def test_the_check_imports_no_torch():
    """The flags are checked before any engine loads: the layer pattern, head width and experts' layout come from
    vime.architecture (torch-free), which vime.flops and the Megatron backend read too."""
    program = ("import sys, argparse, types\n"
               "from vime.megatron_flags import add_megatron_flags, check, given\n"
               "from vime.config import RunConfig\n"
               "from test_megatron_flags import QWEN3_30B_A3B_CONFIG, QWEN3_30B_A3B_MODEL_ARGS\n"
               "parser = argparse.ArgumentParser()\n"
               "add_megatron_flags(parser)\n"
               # transformers' config classes import torch themselves: the fields as a plain object
               "hf = types.SimpleNamespace(**QWEN3_30B_A3B_CONFIG, rope_parameters={'rope_theta': "
               "QWEN3_30B_A3B_CONFIG['rope_theta']})\n"
               "check(given(parser.parse_args([*QWEN3_30B_A3B_MODEL_ARGS, '--expert-tensor-parallel-size', '1'])), "
               "hf, RunConfig(), 'M')\n"
               "assert 'torch' not in sys.modules, 'torch imported'\n")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).parent)
    assert result.returncode == 0, result.stderr[-2000:]
