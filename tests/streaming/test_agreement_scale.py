"""64 members agree one drain step with the production coordinator, over real ZeroMQ with CURVE.

The coordinator in a process of its own, the members (production `Member`s, one DEALER and
TCP connection each, served by the sidecar's `Coordination`) in two worker processes
(tests/support/world_at_scale.py). Not timed: tests/bench/coordinator.py times it. Every
member must learn the one step the cut rule gives (docs/agreement.md: the highest step any
member published, plus two), and the drain must cost the coordinator three messages a member
(`freeze` out, `frozen` in, `commit_at` out) and the request and its answer: O(members).
"""

from __future__ import annotations

from splitfeed.trainer_client.transport import keys
from tests.support import world_at_scale
from tests.support.world_at_scale import PUBLISHED, SPREAD

MEMBERS = 64


def test_64_members_agree_one_drain_step_with_three_messages_each(tmp_path):
    keys.create(tmp_path / "keys")
    with world_at_scale.World(MEMBERS, tmp_path / "keys", workers=2) as world:
        drain = world.drain()
    highest = max(PUBLISHED + r % SPREAD for r in range(MEMBERS))  # what the stand-in publishers say
    assert drain.steps == {highest + 2: MEMBERS}, drain.steps
    counted = drain.window.messages
    for kind in ("sent freeze", "received frozen", "sent commit_at"):
        assert counted.get(kind) == MEMBERS, counted  # once a member: no heartbeat falls in the drain
    assert (counted.get("received drain_request"), counted.get("sent drain_ack")) == (1, 1), counted
    assert drain.window.of(*world_at_scale.AGREEMENT) == 3 * MEMBERS + 2
    assert drain.window.bytes["sent"] > 0 and drain.window.bytes["received"] > 0
