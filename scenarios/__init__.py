"""Named scenarios: a model, a dataset, a reward and defaults each."""
