"""Throw-away TLS files for a local ``--transport tls+tcp`` job: a CA and one certificate it signs.

For tests, benchmarks and a first try of TLS on one machine; a real deployment uses its own CA. Made with
the ``openssl`` command, which every Linux host has, rather than a Python dependency. ECDSA P-256 keys: vime's
TLS refuses RSA ones (``vime.transports.sockets.rsa_key_problem`` says why).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

P256 = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256")  # openssl's flags for an ECDSA P-256 key


def make_tls_files(folder: Path, ca_name: str = "vime-test-ca") -> dict[str, str]:
    """Write a CA and a certificate + key for ``localhost`` and ``127.0.0.1`` to ``folder``; returns the PEM
    paths as ``Cluster.open``'s ``tls`` takes them: ``{"cert_key": ..., "ca": ...}``."""
    if shutil.which("openssl") is None:
        raise RuntimeError("making TLS files needs the openssl command: install it (apt install openssl)")
    folder.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    openssl("req", "-x509", *P256, "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", f"/CN={ca_name}")
    openssl("req", *P256, "-nodes", "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=localhost")
    (folder / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "node.pem", "-days", "2", "-extfile", "ext.cnf")
    (folder / "bundle.pem").write_text((folder / "node.pem").read_text() + (folder / "node.key").read_text())
    for secret in ("ca.key", "node.key", "bundle.pem"):
        (folder / secret).chmod(0o600)
    return {"cert_key": str(folder / "bundle.pem"), "ca": str(folder / "ca.pem")}


if __name__ == "__main__":
    import json
    import sys

    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m vime.devtools.certificates DIR  (writes a test CA and a certificate there)")
    print(json.dumps(make_tls_files(Path(sys.argv[1])), indent=2))
