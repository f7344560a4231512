"""One module per actor role (trainer, rollout, router, buffer, reward); filled by the pipeline issue."""
