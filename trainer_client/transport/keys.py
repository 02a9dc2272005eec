"""The job's CURVE keypair: one per job, shared by every socket to its world's coordinator.

The coordinator (replica 0's sidecar) is a ZeroMQ CURVE server holding the job's secret key.
Every client of it (a member sidecar, the operator, `splitfeed local`, a trainer standing in
for its dead sidecar) is a CURVE client that knows the job's public key as the server's and
uses the job's keypair as its own; the coordinator's ZAP handler admits only the job's public
key. A client's handshake proves it holds the matching secret, so holding the job's secret is
being the job, and nothing else can reach the coordinator's message handling
(docs/security.md).

A keypair lives in a directory of two files (wellknown.KEY_PUBLIC, wellknown.KEY_SECRET, Z85
text) named by SPLITFEED_KEYS_DIR: the job's Secret mounted read-only in a pod, or a
directory `splitfeed local` makes per run (0700, files 0600).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import zmq
import zmq.utils.z85

from ..contract import wellknown, errors

KEY_CHARS = 40
"""A Z85-encoded CURVE key (32 bytes)."""
ZAP_VERSION = b"1.0"
ZAP_ADMIT, ZAP_DENY = b"200", b"400"


@dataclasses.dataclass(frozen=True)
class Keypair:
    """The job's keypair, Z85-encoded; its repr never shows the secret."""

    public: bytes
    secret: bytes = dataclasses.field(repr=False)

    def env(self, directory: Path | str) -> dict[str, str]:
        """The environment that points a process at `directory` (where this pair was written)."""
        return {wellknown.KEYS_DIR_ENV: str(directory)}


def require_curve() -> None:
    """A clear error where this libzmq was built without CURVE (libsodium or its own tweetnacl)."""
    if not zmq.has("curve"):
        raise errors.UserError(
            f"this libzmq ({zmq.zmq_version()}) has no CURVE support, which the job's control plane "
            "needs: install pyzmq's wheel (it bundles a libzmq with CURVE) or a libzmq built with libsodium")


def generate() -> Keypair:
    """A fresh keypair."""
    require_curve()
    public, secret = zmq.curve_keypair()
    return Keypair(public=public, secret=secret)


def write(directory: Path, keypair: Keypair) -> Path:
    """Write `keypair` into `directory` (made 0700), each file 0600 and replaced whole; the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    for name, value in ((wellknown.KEY_PUBLIC, keypair.public), (wellknown.KEY_SECRET, keypair.secret)):
        tmp = directory / f".{name}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.write(fd, value)
        finally:
            os.close(fd)
        os.replace(tmp, directory / name)
    return directory


def create(directory: Path) -> Keypair:
    """A fresh keypair written into `directory` (`splitfeed local`'s per-run keys, tests)."""
    keypair = generate()
    write(directory, keypair)
    return keypair


def parse(public: bytes, secret: bytes, where: str) -> Keypair:
    """A checked keypair: two Z85 keys, the public one the secret one's. `where` names their origin."""
    public, secret = public.strip(), secret.strip()
    for name, key in ((wellknown.KEY_PUBLIC, public), (wellknown.KEY_SECRET, secret)):
        if len(key) != KEY_CHARS:
            raise errors.UserError(f"{where}: {name} is not a Z85 CURVE key ({KEY_CHARS} characters, "
                                   f"got {len(key)}): write a keypair made by zmq.curve_keypair()")
    try:
        derived = zmq.curve_public(secret)
    except (ValueError, zmq.ZMQError) as exc:
        raise errors.UserError(f"{where}: {wellknown.KEY_SECRET} is not a Z85 CURVE key: {exc}") from exc
    if derived != public:
        raise errors.UserError(f"{where}: {wellknown.KEY_PUBLIC} is not the public key of {wellknown.KEY_SECRET}: "
                               "write both files of one keypair")
    return Keypair(public=public, secret=secret)


def load(directory: Path | str) -> Keypair:
    """The keypair written in `directory`; a UserError naming the file and the fix."""
    require_curve()
    directory = Path(directory)
    try:
        public = (directory / wellknown.KEY_PUBLIC).read_bytes()
        secret = (directory / wellknown.KEY_SECRET).read_bytes()
    except OSError as exc:
        raise errors.UserError(
            f"{wellknown.KEYS_DIR_ENV}={directory}: cannot read the job's keypair ({exc}): the directory "
            f"must hold {wellknown.KEY_PUBLIC} and {wellknown.KEY_SECRET} (the operator mounts the job's "
            "Secret there; `splitfeed local` writes one per run)") from exc
    return parse(public, secret, f"{wellknown.KEYS_DIR_ENV}={directory}")


def from_env(env: Mapping[str, str] | None = None, who: str = "this process") -> Keypair:
    """The keypair SPLITFEED_KEYS_DIR names; without it a UserError: the control plane has no
    unauthenticated mode."""
    env = os.environ if env is None else env
    directory = env.get(wellknown.KEYS_DIR_ENV)
    if not directory:
        raise errors.UserError(
            f"{wellknown.KEYS_DIR_ENV} is not set: {who} talks to the world's coordinator only with the "
            f"job's CURVE keypair; set it to a directory holding {wellknown.KEY_PUBLIC} and "
            f"{wellknown.KEY_SECRET} (the operator mounts the job's Secret at {wellknown.KEYS_DIR}; "
            "`splitfeed local` makes one per run)")
    return load(directory)


def serve(sock: zmq.Socket[Any], keypair: Keypair) -> None:
    """Make `sock` (before it binds) the job's CURVE server."""
    sock.curve_server = True
    sock.curve_secretkey = keypair.secret
    sock.curve_publickey = keypair.public
    sock.zap_domain = b"splitfeed"


def connect_as(sock: zmq.Socket[Any], keypair: Keypair) -> None:
    """Make `sock` (before it connects) a CURVE client of the job's coordinator, as the job."""
    sock.curve_serverkey = keypair.public
    sock.curve_publickey = keypair.public
    sock.curve_secretkey = keypair.secret


def zap_answer(request: Sequence[bytes], keypair: Keypair) -> tuple[list[bytes], bool, str]:
    """The ZAP (RFC 27) reply to `request`, whether it admits, and the peer's address.

    Admitted: a CURVE handshake whose client key is the job's public key. Anything else
    (another key, another mechanism, a malformed request) is denied."""
    if len(request) < 6 or request[0] != ZAP_VERSION:
        request_id = request[1] if len(request) > 1 else b""
        return [ZAP_VERSION, request_id, b"500", b"malformed ZAP request", b"", b""], False, "?"
    request_id, address, mechanism = request[1], request[3], request[5]
    peer = address.decode(errors="replace") or "?"
    client_key = request[6] if mechanism == b"CURVE" and len(request) > 6 else b""
    if client_key and client_key == zmq.utils.z85.decode(keypair.public):
        return [ZAP_VERSION, request_id, ZAP_ADMIT, b"OK", b"job", b""], True, peer
    return [ZAP_VERSION, request_id, ZAP_DENY, b"not the job's key", b"", b""], False, peer
