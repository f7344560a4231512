"""RL algorithms as plain tensor functions: advantages, losses, filters.

One module per family -- advantages in ``grpo``, ``rloo``, ``reinforce`` and
``ppo`` (``estimators`` picks one for ``--advantage-estimator``), the loss in
``policy_loss``, with ``kl`` and the off-policy ``corrections``, and
``dynamic_sampling``. Nothing here knows about actors, messages or
models; every function is unit-tested against hand-computed values.

Tensors are ``[samples, response_tokens]``, right-padded, with a 0/1
``mask`` marking real response tokens.
"""
