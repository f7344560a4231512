"""RL algorithms as plain tensor functions: advantages, losses, filters.

One module each -- ``grpo``, ``ppo``, ``dynamic_sampling`` -- over the pieces
they share in ``policy_loss``. Nothing here knows about actors, messages or
models; every function is unit-tested against hand-computed values.

Tensors are ``[samples, response_tokens]``, right-padded, with a 0/1
``mask`` marking real response tokens.
"""
