"""``python -m vime.launch slurm|k8s [OPTIONS] -- SCENARIO [FLAGS]``: start a run over several hosts.

The launcher only writes what the cluster's own tools start; it runs nothing itself but ``sbatch``:

* ``slurm`` writes an sbatch script (``vime.launch.slurm``) and submits it (``--print``: shows it instead).
  The first node of the allocation runs the driver (``python -m vime.scenario``); every other node runs a
  node agent (``python -m vime.node``) through ``srun``, joined to the driver once it listens. The job's exit
  status is the driver's.
* ``k8s`` prints Kubernetes objects (``vime.launch.k8s``) for ``kubectl apply -f``: a Secret with the join
  token, a Service for the head, the head as a Job and the node agents as an Indexed Job.

What both do the same way (this module): the driver listens over tcp on a known port, with a join token
that the job alone knows (made when the job starts on Slurm, at launch for Kubernetes, never a fixed one),
passed in the environment as ``VIME_TOKEN`` and never on a command line; with more than one node, the
trainer takes the first ``--actor-num-nodes`` (1 unless given: the head) and the driver waits for
``--rollout-nodes`` (the nodes left) agents and puts the rollout workers on them.

Left out: TLS (``--transport tls+tcp``) between the hosts.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from vime.scenario import DEFAULT, SCENARIOS

# flags the launcher sets itself, with what to pass it instead
OWN_FLAGS = {
    "--out": "the launcher's --run-dir",
    "--host": "nothing: the launcher finds the head's address",
    "--port": "the launcher's --port",
    "--transport": "nothing: the launcher uses tcp (TLS between hosts is not supported by vime.launch yet)",
    "--save": "the launcher's --run-dir (slime's --save/--load name vime's run folder; --resume RUN_DIR continues "
              "a run)",
    "--load": "--resume RUN_DIR among the scenario's flags to continue a run in its folder",
}


@dataclasses.dataclass(frozen=True)
class Scenario:
    """What the driver runs: a scenario's name, its flags as the user gave them, and the run folder a
    ``--resume RUN_DIR`` among them names (which is then the run folder)."""

    name: str
    flags: tuple[str, ...]
    resumed: str | None = None

    @classmethod
    def parse(cls, words: list[str]) -> Scenario:
        """``SCENARIO [FLAGS]`` as given after ``--``; ValueError for an unknown scenario (found here, not on the
        cluster after the job waited in the queue) and for a flag the launcher sets itself."""
        name = words[0] if words and not words[0].startswith("-") else DEFAULT
        if name not in SCENARIOS:
            raise ValueError(f"unknown scenario {name!r}; python -m vime.scenario --list shows them")
        flags = tuple(words[1:] if words and words[0] == name else words)
        resumed = None
        for index, word in enumerate(flags):
            flag = word.split("=", 1)[0]
            if flag in OWN_FLAGS:
                raise ValueError(f"{flag} is set by vime.launch; pass {OWN_FLAGS[flag]}")
            if flag == "--resume":
                resumed = word.split("=", 1)[1] if "=" in word else (flags[index + 1] if index + 1 < len(flags)
                                                                      else None)
        return cls(name, flags, resumed)

    def sets(self, flag: str) -> bool:
        """Whether the user's flags give ``flag`` (``--flag VALUE`` or ``--flag=VALUE``)."""
        return self.value(flag) is not None

    def value(self, flag: str) -> str | None:
        """The value the user's flags give ``flag`` (the last one given), or None."""
        found = None
        for index, word in enumerate(self.flags):
            if word.startswith(f"{flag}="):
                found = word.split("=", 1)[1]
            elif word == flag:
                found = self.flags[index + 1] if index + 1 < len(self.flags) else ""
        return found


def driver_args(scenario: Scenario, nodes: int) -> list[str]:
    """The driver's arguments to Python, less what only the cluster knows (the head's address, the port, the run
    folder): the user's flags, and ``--rollout-nodes`` for the agents on the nodes the trainer does not take
    (``--actor-num-nodes``, the head among them) unless the user gave it. ValueError for a trainer over more
    nodes than the job has."""
    command = ["-m", "vime.scenario", scenario.name, *scenario.flags, "--transport", "tcp"]
    given = scenario.value("--actor-num-nodes")
    trainer_nodes = int(given) if given and given.isdigit() else 1
    if trainer_nodes > nodes:
        raise ValueError(f"--actor-num-nodes {trainer_nodes} puts the trainer on more nodes than the job's "
                         f"--nodes {nodes}: pass --nodes {trainer_nodes} or more")
    if nodes > trainer_nodes and not scenario.sets("--rollout-nodes"):
        command += ["--rollout-nodes", str(nodes - trainer_nodes)]
    return command


def check_counts(nodes: int, gpus_per_node: int) -> None:
    """ValueError for counts no cluster can hold, saying what to pass."""
    if nodes < 1:
        raise ValueError(f"--nodes {nodes}: pass 1 or more (the first node runs the driver)")
    if gpus_per_node < 0:
        raise ValueError(f"--gpus-per-node {gpus_per_node}: pass 0 (CPU nodes) or more")


def this_python() -> str:
    """The Python vime is installed in here: on a cluster with shared storage, the same path on every node."""
    return str(Path(sys.executable).absolute())
