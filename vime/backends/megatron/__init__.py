"""The policy as a megatron-core GPTModel, built from a Hugging Face config, and the trainer on it.

Which file holds what:

- ``parallel``: torch.distributed and megatron-core's process groups (:func:`init_parallel`), and the
  collectives the others share.
- ``modules``: the layers vime gives megatron-core's layer spec: a core attention on
  ``torch.nn.functional.scaled_dot_product_attention`` (:class:`SDPAttention`, the one attention path on
  CPU and GPU; no Transformer Engine), torch's RMSNorm under sequence parallelism, an MoE layer's
  routed experts as two stacked weights in grouped matmuls (:class:`GroupedExperts`), and PPO's value
  head in place of the output layer (:class:`ValueHead`).
- ``conversion``: the mapping from a Hugging Face config of the three families vime trains (``qwen3``,
  ``qwen3_moe``, ``glm4_moe``) to a megatron-core ``TransformerConfig``, and of Hugging Face safetensors
  weights to Megatron's layout and back (bit-exact both ways).
- ``model``: the GPTModel of that config (:func:`build_model`; a value model with ``value_head``) and its
  :func:`forward`.
- ``routing``: R3 -- recording the experts each token is routed to, and replaying given experts, through
  megatron-core's ``RouterReplay``, with the gate weights still differentiable.
- ``weights``: the weights in and out of the model, sharded and gathered, and Hugging Face folders.
- ``logprobs``: per-token log-probs under the sampling temperature, computed exactly as the rollout
  reports them (``vime.backends.hf.scaled_logprobs``), also from a rank's share of the vocabulary.
- ``resharding``: a checkpoint's trainer state, saved by ranks of one layout, read back by the ranks of
  another (each rank's shard recorded with where it lies in the whole tensor).
- ``engine``: :class:`MegatronTrainEngine`, the reference trainer's step on this model (and, for PPO, on
  a value model of the policy's architecture beside it, on the same ranks).

The public names are re-exported here; import them from ``vime.backends.megatron``.

On the GPU the model lives on the current CUDA device and batches are moved
there. ``dtype="bf16"`` makes its parameters bf16 (SDPA then dispatches to
its flash kernel) with fp32 masters for the optimizer
(``vime.backends.master_weights``). Speed figures are measured by
``bench/train.py``.

Tensor parallelism: under ``torchrun`` each rank holds its shard of every
split tensor, cut from the whole checkpoint on load and gathered back for
weight sync and ``save_hf`` (``weights._shard``/``weights._unshard``; the
conversions themselves work on whole tensors). It always comes with sequence
parallelism, which megatron-core requires of MoE layers under tensor
parallelism: each rank norms, routes and holds activations for its slice of
the sequence, so a batch is right-padded to a multiple of the ranks. Data
parallelism runs copies of that group, each training its share of a
batch's samples, gradients summed over the copies. An MoE model's experts
are split like its dense MLPs (expert tensor parallelism equal to the
tensor-parallel size) or, with expert parallelism over a copy's ranks or
all copies' ranks, divided among them whole; each split tensor is cut and
gathered over the group that divides it. Activation recomputation
(``recompute``) checkpoints every layer; a replay of the rollout's experts
is then queued until the backward pass has run the layers again (in
pipeline stages too, where 1F1B runs later forwards first). Pipeline
parallelism (``pipeline_parallel``) gives each stage a contiguous slice of
the layers and runs the micro-batches through megatron-core's 1F1B
schedule, the loss on the last stage; the weights are gathered from every
stage for conversion and publication, and an MoE model's stages replay
their own layers' experts (a tied model's last stage a copy of the
embedding, kept equal; PPO's value model in the same stages, its head on the
last, run through the schedule apart from the policy). Samples are packed into rows
with ``--use-dynamic-batch-size`` (``vime.backends.packing``). What is deliberately
not here yet: a value model on GPUs of its own.

On CPU (tests only) ``vime.backends.cpu_compat`` patches the CUDA calls
megatron-core cannot do without; MoE layers use the ``alltoall`` token
dispatcher there too, over gloo.
"""

from vime.backends.megatron.conversion import FAMILIES, hf_to_megatron, transformer_config
from vime.backends.megatron.engine import MegatronTrainEngine
from vime.backends.megatron.logprobs import token_logprobs, vocab_parallel_token_stats
from vime.backends.megatron.model import ForwardOutput, build_model, forward
from vime.backends.megatron.modules import GroupedExperts, SDPAttention, SequenceParallelRMSNorm, ValueHead
from vime.backends.megatron.parallel import init_parallel
from vime.backends.megatron.routing import end_replay
from vime.backends.megatron.weights import (
                                            CheckpointFiles,
                                            hf_tensors,
                                            hf_weights,
                                            load_hf_weights,
                                            model_tensors,
                                            read_hf_folder,
                                            unsharded_weights,
                                            write_hf_folder,
)

__all__ = [
    "FAMILIES", "CheckpointFiles", "ForwardOutput", "GroupedExperts", "MegatronTrainEngine", "SDPAttention",
    "SequenceParallelRMSNorm", "build_model", "end_replay", "forward", "hf_tensors", "hf_to_megatron", "hf_weights",
    "init_parallel", "load_hf_weights", "model_tensors", "read_hf_folder", "token_logprobs", "transformer_config",
    "unsharded_weights", "ValueHead", "vocab_parallel_token_stats", "write_hf_folder",
]
