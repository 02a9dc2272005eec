"""Every wire message of splitfeed, as typed frozen dataclasses.

Payload never travels here: batches live in ring slots (`slots`), and these
messages only say where and when. Three conversations use them:

    trainer -> sidecar (ipc, DEALER -> ROUTER):  Hello, Checkpoint, Commit, Drain, Wake, Bye
    sidecar -> trainer:                          Welcome, Ready, End, Checkpointed, Committed, Error
    member sidecar -> coordinator (tcp):         Join, Frozen, DrainRequest, CommittedWorld
    coordinator -> member:                       Joined, Freeze, CommitAt, Complete, WorldLost, Error
    operator / `splitfeed local` -> coordinator: DrainRequest, answered by DrainAck
    member -> coordinator: Progress; operator -> coordinator: StatusRequest, answered by Status
    trainer whose sidecar died -> coordinator:   StandIn, answered by Checkpointed, Committed or Error

(docs/agreement.md has the world's agreement.) Each message is one ZeroMQ
frame of compact JSON, `{"v": 1, "type": ..., <fields>}`: following pyzmq's
serialization guidance, we turn a message into bytes ourselves (`encode`) and
send bytes, rather than `send_json`/`send_pyobj`; JSON rather than pickle,
which would execute code on the receiver. Like httpx's models, a message is a
plain typed object and the wire form is built and parsed in one place.

Versions. `v` is the wire protocol version (PROTOCOL_VERSION), bumped for any change a
peer of the version before cannot read (a field added with a default is not one: see
Message); `hello` and `welcome` also carry the splitfeed package version (`package`).
Three things never change from one version to the next, so that two sides of different
versions end their conversation at once with one error that names both: the envelope
(`v`, `type`), the `error` message's fields (`code`, `message`, `fatal`), and the name of
the `package` field. A side that receives a frame of another version knows the peer's
version from it (`decode` raises VersionMismatch), and the sidecar answers it with a
fatal error in the *sender's* version (`refusal`), which the sender reads as its own; the
package version and the text that names both sides' are `versions`.

`decode` validates everything a peer controls: the frame's size, the protocol
version, the type, that every field is present with its declared type (a bool
is not an int) and nothing else, and that integers fit the int64 words they
end up in. Any failure of the JSON layer (deep nesting is a RecursionError, a
5,000-digit number a ValueError) is a ProtocolError like the rest, so garbage
gets an error reply instead of crashing the sidecar. Receivers dispatch on the
class (`match message: case Hello(): ...`), never on a type string.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from .errors import ProtocolError, VersionMismatch

PROTOCOL_VERSION = 1
"""The wire protocol's version: every frame's `v`; `splitfeed --version` prints it."""
VERSION_MISMATCH = "version"
"""Error.code of a refusal of a frame of another protocol version (`refusal`): fatal."""
MAX_MESSAGE_BYTES = 64 * 1024
"""Also ZeroMQ's MAXMSGSIZE on every socket that receives these: a larger frame is dropped before it is buffered."""
SOCKET_NAME = "sidecar.sock"
"""The sidecar's ROUTER socket in the pod's socket directory."""
_INT64 = 1 << 63

RECONNECT_IVL_MS = 10
RECONNECT_IVL_MAX_MS = 100
"""How soon a member's or a trainer's DEALER tries again to reach a socket not bound yet (the
next world's coordinator, a sidecar between two worlds): after 10 ms, doubling up to ZeroMQ's
default of a flat 100 ms, which was most of the time a member sidecar took to join the next
world in place (0.13-0.19 s from its drain to serving). A maximum of 1 s cost a new pod's
trainer up to 1 s: it had waited seconds for its sidecar, and tried again that late."""

M = TypeVar("M", bound="Message")


@dataclasses.dataclass(frozen=True)
class Message:
    """Base of every message; `kind` is the wire name (its "type"), `_schema` the allowed Python types per field.

    A field with a default is one a later version added: a frame leaves it out while it
    holds the default, so a peer of the version before (an operator upgraded while its
    jobs' sidecars run) still reads every frame that does not use it.
    """

    kind: ClassVar[str] = ""
    _schema: ClassVar[dict[str, tuple[type, ...]]] = {}
    _defaults: ClassVar[dict[str, Any]] = {}

    def encode(self) -> bytes:
        """One frame; ProtocolError for a message the peer would refuse to receive."""
        fields = {name: getattr(self, name) for name in self._schema}
        _validate(self.kind, self._schema, fields)
        fields = {k: v for k, v in fields.items() if k not in self._defaults or v != self._defaults[k]}
        blob = json.dumps({"v": PROTOCOL_VERSION, "type": self.kind, **fields}, separators=(",", ":")).encode()
        if len(blob) > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"{self.kind} message of {len(blob)} bytes exceeds {MAX_MESSAGE_BYTES}")
        return blob

    @classmethod
    def decode(cls: type[M], frame: bytes) -> M:
        """Parse one frame that must hold this class's message (any message, called on `Message`)."""
        message = decode(frame)
        if not isinstance(message, cls):
            raise ProtocolError(f"expected a {cls.kind or 'message'} message, got {message.kind}")
        return message


_TYPES: dict[str, type[Message]] = {}
_NAMES = {"int": int, "str": str, "bool": bool, "None": None, "float": float, "list": list}
"""The only names a field's annotation may use: the JSON scalars (and a list, for a histogram's counts)."""


def _wire(kind: str) -> typing.Callable[[type[M]], type[M]]:
    """Register a message class under its wire name; its field annotations are its schema."""

    def register(cls: type[M]) -> type[M]:
        schema: dict[str, tuple[type, ...]] = {}
        for field in dataclasses.fields(cls):
            # The annotation as written ("int | None"), evaluated over the JSON scalars only.
            hint = eval(field.type, _NAMES) if isinstance(field.type, str) else field.type
            allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
            # list[int] is checked as a list; its items are the receiver's to check (progress.checked).
            schema[field.name] = tuple(type(None) if t is None else typing.get_origin(t) or t for t in allowed)
        cls.kind, cls._schema = kind, schema
        cls._defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        _TYPES[kind] = cls
        return cls

    return register


# -- trainer -> sidecar -------------------------------------------------------------------------

@_wire("hello")
@dataclasses.dataclass(frozen=True)
class Hello(Message):
    """A trainer (re)connects; `next_step` None: a new process, continue where the world is.
    `package`: the trainer's splitfeed version (versions.package_version); "" from a splitfeed whose
    hello did not say it yet."""

    local_rank: int
    pid: int
    next_step: int | None
    package: str = ""


@_wire("checkpoint")
@dataclasses.dataclass(frozen=True)
class Checkpoint(Message):
    """Phase one: persist this rank's data position at `step`."""

    step: int


@_wire("commit")
@dataclasses.dataclass(frozen=True)
class Commit(Message):
    """Phase two: the model for `step` is saved."""

    step: int


@_wire("drain")
@dataclasses.dataclass(frozen=True)
class Drain(Message):
    """This trainer process got SIGTERM: ask the world to drain."""

    reason: str


@_wire("wake")
@dataclasses.dataclass(frozen=True)
class Wake(Message):
    """Wake the rank's publisher (it looks at the ring). StreamClient wakes it through the ring's
    futex instead (slots, rule 3); the sidecar still honours this message."""


@_wire("bye")
@dataclasses.dataclass(frozen=True)
class Bye(Message):
    """The trainer closed its client."""


# -- sidecar -> trainer -------------------------------------------------------------------------

@_wire("welcome")
@dataclasses.dataclass(frozen=True)
class Welcome(Message):
    """The answer to `hello`: who this rank is, where its control block is, where to continue."""

    instance: str
    rank: int
    world_size: int
    ctl: str
    resume_step: int
    next_step: int
    total_steps: int
    steps_per_epoch: int
    package: str = ""
    """The sidecar's splitfeed version, said only to a trainer whose hello said its own: a
    trainer of before, whose decode refuses a field it does not know, gets the welcome it knows."""
    data_rank: int = -1
    """This rank's data-parallel rank, said only where spec.data.ranksPerBatch > 1 (-1: the
    rank itself), so the welcome of a plain job is the one a trainer of before knows."""
    data_size: int = -1
    """The data-parallel size, said with `data_rank` (-1: the world size)."""


@_wire("ready")
@dataclasses.dataclass(frozen=True)
class Ready(Message):
    """Wakes a waiting trainer; the ring says the rest. The sidecar no longer sends it (the ring's
    futex wakes the trainer: slots, rule 2); a trainer treats it as any wake-up."""

    global_step: int


@_wire("end")
@dataclasses.dataclass(frozen=True)
class End(Message):
    next_step: int


@_wire("checkpointed")
@dataclasses.dataclass(frozen=True)
class Checkpointed(Message):
    step: int
    drained: bool
    uri: str


@_wire("committed")
@dataclasses.dataclass(frozen=True)
class Committed(Message):
    step: int


NOT_WELCOMED = "not-welcomed"
"""Error.code for a message from a trainer the sidecar has not welcomed (errors.NotWelcomed)."""
WORLD_ENDED = "world-ended"
"""Error.code for a hello that would continue, in the world a sidecar went on to in place, the
world before it: that world ended (drained, or lost a member pod), and the trainer rejoins
(`StreamClient.rejoin`; errors.WorldLost)."""


@_wire("error")
@dataclasses.dataclass(frozen=True)
class Error(Message):
    """Any side's refusal; `fatal`: the sidecar cannot serve this rank at all; `code`
    NOT_WELCOMED: the sender is not known here (say hello again)."""

    code: str
    message: str
    fatal: bool


# -- the world's agreement (docs/agreement.md) ------------------------------------------------

@_wire("join")
@dataclasses.dataclass(frozen=True)
class Join(Message):
    """`drain_step` >= 0: the drain step this member was told (`commit_at`) and acts on, with
    its reason and next world; a coordinator restarted during that drain adopts it."""

    replica: int
    instance: str
    published: int
    drain_step: int = -1
    drain_reason: str = ""
    next_replicas: int = 0


@_wire("joined")
@dataclasses.dataclass(frozen=True)
class Joined(Message):
    """`replicas`: the world's size; a member of a higher replica is not in it (it left
    in an in-place rescale, docs/agreement.md) and ends. 0 from an older coordinator."""

    resume_step: int
    table_version: int | None
    replicas: int = 0


@_wire("freeze")
@dataclasses.dataclass(frozen=True)
class Freeze(Message):
    round: int


@_wire("frozen")
@dataclasses.dataclass(frozen=True)
class Frozen(Message):
    round: int
    replica: int
    published: int


@_wire("commit_at")
@dataclasses.dataclass(frozen=True)
class CommitAt(Message):
    """`next_replicas` > 0: the world changes in place after the drain, to that many replicas
    as far as the coordinator knows now (the next world's coordinator decides; docs/agreement.md)."""

    round: int
    step: int
    drain: bool
    reason: str
    next_replicas: int = 0


@_wire("committed_world")
@dataclasses.dataclass(frozen=True)
class CommittedWorld(Message):
    replica: int
    step: int


@_wire("complete")
@dataclasses.dataclass(frozen=True)
class Complete(Message):
    step: int


@_wire("drain_request")
@dataclasses.dataclass(frozen=True)
class DrainRequest(Message):
    """From the operator, `splitfeed local`, a member or a member's trainer; deduplicated by `token`.

    `not_before`: drain at this global step at the earliest (`splitfeed local --scale-at`
    asks ahead so the world drains exactly there); 0 drains as soon as the world can.
    `replicas` > 0: rescale in place to that many replicas (the pods that stay keep running);
    0: the world ends at the drain and is replaced.
    `lost` (the operator, spec.rescale inPlace): these member replicas' pods failed, so no
    step can be agreed: the world ends at once, without a drain, and its other members go on
    in place to a world of `replicas` replicas from the newest complete checkpoint, which the
    next world's coordinator picks (`world_lost`). None: an ordinary drain."""

    token: str
    reason: str
    not_before: int = 0
    replicas: int = 0
    lost: list[int] | None = None


@_wire("world_lost")
@dataclasses.dataclass(frozen=True)
class WorldLost(Message):
    """Coordinator -> every member: members `lost` are gone and the world ends now, without a
    drain (a `drain_request` with `lost`). A member not in `lost` serves the next world in place,
    `replicas` replicas, from the newest complete checkpoint; one in `lost` ends."""

    replicas: int
    lost: list[int]


@_wire("drain_ack")
@dataclasses.dataclass(frozen=True)
class DrainAck(Message):
    token: str
    state: str


# -- onTransformError=skip/warn: the world's look-ahead watermark (docs/preprocessing.md) ------

@_wire("reach")
@dataclasses.dataclass(frozen=True)
class Reach(Message):
    """Member -> coordinator, flat: per rank `rank, assembled, n, epoch_1, end_1, ... epoch_n,
    end_n`: the highest global step it holds ready (total steps once its reader is done), and
    where its epochs ended early (an epoch's end counted in steps within the epoch)."""

    replica: int
    reports: list[int]


@_wire("agreed")
@dataclasses.dataclass(frozen=True)
class Agreed(Message):
    """Coordinator -> every member: every rank holds each step up to `through`; an epoch in
    `ends` (flat: `epoch, end, ...`) has no step at or past `end` anywhere; `need` (-1: none)
    is the step a drain waits to hear about (ranks read on until they hold it)."""

    through: int
    ends: list[int]
    need: int


# -- live progress (docs/observability.md) -----------------------------------------------------

@_wire("progress")
@dataclasses.dataclass(frozen=True)
class Progress(Message):
    """Member -> coordinator every few seconds: its ranks' counts (trainer_client.progress)."""

    replica: int
    global_step: int
    steps_per_epoch: int
    rows: int
    rows_per_s: float | int
    wait_s: float | int
    wall_s: float | int
    buckets: list[int]
    filled_rows: int
    """Rows the member's loaders replaced under onTransformError=fill so far (its share of
    progress.ROW_COUNTS; a new per-row count is one more field here and in Status)."""
    skipped_rows: int
    """Rows dropped under onTransformError=skip/warn from the steps the member published."""
    first_batch_at: float | int | None = None
    """Wall-clock time (Unix seconds) by which every rank of the member had received the
    world's first batch; None until then. How a rescale's latency is timed to the batch."""


@_wire("status_request")
@dataclasses.dataclass(frozen=True)
class StatusRequest(Message):
    """Operator -> coordinator: the world's progress, please."""


@_wire("status")
@dataclasses.dataclass(frozen=True)
class Status(Message):
    """The coordinator's answer: the members' sums (trainer_client.progress.world_status)."""

    replicas: int
    reporting: int
    global_step: int | None
    steps_per_epoch: int
    total_steps: int
    resume_step: int
    rows: int
    rows_per_s: float | int
    wait_s: float | int
    wall_s: float | int
    buckets: list[int]
    drain_step: int | None
    filled_rows: int
    """The members' filled_rows summed (progress.ROW_COUNTS)."""
    skipped_rows: int
    """The members' skipped_rows summed (progress.ROW_COUNTS)."""
    world_epoch: int = -1
    """The world this coordinator runs (-1: not said): how the operator sees an in-place change done."""
    first_batch_at: float | int | None = None
    """When the world's first batch had reached every rank (the latest member's
    `first_batch_at`); None until every member said."""
    stood_in: list[int] | None = None
    """The replicas of the world before, changed in place into this one, whose dead sidecar that
    world's coordinator stood in for at its drain step, this world's resume step
    (sidecar.standins); None: none. The operator names their pods (DrainSurvivedLostSidecar)."""


# -- a rank whose sidecar died during a drain (trainer_client.stranded) ---------------------------

@_wire("stand_in")
@dataclasses.dataclass(frozen=True)
class StandIn(Message):
    """Trainer -> its world's coordinator, when the trainer's own sidecar is gone: write rank
    `rank`'s checkpoint record (`commit` False: phase one) or commit marker (True: phase two) at
    the world's committed drain step `step`, in its stead. Answered by `checkpointed` or
    `committed`, or an `error` saying why not (sidecar.standins: only a plain job's drain step
    of the coordinator's own world, for a rank of a member it serves)."""

    rank: int
    world_size: int
    world_epoch: int
    step: int
    commit: bool = False


def decode(frame: bytes) -> Message:
    """Parse and validate one frame; ProtocolError says what is wrong with it."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        message = json.loads(frame)
    except Exception as exc:  # JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError, ...
        raise ProtocolError(f"message is not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(message, dict):
        raise ProtocolError("message is not a JSON object")
    version = message.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        text = (f"protocol version {_short(version)} is not {PROTOCOL_VERSION}; "
                "run the same splitfeed version in the trainer and the sidecar")
        if type(version) is not int:  # no version at all (True is not 1 either): not a peer's frame
            raise ProtocolError(text)
        package = message.get("package")
        raise VersionMismatch(text, peer_protocol=version,
                              peer_package=package[:64] if isinstance(package, str) else "")
    kind = message.get("type")
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None or not isinstance(kind, str):
        raise ProtocolError(f"unknown message type {_short(kind)}")
    fields = {name: value for name, value in message.items() if name not in ("v", "type")}
    _validate(kind, cls._schema, fields, optional=cls._defaults)
    return cls(**fields)


def refusal(peer_protocol: int, text: str) -> bytes | None:
    """A fatal `error` frame in the peer's protocol version `peer_protocol`, which it can read
    whatever its version (the error's shape never changes); None for a version no peer has."""
    if not 0 < peer_protocol < 1 << 31:
        return None
    return json.dumps({"v": peer_protocol, "type": "error", "code": VERSION_MISMATCH,
                       "message": text, "fatal": True}, separators=(",", ":")).encode()


def _validate(kind: str, schema: Mapping[str, tuple[type, ...]], fields: Mapping[str, Any],
              optional: Mapping[str, Any] | None = None) -> None:
    extra = set(fields) - set(schema)
    if extra:
        raise ProtocolError(f"{kind} message has unknown fields {sorted(extra)}")
    for field, allowed in schema.items():
        value = fields.get(field, _MISSING)
        if value is _MISSING and optional and field in optional:
            continue
        if value is _MISSING:
            raise ProtocolError(f"{kind} message lacks field {field!r}")
        if isinstance(value, bool) and bool not in allowed:
            raise ProtocolError(f"{kind}.{field} must be {allowed[0].__name__}, got a bool")
        if not isinstance(value, allowed):
            raise ProtocolError(f"{kind}.{field} must be {allowed[0].__name__}, got {_short(value)}")
        if isinstance(value, int) and not -_INT64 <= value < _INT64:
            raise ProtocolError(f"{kind}.{field} is out of the int64 range")


def _short(value: Any) -> str:
    """A bounded description: repr of a deeply nested list would itself raise RecursionError."""
    if not isinstance(value, (str, int, float, type(None))):
        return f"a JSON {type(value).__name__}"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


_MISSING = object()
