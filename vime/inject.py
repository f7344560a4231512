"""``python -m vime.inject RUN_DIR PROMPTS.jsonl``: add prompts to a running job.

The buffer issues them before the next prompts of its source. Each line is a
JSON map with ``prompt`` and ``label`` (other keys reach the reward function
as metadata). The buffer's address comes from RUN_DIR/actors.json; a tcp job
needs its token (``--token`` or $VIME_TOKEN).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import trio

from vime.actor import default_listen
from vime.data import load_rows
from vime.logs import configure
from vime.messages.pipeline import Injected, InjectPrompts
from vime.runtime import Actor, ActorSettings


def buffer_address(run_dir: Path) -> str:
    """The live buffer's inbox address from RUN_DIR/actors.json."""
    path = run_dir / "actors.json"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist; pass the run folder of a running job")
    for row in json.loads(path.read_text())["actors"]:
        if row["role"] == "buffer":
            return row["address"]
    raise SystemExit(f"{path} lists no buffer; has the job started (or ended)?")


async def inject(address: str, rows: list[dict[str, Any]], token: str | None = None, timeout: float = 30.0) -> Injected:
    """Send the rows to the buffer at ``address`` from a short-lived actor of our own."""
    with tempfile.TemporaryDirectory(prefix="vime-inject-") as folder:
        listen = f"ipc://{folder}/inbox" if address.startswith("ipc://") else default_listen(address)
        client = Actor(ActorSettings(name=f"inject-{uuid.uuid4().hex[:6]}", listen=listen, token=token))
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: client.serve(handle_signals=False, task_status=task_status))
            client.directory["buffer"] = address
            try:
                return await client.ask("buffer", InjectPrompts(prompts=rows), timeout=timeout)
            finally:
                client.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vime.inject", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("run_dir", type=Path, help="the job's run folder")
    parser.add_argument("prompts", help="a JSONL file of {\"prompt\", \"label\"} rows")
    parser.add_argument("--token", default=None, help="the job's token (default: $VIME_TOKEN); tcp jobs need it")
    args = parser.parse_args(argv)
    configure("warning")
    rows = load_rows(data=args.prompts)
    token = args.token or os.environ.get("VIME_TOKEN") or None
    reply = trio.run(inject, buffer_address(args.run_dir), rows, token)
    print(f"injected {reply.accepted} prompts; {reply.waiting} wait to be issued")
    return 0


if __name__ == "__main__":
    sys.exit(main())
