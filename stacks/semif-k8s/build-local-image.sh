#!/usr/bin/env bash
# Build the project's image on a machine that cannot pull its CUDA bases, then run it on the demo
# model with the chart's pod settings and ask it /health and a System One question from inside.
#
#   sudo stacks/semif-k8s/build-local-image.sh          # as root (debootstrap, dockerd)
#
# What it does (not in CI: it downloads a Debian root filesystem and ~4 GB of wheels):
#   1. debootstrap a minimal Debian (bookworm: python3, gcc, libc6-dev, ca-certificates, plus the
#      host's extra CAs) and `docker import` it as semif-local/debian:bookworm;
#   2. `docker import` the host's uv binary (the Dockerfile's pinned version) as semif-local/uv;
#   3. build ./Dockerfile with BUILDER_IMAGE/RUNTIME_IMAGE/UV_IMAGE pointing at those, the base's
#      python3 (UV_PYTHON_PREFERENCE=only-system) and EXTRAS="" (the fast kernels need nvcc);
#      the real build leaves every one of these at its CUDA default;
#   4. run it as the chart's pod runs: read-only root filesystem, uid 10001, no privilege
#      escalation, no capabilities, the model read-only under /models, the token as a read-only
#      file, writable /tmp only; --network host on a loopback port;
#   5. from inside the container: GET /health and POST /v1/systemone; then SIGTERM (the drain).
# Prints the time of each step and the image size. Needs debootstrap and docker.io (dockerd with
# BuildKit, 20.10 or newer); starts `dockerd --bridge=none --iptables=false` if none is running.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${SEMIF_IMAGE_WORK:-${XDG_CACHE_HOME:-$HOME/.cache}/semif-serve/local-image}
SUITE=${DEBIAN_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PORT=${SEMIF_IMAGE_PORT:-$((20000 + RANDOM % 20000))}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml" | head -1)
TAG=${IMAGE_TAG:-semif-serve:$VERSION-local}
BASE=semif-local/debian:$SUITE
UV_VERSION=$(sed -n 's|^ARG UV_IMAGE=ghcr.io/astral-sh/uv:\(.*\)$|\1|p' "$ROOT/Dockerfile")
UV_LOCAL=semif-local/uv:$UV_VERSION
# The docker.io CLI speaks BuildKit by itself; a newer CLI without buildx falls back to the legacy
# builder, which cannot run the Dockerfile's RUN --mount cache mounts.
DOCKER=${DOCKER:-/usr/bin/docker}
export DOCKER_BUILDKIT=1

mkdir -p "$WORK"
started=$SECONDS
step() { printf '\n== %s (%ds so far)\n' "$*" $((SECONDS - started)); }

step "docker daemon"
if ! "$DOCKER" info >/dev/null 2>&1; then
  dockerd --bridge=none --iptables=false >"$WORK/dockerd.log" 2>&1 &
  for _ in $(seq 60); do "$DOCKER" info >/dev/null 2>&1 && break; sleep 1; done
fi
"$DOCKER" info --format 'dockerd {{.ServerVersion}}'

step "base image $BASE (debootstrap $SUITE)"
if ! "$DOCKER" image inspect "$BASE" >/dev/null 2>&1; then
  rm -rf "$WORK/rootfs"
  debootstrap --variant=minbase --include=python3,gcc,libc6-dev,ca-certificates \
    "$SUITE" "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log"
  # The host's own extra CAs (here: a TLS-inspecting egress proxy), so that uv inside the build
  # reaches PyPI as the host does; SSL_CERT_FILE points uv at the bundle.
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$WORK/rootfs/usr/local/share/ca-certificates/"
    chroot "$WORK/rootfs" update-ca-certificates >/dev/null
  fi
  tar -C "$WORK/rootfs" -c . | "$DOCKER" import --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' - "$BASE"
  rm -rf "$WORK/rootfs"
fi

step "uv image $UV_LOCAL"
if ! "$DOCKER" image inspect "$UV_LOCAL" >/dev/null 2>&1; then
  # The binary itself: `uv` on PATH may be a shim (pyenv) that means nothing inside the image.
  uv_bin=$(python3 -c 'import uv; print(uv.find_uv_bin())' 2>/dev/null || command -v uv)
  have=$("$uv_bin" --version | awk '{print $2}')
  [ "$have" = "$UV_VERSION" ] || { echo "the host's uv is $have; the Dockerfile pins $UV_VERSION" >&2; exit 1; }
  rm -rf "$WORK/uv" && mkdir -p "$WORK/uv"
  cp "$uv_bin" "$WORK/uv/uv"
  tar -C "$WORK/uv" -c uv | "$DOCKER" import - "$UV_LOCAL"
fi

step "docker build $TAG"
# The Dockerfile's `# syntax=` line asks BuildKit to pull its frontend image, which this machine
# cannot; the daemon's built-in frontend reads the same file (RUN --mount included) without it.
sed '1{/^# syntax=/d}' "$ROOT/Dockerfile" | "$DOCKER" build --network host -t "$TAG" -f - \
  --build-arg BUILDER_IMAGE="$BASE" --build-arg RUNTIME_IMAGE="$BASE" --build-arg UV_IMAGE="$UV_LOCAL" \
  --build-arg UV_PYTHON_PREFERENCE=only-system \
  --build-arg PYTHON_VERSION="$("$DOCKER" run --rm --network none "$BASE" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
  --build-arg EXTRAS="" \
  "$ROOT"
size=$("$DOCKER" image inspect "$TAG" --format '{{.Size}}')
build_seconds=$((SECONDS - started))

step "demo model and token (host side, mounted read-only)"
MODEL="$WORK/demo-model"
(cd "$ROOT" && uv run semif-serve demo-model "$MODEL" >/dev/null)
REVISION=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["revision"])' "$MODEL/DEMO.json")
mkdir -p "$WORK/secret" "$WORK/conf"
python3 -c 'import secrets; print(secrets.token_urlsafe(32))' >"$WORK/secret/api-token"
cp "$ROOT/conf/calibration.json" "$WORK/conf/calibration.json"
chmod -R a+rX "$MODEL" "$WORK/secret" "$WORK/conf"

step "run $TAG as the chart's pod (read-only root, uid 10001, no privilege escalation)"
NAME=semif-local-$PORT
"$DOCKER" rm -f "$NAME" >/dev/null 2>&1 || true
"$DOCKER" run -d --name "$NAME" --network host \
  --read-only --user 10001:10001 --security-opt no-new-privileges:true --cap-drop ALL \
  --tmpfs /tmp:rw,size=256m \
  --mount "type=bind,source=$MODEL,target=/models/demo,readonly" \
  --mount "type=bind,source=$WORK/conf,target=/etc/semif,readonly" \
  --mount "type=bind,source=$WORK/secret,target=/run/secrets/semif,readonly" \
  -e SEMIF_MODEL_PATH=/models/demo -e SEMIF_MODEL_REVISION="$REVISION" \
  -e SEMIF_DEVICE=cpu -e SEMIF_DTYPE=float32 -e SEMIF_DEMO=true \
  -e SEMIF_HOST=127.0.0.1 -e SEMIF_PORT="$PORT" \
  -e SEMIF_API_TOKEN_FILE=/run/secrets/semif/api-token -e SEMIF_CALIBRATION=/etc/semif/calibration.json \
  "$TAG" serve >/dev/null
trap '"$DOCKER" rm -f "$NAME" >/dev/null 2>&1 || true' EXIT
for _ in $(seq 180); do
  "$DOCKER" exec "$NAME" python -c "import urllib.request as r; r.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" \
    >/dev/null 2>&1 && break
  [ "$("$DOCKER" inspect -f '{{.State.Running}}' "$NAME")" = true ] || { "$DOCKER" logs "$NAME"; exit 1; }
  sleep 1
done
"$DOCKER" inspect -f 'user={{.Config.User}} read_only_root={{.HostConfig.ReadonlyRootfs}} security_opt={{.HostConfig.SecurityOpt}} cap_drop={{.HostConfig.CapDrop}}' "$NAME"

step "from inside the container: GET /health, POST /v1/systemone"
"$DOCKER" exec -i -e PORT="$PORT" "$NAME" python - <<'PY'
import json, os, urllib.request as r
base = "http://127.0.0.1:%s" % os.environ["PORT"]
health = json.load(r.urlopen(base + "/health", timeout=10))
print("whoami uid", os.getuid(), "| root fs writable:", os.access("/", os.W_OK), "| model writable:", os.access("/models/demo", os.W_OK))
print("/health", json.dumps({k: health[k] for k in ("status", "ready", "version", "device", "demo")}), "workloads", sorted(health["calibration"]["workloads"]))
token = open("/run/secrets/semif/api-token").read().strip()
body = {"model": "jev-latest", "state": "I was charged twice and the refund has not arrived.",
        "questions": {"wants-refund": {"type": "noul", "instructions": "Is the customer asking for money back?"},
                      "team": {"type": "choice", "instructions": "Which team handles this?",
                               "criteria": {"billing": "Payments and refunds.", "engineering": None}}}}
request = r.Request(base + "/v1/systemone", data=json.dumps(body).encode(), method="POST",
                    headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"})
answer = json.load(r.urlopen(request, timeout=60))
print("/v1/systemone", json.dumps(answer)[:600])
PY

step "SIGTERM: the drain"
"$DOCKER" stop -t 45 "$NAME" >/dev/null
echo "exit code $("$DOCKER" inspect -f '{{.State.ExitCode}}' "$NAME")"
"$DOCKER" logs "$NAME" 2>&1 | tail -3

printf '\nimage %s: %s bytes (%.2f GB); build (base, uv image, docker build) %ds; total %ds\n' \
  "$TAG" "$size" "$(python3 -c "print($size / 1e9)")" "$build_seconds" $((SECONDS - started))
