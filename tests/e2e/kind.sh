#!/usr/bin/env bash
# make e2e-kind: the end-to-end scenario on a kind cluster, with real containers.
#
#   bash tests/e2e/kind.sh
#
# Builds the image (Dockerfile at the repo root), creates a kind cluster whose
# node mounts a host work directory at /e2e, loads the image, writes the
# LanceDB table there (a hostPath in the pods), helm-installs the chart and
# runs tests/e2e/kind_scenario.py: apply a StreamingJob (4 replicas), scale it
# to 2 and then 3 mid-epoch, let it finish, check the trainers' steps against
# lancedb's StreamingDataset, then delete it.
#
# Needs a running Docker daemon, kind, kubectl and helm on PATH, and the
# project's virtual environment (make install). Machines without Docker run
# `make e2e` instead (same scenario, pods as local processes).
#
# Environment: KIND_CLUSTER (default splitfeed-e2e), IMAGE (splitfeed:e2e),
# KEEP_CLUSTER=1 keeps the cluster and the work directory for a look afterwards.
set -euo pipefail
cd "$(dirname "$0")/../.."

log() { printf '[%s] kind.sh: %s\n' "$(date '+%H:%M:%S')" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

command -v docker >/dev/null 2>&1 \
    || die "docker is not installed; make e2e-kind needs Docker (without it, run make e2e)"
docker info >/dev/null 2>&1 \
    || die "no running Docker daemon (docker info failed); make e2e-kind needs Docker (without it, run make e2e)"
for tool in kind kubectl helm; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool is not on PATH"
done
PY="${PYTHON:-.venv/bin/python}"
[[ -x "$PY" ]] || die "no $PY: run make install"

CLUSTER="${KIND_CLUSTER:-splitfeed-e2e}"
IMAGE="${IMAGE:-splitfeed:e2e}"
CTX="kind-$CLUSTER"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/splitfeed-kind.XXXXXX")"
created=0

dump() {
    log "--- pods, jobs, events, operator log"
    kubectl --context "$CTX" get pods -A -o wide || true
    kubectl --context "$CTX" get sj -A -o yaml || true
    kubectl --context "$CTX" get events -A --sort-by=.lastTimestamp | tail -50 || true
    kubectl --context "$CTX" -n splitfeed-system logs deploy/splitfeed --tail=200 || true
}

cleanup() {
    local rc=$?
    if [[ $rc -ne 0 && $created -eq 1 ]]; then dump; fi
    if [[ "${KEEP_CLUSTER:-0}" == 1 ]]; then
        log "keeping cluster $CLUSTER and $WORK (KEEP_CLUSTER=1)"
    else
        if [[ $created -eq 1 ]]; then
            # Files the pods wrote belong to the image's user: remove them from inside the node.
            docker exec "$CLUSTER-control-plane" sh -c 'rm -rf /e2e/*' >/dev/null 2>&1 || true
            kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
        fi
        rm -rf "$WORK" || true
    fi
    exit $rc
}
trap cleanup EXIT

log "docker build -t $IMAGE ."
docker build -t "$IMAGE" .

log "kind create cluster $CLUSTER (host $WORK at /e2e on the node)"
created=1
kind create cluster --name "$CLUSTER" --wait 180s --config - <<EOF
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
    extraMounts:
      - hostPath: $WORK
        containerPath: /e2e
EOF

log "kind load docker-image $IMAGE"
kind load docker-image "$IMAGE" --name "$CLUSTER"

log "writing the LanceDB table (1000 rows) to $WORK/lance/db"
mkdir -p "$WORK/logs" "$WORK/ckpt"
"$PY" -c 'import sys; from tests.support.tables import write_training_table; write_training_table(sys.argv[1])' "$WORK/lance/db"
chmod -R a+rwX "$WORK"  # the pods run as the image's non-root user

log "helm install splitfeed (image $IMAGE)"
helm --kube-context "$CTX" install splitfeed charts/splitfeed \
    --namespace splitfeed-system --create-namespace \
    --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" --set image.pullPolicy=Never \
    --wait --timeout 300s

kubectl --context "$CTX" create namespace e2e
kubectl --context "$CTX" -n e2e create configmap e2e-trainer --from-file=trainer.py=tests/e2e/trainer.py

log "running the scenario"
"$PY" -m tests.e2e.kind_scenario --context "$CTX" --work "$WORK" --image "$IMAGE"
log "passed"
