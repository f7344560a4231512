"""Engines behind the rollout and trainer actors.

``base`` holds the two interfaces; each implementation is one file or package:
``torch_rollout`` and ``torch_train`` (plain PyTorch on a Hugging Face model,
CPU or GPU), ``vllm_rollout`` (vLLM), and ``megatron`` (a megatron-core trainer,
a package of its own) with ``tensor_parallel`` leading its ranks in the pipeline.
:func:`train_engine` and :func:`rollout_engine` build the engine the run asks for.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from vime.trainer_ranks import Follower, RankPlan, RankSlot, start_here

if TYPE_CHECKING:
    from vime.backends.base import RolloutEngine, TrainEngine
    from vime.config import RunConfig

# megatron-core warns as each of six modules is imported that Transformer Engine and Apex are missing and it falls
# back to torch's norms, optimizers and multi-tensor kernels. vime's Megatron trainer needs neither: its layers
# are its own (``megatron.modules``) and its optimizer torch's AdamW; the trainer says so in one line instead
# (``MegatronTrainEngine``). Set here, in the package every import of megatron-core in vime goes through first.
warnings.filterwarnings("ignore", message="(Transformer Engine and Apex are|Apex is) not installed",
                        category=UserWarning)


def train_engine(run: RunConfig, seed: int, plan: RankPlan | None = None,
                 launch: Callable[[RankSlot, str], Follower] = start_here) -> TrainEngine:
    """The trainer engine of ``--train-backend``; megatron-core is imported only when asked for. With
    several ranks (tensor x data parallel) this process is rank 0 and starts the others where ``plan`` puts
    them (default: all here), each with ``launch`` (``vime.trainer_ranks``)."""
    arguments = run.train_engine_arguments(seed)
    if run.job.train_backend != "megatron":
        from vime.backends.torch_train import TorchTrainEngine

        return TorchTrainEngine(**arguments)
    if run.job.trainer_ranks > 1:
        from vime.backends.tensor_parallel import LeadingEngine

        return LeadingEngine(run, seed, plan, launch)
    from vime.backends.megatron import MegatronTrainEngine

    return MegatronTrainEngine(**arguments)


def rollout_engine(run: RunConfig, seed: int) -> RolloutEngine:
    """The rollout engine of ``--rollout-backend``; vLLM is imported only when asked for."""
    model, rollout = run.model, run.rollout
    shared = dict(dtype=model.dtype, max_batch_size=rollout.rollout_max_batch_size, seed=seed,
                  record_experts=rollout.use_rollout_routing_replay)
    if rollout.rollout_backend == "vllm":
        from vime.backends.vllm_rollout import VllmRolloutEngine

        return VllmRolloutEngine(model.model_path, gpus=rollout.rollout_num_gpus_per_engine,
                                 engine_args=rollout.vllm_args, **shared)
    from vime.backends.torch_rollout import TorchRolloutEngine

    return TorchRolloutEngine(model.model_path, **shared)
