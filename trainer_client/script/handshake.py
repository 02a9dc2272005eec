"""The trainer's handshake with its rank's sidecar: hello until a welcome, what the welcome says, and the world it puts the process in."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from ..contract import wellknown, layout, membership, messages, versions
from ..transport.channel import Channel
from ..transport import ring
from ..contract.errors import SidecarUnavailable, VersionMismatch

log = logging.getLogger(__name__)

REFUSED_PACKAGE = "hello message has unknown fields ['package']"
"""How a sidecar of a splitfeed whose hello had no `package` yet refuses this one's hello (its
decode refuses a field it does not know): the same protocol version, but an older sidecar."""


def older_sidecar(refusal: str) -> str:
    """The sidecar refused this trainer's hello for the `package` field it does not know."""
    return (f"the sidecar refused this trainer's hello ({refusal}): it runs a splitfeed older than "
            f"this trainer's splitfeed {versions.package_version()} (wire protocol "
            f"{messages.PROTOCOL_VERSION}), one whose hello did not say its version yet; install the "
            "same splitfeed version in the trainer image as in the sidecar image "
            "(`splitfeed --version` in each prints both numbers)")


class Session:
    """What this rank's sidecar said in its last welcome, the next global step this process
    expects, and the world (membership) it trains in."""

    def __init__(self, channel: Channel, directory: Path, local_rank: int, *, timeout_s: float,
                 heartbeat_s: float) -> None:
        self._channel = channel
        self._dir = directory
        self._local_rank = local_rank
        self._timeout_s = timeout_s
        self._heartbeat_s = heartbeat_s
        self.instance = ""
        self.control: ring.Control | None = None
        self.next_step: int | None = None  # None until the first welcome: "continue"
        self.world_size = 1
        self.resume_step = 0
        self.steps_per_epoch = 1
        self.world_epoch = int(os.environ.get(wellknown.WORLD_EPOCH_ENV, "0") or 0)

    def say_hello(self) -> None:
        self._channel.send(messages.Hello(local_rank=self._local_rank, pid=os.getpid(),
                                          next_step=self.next_step, package=versions.package_version()))

    def hello(self, stale: str | None = None) -> messages.Welcome:
        """Send hello until a welcome arrives; the sidecar may be (re)starting. A welcome from
        the sidecar instance `stale` (the world before, answering a hello sent while it still
        served) is not an answer. A sidecar of another version ends it at once (VersionMismatch:
        Channel.receive, or the refusal of an older sidecar here)."""
        deadline = time.monotonic() + self._timeout_s
        membership.mark_waiting(self._dir, self._local_rank)  # a new pod's trainer is ready to join
        while True:
            world = membership.read(self._dir)
            if world is not None and world.state == membership.LEFT:
                raise SidecarUnavailable("this pod is not in its job's world any more (an in-place "
                                         "scale-down left it out): nothing to train")
            self.say_hello()
            while True:
                message = self._channel.receive(self._heartbeat_s)
                if message is None:
                    break  # no answer yet: say hello again
                if isinstance(message, messages.Welcome) and message.instance != stale:
                    return message
                if isinstance(message, messages.Error) and message.message.startswith(REFUSED_PACKAGE):
                    raise VersionMismatch(older_sidecar(message.message), peer_protocol=messages.PROTOCOL_VERSION)
                # a stale ready/end from before the resync: drop it
            if time.monotonic() > deadline:
                raise SidecarUnavailable(
                    f"no sidecar answered at {self._dir / messages.SOCKET_NAME} "
                    f"within {self._timeout_s} s")

    def welcome(self, message: messages.Welcome) -> ring.Control | None:
        """Take in what `message` says; the new control block when it comes from another
        sidecar instance than the last (mapped in place of the old one), else None."""
        self._channel.clear()
        previous, opened = self.instance, None
        if message.instance != self.instance:
            if self.control is not None:
                log.warning("sidecar restarted (instance %s -> %s); continuing at step %s",
                            self.instance, message.instance, message.next_step)
            try:
                control = ring.Control(Path(message.ctl), create=False)
            except FileNotFoundError:
                raise SidecarUnavailable(
                    f"the sidecar at {self._dir} went away during the handshake") from None
            except ValueError as exc:  # a control block of another layout: another splitfeed
                told = versions.mismatch(trainer=(messages.PROTOCOL_VERSION, versions.package_version()),
                                         sidecar=(messages.PROTOCOL_VERSION, message.package))
                raise VersionMismatch(f"{exc}: {told}") from None
            if message.package != versions.package_version():
                log.info("the sidecar runs %s, this trainer splitfeed %s (the same wire protocol %d)",
                         f"splitfeed {message.package}" if message.package else "a splitfeed that does not say its version",
                         versions.package_version(), messages.PROTOCOL_VERSION)
            self.instance = message.instance
            self.control = opened = control  # the old one is unmapped with its last batch (they reference it)
        self.world_size = message.world_size
        self.resume_step = message.resume_step
        self.steps_per_epoch = message.steps_per_epoch
        if self.next_step is None or message.instance != previous:
            # Only the first welcome decides where a fresh process starts; later
            # ones answer our own hello (heartbeats may be answered late).
            self.next_step = message.next_step
        return opened

    def adopt_world(self) -> None:
        """Take the world the sidecar serves (trainer_client.membership) where this process's
        environment says an older one: a process started before its world was known (a new
        pod of an in-place scale-up imports while the old world drains) trains in the world
        it was welcomed into. Before `init_process_group`, which reads the environment."""
        world = membership.read(self._dir)
        if world is not None and world.state in (membership.SERVING, membership.CHANGING) and (
                world.epoch > self.world_epoch or world.world_size != self.world_size):
            os.environ.update(membership.world_env(dict(os.environ), world))
            self.world_epoch = world.epoch
        membership.mark_trained(self._dir, self._local_rank, self.world_epoch)

    def move_on(self, timeout_s: float) -> membership.World | None:
        """After a drain: wait for the world that follows this one in place and set this
        process's environment as a new pod's would be; None when none follows for this rank."""
        world = membership.next_world(self._dir, after=self.world_epoch, timeout_s=timeout_s)
        if world is None:
            return None
        os.environ.update(membership.world_env(dict(os.environ), world))
        self.world_epoch = world.epoch
        self.next_step = None
        return world

    def world(self) -> membership.World:
        """The world this process trains in, from its environment."""
        env = os.environ
        pod = layout.WorldLayout.from_env(env)  # what the operator's WorldLayout.env gave this pod
        return membership.World(
            epoch=self.world_epoch, state=membership.SERVING,
            rank=int(env.get(wellknown.RANK, "0") or 0) - int(env.get(wellknown.LOCAL_RANK, "0") or 0),
            world_size=pod.world_size, replicas=pod.replicas, master_addr=pod.master_addr,
            master_port=pod.master_port, resume_step=self.resume_step)
