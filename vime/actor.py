"""``python -m vime.actor ROLE --join ADDRESS``: run one actor in this process.

The driver starts its actors this way; on another host a user starts an
extra one by hand, e.g. a rollout worker for a running job::

    python -m vime.actor rollout --join tcp://HEAD:PORT --token TOKEN

The actor listens, registers with the driver at ADDRESS (which checks the
token), then serves until the job ends, it is told to stop, or it gets
SIGINT/SIGTERM. A refused join exits with status 2 and says why.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import uuid
from urllib.parse import urlsplit

import trio

from vime.logs import configure
from vime.roles import ROLES, resolve_role
from vime.runtime import ActorSettings, RemoteError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vime.actor", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", help=f"built-in role ({', '.join(sorted(ROLES))}) or package.module:Class")
    parser.add_argument("--join", required=True, metavar="ADDRESS",
                        help="the driver's address (ipc://..., tcp://HOST:PORT, tls+tcp://HOST:PORT)")
    parser.add_argument("--token", default=None,
                        help="the job's join token (default: $VIME_TOKEN); required by tcp jobs")
    parser.add_argument("--name", default=None, help="actor name, unique in the job (default: ROLE-RANDOM)")
    parser.add_argument("--listen", default=None,
                        help="address to listen on (default: tcp on the interface that reaches the driver)")
    parser.add_argument("--run-dir", default=None, help="the job's run folder (message logs go under it)")
    parser.add_argument("--config", default="{}", help="role settings as a JSON object")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settings", default="{}",
                        help="runtime settings as a JSON object, e.g. {\"inbox_capacity\": 64} (see ActorSettings)")
    parser.add_argument("--record", action="store_true", help="write this actor's message log")
    parser.add_argument("--exit-with-parent", nargs="?", type=int, const=0, default=None, metavar="PID",
                        help="shut down when the driver that spawned us (process PID; default: our parent at start) "
                             "is gone; a driver that dies before we start is noticed too when PID is given")
    parser.add_argument("--tls-cert-key", default=None, help="PEM with our certificate and key (tls+tcp)")
    parser.add_argument("--tls-ca", default=None, help="PEM of the CA that signs the job's certificates")
    parser.add_argument("--log-level", default="info")
    return parser


def default_listen(join: str) -> str:
    """Listen on the interface this host uses to reach the driver, any free port."""
    url = urlsplit(join)
    if url.scheme == "ipc":
        raise SystemExit("--join with an ipc:// address needs --listen ipc://PATH (same host)")
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((url.hostname, url.port or 1))  # UDP connect sends nothing
        host = probe.getsockname()[0]
    finally:
        probe.close()
    return f"{url.scheme}://{host}:0"


def _runtime_settings(text: str) -> dict:
    """The tunable ActorSettings fields from --settings; identity fields come from their own flags."""
    values = json.loads(text)
    tunable = {f.name for f in dataclasses.fields(ActorSettings)} - _IDENTITY
    unknown = set(values) - tunable
    if unknown:
        raise SystemExit(f"--settings: unknown field(s) {sorted(unknown)}; tunable: {sorted(tunable)}")
    return values


_IDENTITY = {"name", "listen", "driver", "token", "run_dir", "record", "seed", "tls_cert_key", "tls_ca",
             "parent_pid"}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure(args.log_level)
    cls = resolve_role(args.role, allow_import=True)
    settings = ActorSettings(
        **_runtime_settings(args.settings),
        name=args.name or f"{cls.role}-{uuid.uuid4().hex[:6]}",
        listen=args.listen or default_listen(args.join),
        driver=args.join,
        token=args.token or os.environ.get("VIME_TOKEN") or None,
        run_dir=args.run_dir,
        record=args.record,
        seed=args.seed,
        tls_cert_key=args.tls_cert_key,
        tls_ca=args.tls_ca,
        parent_pid=None if args.exit_with_parent is None else args.exit_with_parent or os.getppid(),
    )
    actor = cls(settings, json.loads(args.config))
    try:
        trio.run(actor.serve)
    except BaseExceptionGroup as group:
        refused, _ = group.split(lambda error: isinstance(error, RemoteError) and error.peer == "driver")
        silent, _ = group.split(TimeoutError)
        if refused is not None:
            error = refused.exceptions[0]
            while isinstance(error, BaseExceptionGroup):
                error = error.exceptions[0]
            print(f"vime.actor: join refused by the driver at {args.join}: {error.reply.error}", file=sys.stderr)
            return 2
        if silent is not None:
            print(f"vime.actor: the driver at {args.join} did not answer; is the job running and the address "
                  "right?", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
