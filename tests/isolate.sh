#!/usr/bin/env bash
# Runs a command (the test suite) in a network and mount namespace of its own, where
# this machine allows it, so that two test runs on one machine never meet.
#
# Why: the test kubelet (tests/e2e/kubelet.py) runs every pod as a process on the host
# network, where a pod's fixed ports (29500-29511, 29502) are the host's, and it writes
# the cluster DNS names of pods into /etc/hosts. Two runs side by side (two checkouts,
# CI beside a developer's run) would bind each other's ports and overwrite each other's
# names. Here each run gets its own loopback, an address that is not loopback (Endpoints
# reject 127.0.0.0/8) with a default route through it, and a private copy of /etc/hosts.
# Nothing inside the suite needs the outside network: dependencies and the control-plane
# binaries are installed before it starts.
#
# Where the namespace cannot be made (not root, no unshare or ip), the command runs as it
# is, with a note: one run at a time on that machine.
set -euo pipefail

ADDRESS=10.254.0.1

can_isolate() {
    [[ $EUID -eq 0 ]] && command -v unshare >/dev/null && command -v ip >/dev/null \
        && unshare --net --mount true 2>/dev/null
}

# `isolate.sh --check`: exit 0 where a namespace can be made (the Makefile then runs test
# processes side by side, each through this script).
if [[ "${1:-}" == --check ]]; then
    can_isolate
    exit
fi

if [[ "${SPLITFEED_ISOLATED:-}" != 1 ]]; then
    if can_isolate; then
        exec unshare --net --mount --fork env SPLITFEED_ISOLATED=1 bash "$0" "$@"
    fi
    echo "tests/isolate.sh: no network namespace here (needs root, unshare and ip):" \
         "running on the host network, so run one test suite at a time on this machine" >&2
    exec "$@"
fi

mount --make-rprivate /
ip link set lo up
ip addr add "$ADDRESS/32" dev lo
ip route add default dev lo src "$ADDRESS"
# Names resolve here and at once: the pod address names this host (gloo's reverse lookup
# of its own address), and a name /etc/hosts lacks is refused by a resolver on loopback
# where none listens, instead of timing out on a server out of reach (10 s a rendezvous).
hosts="$(mktemp)"
resolv="$(mktemp)"
cp /etc/hosts "$hosts"
echo "$ADDRESS $(hostname)" >> "$hosts"
echo "nameserver 127.0.0.1" > "$resolv"
mount --bind "$hosts" /etc/hosts
mount --bind "$resolv" /etc/resolv.conf
status=0
"$@" || status=$?
umount /etc/hosts /etc/resolv.conf
rm -f "$hosts" "$resolv"
exit "$status"
