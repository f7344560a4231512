"""Engines behind the rollout and trainer actors.

``base`` holds the two interfaces; each implementation is one file or package:
``torch_rollout`` and ``torch_train`` (plain PyTorch on a Hugging Face model,
CPU or GPU), ``vllm_rollout`` (vLLM), and ``megatron`` (a megatron-core trainer,
a package of its own) with ``tensor_parallel`` leading its ranks in the pipeline.
"""
