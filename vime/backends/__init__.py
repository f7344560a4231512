"""Engines behind the rollout and trainer actors.

``base`` holds the two interfaces; each implementation is one file:
``torch_rollout`` and ``torch_train`` (plain PyTorch on a Hugging Face model,
CPU or GPU), with vLLM and Megatron-core to follow.
"""
