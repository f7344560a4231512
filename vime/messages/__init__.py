"""vime's message vocabulary: every kind an actor sends, one module per subsystem.

* :mod:`vime.messages.runtime`: the runtime's own, for every actor (register, directory, heartbeat, status,
  errors, shared-memory release).
* :mod:`vime.messages.pipeline`: the RL pipeline's (prompts to groups to scored samples to batches, the buffer's
  staleness news, checkpoints of the buffer, evaluation, injected prompts).
* :mod:`vime.messages.gpu_turns`: GPU turn-taking between the trainer and rollout engines on its GPUs (build
  turns, sleep).
* :mod:`vime.messages.model_files`: a joined actor fetching the job's model folder from the driver (its
  manifest, then chunks of its files), for a host without the head's files.
* ``vime.weights``: weight sync. A worker's ask for its weights (WantWeights) in :mod:`vime.weights.base`, and
  each path's kinds in that path's module (``nng``, ``cuda_ipc``, ``nccl``), beside both halves of the path.

Each kind is a typed record (``@message``) declared once, its docstring saying who sends it to whom and when;
an ask has one reply kind, named in the ask's docstring (or an ErrorReply). Nothing is re-exported here: an
import names the subsystem a kind belongs to.
"""
