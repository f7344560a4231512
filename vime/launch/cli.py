"""The command line of ``python -m vime.launch`` (``vime-launch``): see :mod:`vime.launch`."""

from __future__ import annotations

import argparse
import re
import sys

from vime.launch import Scenario, this_python
from vime.logs import configure

USAGE = "%(prog)s [OPTIONS] -- [SCENARIO] [FLAGS]"


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, required=True, help="hosts in all: the first runs the driver, each "
                                                                   "other a node agent")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="GPUs to ask for on each node (default 0)")
    parser.add_argument("--job-name", default=None, help="the job's name (default: vime-SCENARIO)")
    parser.add_argument("--python", default=None, help="the Python vime is installed in, on every node")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vime.launch", allow_abbrev=False,
                                     description="Start a vime run over several hosts: an sbatch script (slurm) or "
                                                 "Kubernetes objects (k8s). What follows -- is the scenario and its "
                                                 "flags, as python -m vime.scenario takes them.")
    kinds = parser.add_subparsers(dest="kind", required=True)
    slurm = kinds.add_parser("slurm", usage=USAGE, allow_abbrev=False,
                             help="write an sbatch script and submit it (--print: show it)")
    _common(slurm)
    slurm.add_argument("--partition", help="sbatch --partition")
    slurm.add_argument("--time", help="sbatch --time, e.g. 4:00:00")
    slurm.add_argument("--account", help="sbatch --account")
    slurm.add_argument("--run-dir", help="the run folder, on storage every node sees (default: "
                                         "runs/SCENARIO-JOBID under the folder sbatch is run from)")
    slurm.add_argument("--port", type=int, default=None,
                       help="the driver's port on the head (default: 20000 + the job's id modulo 20000)")
    slurm.add_argument("--head-interface", default=None,
                       help="take the head's address from this interface (e.g. ib0) instead of its name's")
    slurm.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                       help="another #SBATCH line, e.g. --sbatch-arg=--mem=0 (repeat for several)")
    slurm.add_argument("--print", action="store_true", help="print the script instead of submitting it")
    k8s = kinds.add_parser("k8s", usage=USAGE, allow_abbrev=False,
                           help="print a Secret, a Service and Jobs for kubectl apply -f")
    _common(k8s)
    k8s.add_argument("--image", required=True, help="a container image with vime installed")
    k8s.add_argument("--namespace", default=None, help="the objects' namespace (default: kubectl's)")
    k8s.add_argument("--port", type=int, default=29500, help="the driver's port (default 29500)")
    k8s.add_argument("--pvc", default=None, help="a PersistentVolumeClaim for the run folders (default: an "
                                                 "emptyDir, lost with the head's pod)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse, write, submit or print; 2 with the reason for what cannot run, 1 when sbatch refuses."""
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = _parser().parse_args(argv[:split])
    configure("warning")
    try:
        scenario = Scenario.parse(argv[split + 1:])
        job_name = args.job_name or f"vime-{scenario.name}"
        if args.kind == "k8s":
            return _k8s(args, scenario, job_name)
        return _slurm(args, scenario, job_name)
    except ValueError as err:
        print(f"python -m vime.launch: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"python -m vime.launch: {err}", file=sys.stderr)
        return 1


def _slurm(args: argparse.Namespace, scenario: Scenario, job_name: str) -> int:
    from vime.launch import slurm

    job = slurm.SlurmJob(nodes=args.nodes, gpus_per_node=args.gpus_per_node, scenario=scenario,
                         python=args.python or this_python(), job_name=job_name, run_dir=args.run_dir,
                         partition=args.partition, time=args.time, account=args.account, port=args.port,
                         head_interface=args.head_interface, sbatch_args=tuple(args.sbatch_arg))
    text = slurm.script(job)
    if args.print:
        print(text, end="")
        return 0
    job_id = slurm.submit(text)
    print(f"submitted job {job_id}: {scenario.name} over {args.nodes} node(s); its output: slurm-{job_id}.out")
    return 0


def _k8s(args: argparse.Namespace, scenario: Scenario, job_name: str) -> int:
    from vime.launch import k8s

    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?", job_name.replace("_", "-")):
        raise ValueError(f"--job-name {job_name}: Kubernetes names are lower-case letters, digits and '-', "
                         "at most 42 here (its objects add a suffix)")
    job = k8s.KubernetesJob(nodes=args.nodes, gpus_per_node=args.gpus_per_node, scenario=scenario,
                            image=args.image, job_name=job_name.replace("_", "-"), python=args.python or "python",
                            namespace=args.namespace, port=args.port, pvc=args.pvc)
    print(k8s.render(job), end="")
    return 0
