"""``python -m vime.actor ROLE --join ADDRESS``: run one actor in this process.

The driver starts its actors this way; on another host a user starts an
extra one by hand, e.g. a rollout worker for a running job::

    VIME_TOKEN=TOKEN vime-actor rollout --join tcp://HEAD:PORT

The actor listens, registers with the driver at ADDRESS (which checks the
token), then serves until the job ends, it is told to stop, or it gets
SIGINT/SIGTERM. A refused join exits with status 2 and says why; so does
one that could never succeed (TLS on one side only, a CA that does not
match), found by one trial connection before the actor starts, and one
that cannot get the job's model (``--model-path`` not the head's model, a
fetch from the driver that failed: ``vime.model_files``).

An actor spawned by a driver (``--exit-with-parent PID``) must not outlive
it, even when the driver is killed with ``kill -9``. The runtime notices and
stops gracefully; should that not happen (the actor's event loop busy in a
long computation, or stuck), a watchdog thread ends the process
``DRIVER_GONE_GRACE_S`` later. Either way the actor then removes what the
dead driver left on this host (its shared memory and its folder of ipc
sockets), since no one else would. Not PR_SET_PDEATHSIG: Linux sends it when
the *thread* that forked the child exits, and trio forks from worker
threads that exit after 10 s idle -- it would kill healthy actors.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

import trio

from vime.logs import configure
from vime.model_files import ModelUnavailable
from vime.roles import ROLES, resolve_role
from vime.runtime import ActorSettings, DriverSilent, RemoteError
from vime.settings import add_setting_flags, given_settings, setting
from vime.transports.shm import pid_alive, remove_left_by
from vime.transports.sockets import Handshake, probe_handshake, rsa_key_problem

DRIVER_GONE_GRACE_S = 15.0


@dataclasses.dataclass(frozen=True)
class ActorLaunch:
    """The flags of ``python -m vime.actor`` beside :class:`ActorSettings`' own."""

    config: str = setting("{}", "role settings as a JSON object")
    settings: str = setting("{}", "ActorSettings fields as a JSON object, e.g. {\"inbox_capacity\": 64}; a flag "
                                  "of the same field wins")
    log_level: str = setting("info", "debug, info, warning or error")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vime.actor", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", help=f"built-in role ({', '.join(sorted(ROLES))}) or package.module:Class")
    add_setting_flags(parser, ActorSettings)
    add_setting_flags(parser, ActorLaunch)
    return parser


def launch_command(role: str, name: str, driver: str, listen: str, *, parent_pid: int, run_dir: str,
                   config: dict[str, Any] | str, settings: dict[str, Any] | str, seed: int, record: bool,
                   tls: dict[str, str], node: str | None = None) -> list[str]:
    """The command that starts ``role`` as actor ``name`` joined to ``driver``, stopping when process
    ``parent_pid`` (the driver, or the node agent ``node`` that started it) is gone: the one way a driver or a
    node starts an actor."""
    as_json = [text if isinstance(text, str) else json.dumps(text) for text in (config, settings)]
    command = [sys.executable, "-m", "vime.actor", role, "--name", name, "--join", driver,
               "--exit-with-parent", str(parent_pid), "--run-dir", run_dir, "--config", as_json[0],
               "--settings", as_json[1], "--seed", str(seed), "--listen", listen]
    if record:
        command.append("--record")
    if node is not None:
        command += ["--node", node]
    for flag, key in (("--tls-cert-key", "cert_key"), ("--tls-ca", "ca")):
        if key in tls:
            command += [flag, tls[key]]
    return command


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


def _settings(args: argparse.Namespace, launch: ActorLaunch, role: str) -> ActorSettings:
    """The runtime settings: --settings, then the flags given, then the defaults that need the role or the host."""
    values = {**_json_settings(launch.settings), **given_settings(args, ActorSettings)}
    values.setdefault("name", f"{role}-{uuid.uuid4().hex[:6]}")
    if "listen" not in values:
        values["listen"] = default_listen(values["driver"])
    values["token"] = values.get("token") or os.environ.get("VIME_TOKEN") or None
    if values.get("parent_pid") == 0:  # --exit-with-parent without PID
        values["parent_pid"] = os.getppid()
    return ActorSettings(**values)


def _json_settings(text: str) -> dict[str, Any]:
    """The ActorSettings fields given as --settings JSON; SystemExit naming an unknown one."""
    values = json.loads(text)
    known = {f.name for f in dataclasses.fields(ActorSettings)}
    unknown = set(values) - known
    if unknown:
        raise SystemExit(f"--settings: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    return values


def join_problem(settings: ActorSettings) -> str | None:
    """Why joining the driver with these settings cannot work, saying what to pass instead; None when it can
    (or the driver is not reachable yet: the join then waits for it as usual)."""
    url = urlsplit(settings.driver)
    if url.scheme not in ("tcp", "tls+tcp"):
        return None
    plain = f"tcp://{url.netloc}"
    if url.scheme == "tls+tcp" and settings.tls is None:
        return ("it is a TLS address; pass --tls-cert-key (a PEM with this host's certificate and key, signed by the "
                "job's CA) and --tls-ca (the job's CA: the file its driver was given as --tls-ca)")
    found, detail = probe_handshake(settings.driver, settings.tls)
    if found is Handshake.PEER_WANTS_TLS:
        return (f"it closed the connection at once, so the job uses TLS; join with --join tls+{plain} and pass "
                "--tls-cert-key and --tls-ca (RUN_DIR/join on the driver's host holds the command)")
    if found is Handshake.PEER_NOT_TLS:
        return f"it does not speak TLS ({detail}); join with --join {plain}, without --tls-cert-key and --tls-ca"
    if found is Handshake.PEER_UNTRUSTED and "mismatch" in detail:
        return (f"the driver's certificate does not name {url.hostname} ({detail}); join by a name the certificate "
                f"carries, or give the driver a certificate for {url.hostname}")
    if found is Handshake.PEER_UNTRUSTED:
        return (f"the driver's certificate is not signed by the CA in --tls-ca {settings.tls_ca} ({detail}); pass "
                "the job's CA: the file its driver was given as --tls-ca")
    if found is Handshake.WE_ARE_REFUSED:
        return (f"the driver did not accept this actor's certificate (--tls-cert-key {settings.tls_cert_key}); pass "
                "a certificate signed by the job's CA")
    return None


def _watch_parent_hard(parent_pid: int) -> None:
    """Thread body: once the parent is gone, give the graceful stop ``DRIVER_GONE_GRACE_S``, then clean up
    and end the process whatever its event loop is doing. A thread, not the loop's own watch
    (``Actor._watch_parent``, the graceful stop): it must act while the loop is blocked, and during the role's
    imports, before there is a loop."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    time.sleep(DRIVER_GONE_GRACE_S)
    print(f"vime.actor: the driver (pid {parent_pid}) is gone and this actor did not stop within "
          f"{DRIVER_GONE_GRACE_S:.0f} s; ending it", file=sys.stderr, flush=True)
    remove_left_by(os.getpid())
    _remove_left_by_driver(parent_pid)
    os._exit(1)


def _remove_left_by_driver(parent_pid: int) -> None:
    """Remove a dead driver's shared memory and its folder of ipc sockets (both named for its pid, in the
    same folder), which ``kill -9`` kept it from removing; every actor it spawned tries, so the last one out
    leaves nothing."""
    if not pid_alive(parent_pid):
        remove_left_by(parent_pid)


def _first(group: BaseExceptionGroup) -> BaseException:
    """The first error of ``group``, out of any groups nested in it (trio nests a nursery's errors): the one the
    user is told about."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def main(argv: list[str] | None = None) -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 PID: every thread's stack, to the log
    parser = _parser()
    args = parser.parse_args(argv)
    launch = ActorLaunch(**given_settings(args, ActorLaunch))
    if args.driver is None:
        parser.error("--join ADDRESS is required: the address of the job's driver")
    parent_pid = os.getppid() if args.parent_pid == 0 else args.parent_pid
    if parent_pid is not None:  # before the imports of the role, which take seconds
        threading.Thread(target=_watch_parent_hard, args=(parent_pid,), daemon=True,
                         name="driver-watchdog").start()
    configure(launch.log_level)
    tls_problem = args.tls_cert_key and rsa_key_problem(args.tls_cert_key)  # before the role's slow imports
    if tls_problem:
        print(f"vime.actor: --tls-cert-key: {tls_problem}", file=sys.stderr)
        return 2
    cls = resolve_role(args.role, allow_import=True)
    settings = _settings(args, launch, cls.role)
    if parent_pid is None:  # joined by hand: the user's flags may not fit the job
        problem = join_problem(settings)
        if problem:
            print(f"vime.actor: cannot join the driver at {settings.driver}: {problem}", file=sys.stderr)
            return 2
    actor = cls(settings, json.loads(launch.config))
    try:
        trio.run(actor.serve)
    except BaseExceptionGroup as group:
        unavailable, _ = group.split(ModelUnavailable)
        if unavailable is not None:
            print(f"vime.actor: cannot get the job's model: {_first(unavailable)}", file=sys.stderr)
            return 2
        refused, _ = group.split(lambda error: isinstance(error, RemoteError) and error.peer == "driver")
        silent, _ = group.split(DriverSilent)
        if refused is not None:
            print(f"vime.actor: join refused by the driver at {settings.driver}: {_first(refused).reply.error}",
                  file=sys.stderr)
            return 2
        if silent is not None:
            print(f"vime.actor: the driver at {settings.driver} did not answer; is the job running and the address "
                  "right?", file=sys.stderr)
            return 2
        raise
    finally:
        if parent_pid is not None and os.getppid() != parent_pid:
            _remove_left_by_driver(parent_pid)
    return actor.exit_code


if __name__ == "__main__":
    sys.exit(main())
