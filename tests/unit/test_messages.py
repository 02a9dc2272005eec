"""The wire messages (trainer_client/contract/messages.py): what a peer may send, and what is refused.

The frames here are written out by hand, as a peer of another version or a
hostile one would send them; the typed objects are what a receiver must get.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from splitfeed.trainer_client.contract import messages
from splitfeed.trainer_client.contract.errors import ProtocolError, VersionMismatch
from splitfeed.trainer_client.contract.messages import (
    CommitAt,
    DrainAck,
    DrainRequest,
    Error,
    Hello,
    Joined,
    Ready,
    Wake,
    Welcome,
)


@pytest.mark.parametrize("frame,expected", [
    (b'{"v":1,"type":"hello","local_rank":0,"pid":12,"next_step":null}', Hello(local_rank=0, pid=12, next_step=None)),
    (b'{"v":1,"type":"hello","local_rank":1,"pid":12,"next_step":7}', Hello(local_rank=1, pid=12, next_step=7)),
    (b'{"v":1,"type":"wake"}', Wake()),
    (b'{"type":"ready","global_step":3,"v":1}', Ready(global_step=3)),
    (b'{"v":1,"type":"joined","resume_step":4,"table_version":null}', Joined(resume_step=4, table_version=None)),
    (b'{"v":1,"type":"commit_at","round":2,"step":9,"drain":true,"reason":"rescale"}',
     CommitAt(round=2, step=9, drain=True, reason="rescale")),
    (b'{"v":1,"type":"error","code":"source","message":"gone","fatal":true}',
     Error(code="source", message="gone", fatal=True)),
    # A field a later version added (with a default) is left out while it holds the default,
    # so a peer of the version before reads the frame; present, it is carried.
    (b'{"v":1,"type":"drain_request","token":"rescale-w0","reason":"rescale"}',
     DrainRequest(token="rescale-w0", reason="rescale")),
    (b'{"v":1,"type":"drain_request","token":"rescale-w0","reason":"rescale","not_before":30}',
     DrainRequest(token="rescale-w0", reason="rescale", not_before=30)),
    (b'{"v":1,"type":"stand_in","rank":3,"world_size":4,"world_epoch":1,"step":9}',
     messages.StandIn(rank=3, world_size=4, world_epoch=1, step=9)),
    (b'{"v":1,"type":"stand_in","rank":3,"world_size":4,"world_epoch":1,"step":9,"commit":true}',
     messages.StandIn(rank=3, world_size=4, world_epoch=1, step=9, commit=True)),
])
def test_a_frame_decodes_to_its_typed_message_and_encodes_back_to_the_same_json(frame, expected):
    message = messages.decode(frame)
    assert message == expected and type(message) is type(expected)
    assert json.loads(message.encode()) == json.loads(frame)


def test_every_message_type_has_a_distinct_wire_name_and_survives_a_round_trip():
    samples = {int: 5, str: "x", bool: True, float: 0.5, list: [1, 2]}
    names = set()
    for cls in messages._TYPES.values():
        fields = {name: samples[types[0]] for name, types in cls._schema.items()}
        message = cls(**fields)
        assert messages.decode(message.encode()) == message
        names.add(cls.kind)
    assert len(names) == len(messages._TYPES) == 28  # world_lost (issue 22 item 3), stand_in (issue 21)


@pytest.mark.parametrize("frame,words", [
    (b"\x00\xff", "not JSON"),
    (b"[1]", "not a JSON object"),
    (b"[" * 60_000, "RecursionError"),
    (b'{"v":1,"type":"hello","local_rank":' + b"7" * 5_000 + b',"pid":1,"next_step":null}', "ValueError"),
    (b'{"v":2,"type":"wake"}', "protocol version 2 is not 1"),
    (b'{"v":1,"type":"launch"}', "unknown message type 'launch'"),
    (b'{"v":1,"type":["x"]}', "unknown message type a JSON list"),
    (b'{"v":1,"type":"ready"}', "ready message lacks field 'global_step'"),
    (b'{"v":1,"type":"ready","global_step":1,"extra":2}', "unknown fields ['extra']"),
    (b'{"v":1,"type":"ready","global_step":true}', "ready.global_step must be int, got a bool"),
    (b'{"v":1,"type":"ready","global_step":"1"}', "ready.global_step must be int, got '1'"),
    (b'{"v":1,"type":"ready","global_step":' + b"9" * 40 + b"}", "int64 range"),
    (b'{"v":1,"type":"checkpointed","step":1,"drained":1,"uri":"u"}', "checkpointed.drained must be bool"),
    (b'{"v":1,"type":"drain_request","token":"t","reason":"r","not_before":"30"}',
     "drain_request.not_before must be int"),
    (b'{"v":1,"type":"drain_request","token":"t","not_before":30}', "drain_request message lacks field 'reason'"),
    (b'{"v":1,"type":"wake","pad":"' + b"x" * (messages.MAX_MESSAGE_BYTES) + b'"}', "exceeds"),
])
def test_a_malformed_frame_is_a_protocol_error_that_says_what_is_wrong(frame, words):
    with pytest.raises(ProtocolError) as info:
        messages.decode(frame)
    assert words in str(info.value)


def test_decoding_as_one_class_refuses_another_message():
    assert DrainAck.decode(b'{"v":1,"type":"drain_ack","token":"t","state":"idle"}') == DrainAck(token="t", state="idle")
    with pytest.raises(ProtocolError, match="expected a welcome message, got ready"):
        Welcome.decode(Ready(global_step=1).encode())


def test_a_message_the_peer_would_refuse_is_not_sent():
    with pytest.raises(ProtocolError, match="int64 range"):
        Ready(global_step=1 << 63).encode()
    with pytest.raises(ProtocolError, match="exceeds"):
        DrainRequest(token="t" * messages.MAX_MESSAGE_BYTES, reason="r").encode()


def test_messages_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Ready(global_step=1).global_step = 2  # type: ignore[misc]


# -- versions (messages, "Versions") ------------------------------------------------------------

def test_a_frame_of_another_protocol_version_names_the_peers_versions():
    with pytest.raises(VersionMismatch) as raised:
        messages.decode(b'{"v":2,"type":"hello","local_rank":0,"pid":1,"package":"9.9.9","new":[1]}')
    assert (raised.value.peer_protocol, raised.value.peer_package) == (2, "9.9.9")
    for frame in (b'{"v":true,"type":"wake"}', b'{"type":"wake"}', b'{"v":"1","type":"wake"}'):
        with pytest.raises(ProtocolError) as raised_plain:  # no version: garbage, not a peer's version
            messages.decode(frame)
        assert not isinstance(raised_plain.value, VersionMismatch), frame


def test_a_refusal_is_read_by_a_peer_of_the_version_it_is_written_in(monkeypatch):
    frame = messages.refusal(7, "the trainer speaks wire protocol 7 ...")
    assert frame is not None and json.loads(frame)["v"] == 7
    monkeypatch.setattr(messages, "PROTOCOL_VERSION", 7)  # as the peer of protocol 7 decodes it
    assert messages.decode(frame) == Error(code=messages.VERSION_MISMATCH, fatal=True,
                                           message="the trainer speaks wire protocol 7 ...")
    assert messages.refusal(0, "x") is None and messages.refusal(1 << 40, "x") is None


def test_hello_and_welcome_leave_the_package_out_only_when_it_is_not_said():
    said = Hello(local_rank=0, pid=1, next_step=None, package="0.1.0")
    assert json.loads(said.encode())["package"] == "0.1.0"
    unsaid = b'{"v":1,"type":"hello","local_rank":0,"pid":1,"next_step":null}'
    assert messages.decode(unsaid) == Hello(local_rank=0, pid=1, next_step=None, package="")
    assert "package" not in json.loads(Welcome("i", 0, 1, "c", 0, 0, 1, 1).encode())
