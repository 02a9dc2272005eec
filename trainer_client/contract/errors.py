"""Every error class of splitfeed: this module is the root of the tree.

    SplitfeedError                                            (trainer_client.contract.errors)
    ├── UserError                                             bad input; the message says what to fix (CLI exits 2)
    │   ├── DataError                                         the table, its columns or the filter cannot feed this job:
    │   │   │                                                 restarting cannot help (the operator fails the job at once)
    │   │   ├── sidecar.world.checkpoints.ProvenanceMismatch  checkpoints of other data or another order
    │   │   └── sidecar.table.plans.PlanError                 a plan that cannot be built, or is damaged or foreign
    │   ├── sidecar.world.checkpoints.StaleWorld              a newer world replaced this pod's
    │   ├── sidecar.world.blobs.StoreUnavailable              the checkpoint store kept failing; a restart may help
    │   ├── MissingExtra                                      (also ImportError) a command's optional dependencies are not
    │   │                                                     installed; names the extra (pip install 'splitfeed[sidecar]')
    │   └── UnsupportedPlatform                               (also ImportError) the shared-memory ring needs Linux
    ├── ProtocolError                                         a malformed, oversized or out-of-order message
    │   ├── NotWelcomed                                       from a trainer the sidecar has not welcomed (it restarted)
    │   └── VersionMismatch                                   the peer speaks another wire protocol version: fatal
    ├── SidecarUnavailable                                    the sidecar does not answer; reconnect or retry
    ├── SidecarFailed                                         the sidecar reported a fatal error (e.g. missing table)
    ├── CheckpointError                                       a checkpoint could not be written or read
    ├── WorldLost                                             (also RuntimeError) this world lost a member pod: rejoin
    ├── sidecar.opening.NotInWorld                            this pod is not in its world any more (an in-place scale-down)
    ├── trainer_client.contract.fields.SpecError              (also ValueError) a manifest field is invalid; names it
    ├── trainer_client.contract.topology.TopologyError        (also ValueError) splits, ranks and batches do not fit
    ├── sidecar.data.positions.IncompatibleState              (also ValueError) a checkpoint state this job cannot continue
    ├── sidecar.forks.forking.ChildDied                       (also RuntimeError) a plan's build child exited without its result
    ├── operator.objects.admission.Rejected                   (also ValueError) a job or scale request breaks a rule
    ├── operator.cluster.kube.KubeError                       (also RuntimeError) an API call failed
    │   ├── operator.cluster.kube.Conflict                    a precondition no longer holds: re-read and decide again
    │   └── operator.cluster.kube.NotOwned                    the object's controller is not this job
    ├── operator.cluster.reconciling._Refused                 a pod creation the API refused (caught in that module)
    └── local.rescaling._EndedFirst                           a world ended before its in-place change was asked (caught there)

Why one root here: the layers let the sidecar and the operator import
trainer_client but never the other way round, so the root must live in the
lowest layer, and each package's errors stay beside the code that raises them
and subclass it. The ValueErrors and the RuntimeError keep their builtin base
as well: pure code raises them and callers at the edges catch them by it (and
wrap SpecError and TopologyError in UserError). tests/unit/test_errors_tree.py
fails when an error class of the packages is missing from this drawing
or from the tree.
"""

from __future__ import annotations


class SplitfeedError(Exception):
    pass


class UserError(SplitfeedError):
    pass


class DataError(UserError):
    pass


class ProtocolError(SplitfeedError):
    pass


class MissingExtra(UserError, ImportError):
    """A command needs modules that `pip install splitfeed` (the trainer client alone) leaves out;
    the message names them and the extra that brings them. An ImportError too, so the dispatcher
    treats it as the one command's missing dependency."""


class UnsupportedPlatform(UserError, ImportError):
    """The shared-memory ring (futex(2) on a mapped control block) exists on Linux only; raised
    when it is first imported anywhere else."""


class VersionMismatch(ProtocolError):
    """The peer speaks another wire protocol version (messages.PROTOCOL_VERSION): nothing it
    says can be read, so the conversation ends at once; the message names both sides' versions.
    `peer_protocol` and `peer_package` are the peer's, where its frame said them."""

    def __init__(self, message: str, *, peer_protocol: int | None = None, peer_package: str = "") -> None:
        super().__init__(message)
        self.peer_protocol = peer_protocol
        self.peer_package = peer_package


class NotWelcomed(ProtocolError):
    """A message from a trainer the sidecar has not welcomed: a restarted sidecar forgot it.
    On the wire an Error with code messages.NOT_WELCOMED; the trainer says hello again."""


class SidecarUnavailable(SplitfeedError):
    pass


class SidecarFailed(SplitfeedError):
    pass


class CheckpointError(SplitfeedError):
    pass


class WorldLost(SplitfeedError, RuntimeError):
    """The world this process trains in lost a member pod and ended without a drain; its
    sidecar went on to the next world. A RuntimeError, as the collective that a lost peer
    fails is: the README's in-place loop catches it and calls `rejoin(failed=True)`."""
