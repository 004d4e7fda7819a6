"""A Kubernetes 1.20.2 control plane on 127.0.0.1 for tests/deploy/test_k8s_controlplane.py.

The binaries come from stacks/semif-k8s/controlplane/build.sh (once per machine, under the user's
cache dir). Real etcd, kube-apiserver, kube-controller-manager and kube-scheduler run here; the
nodes are a stand-in kubelet (StandInKubelet): it registers GPU nodes and writes the status of the
pods bound to them (no container runs), so the scheduler, the deployment, endpoints, disruption
and HPA controllers act on the chart's objects exactly as on a cluster.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "stacks" / "semif-k8s" / "controlplane" / "build.sh"
CACHE = Path(
    os.environ.get("SEMIF_K8S_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "semif-serve" / "k8s-1.20.2"
)
BIN = CACHE / "bin"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")

# Where each kind the suite applies lives in the API (1.20's versions).
RESOURCES = {
    "Namespace": ("api/v1", "namespaces", False),
    "Node": ("api/v1", "nodes", False),
    "PersistentVolume": ("api/v1", "persistentvolumes", False),
    "PersistentVolumeClaim": ("api/v1", "persistentvolumeclaims", True),
    "Secret": ("api/v1", "secrets", True),
    "ConfigMap": ("api/v1", "configmaps", True),
    "Service": ("api/v1", "services", True),
    "Pod": ("api/v1", "pods", True),
    "Deployment": ("apis/apps/v1", "deployments", True),
    "PodDisruptionBudget": ("apis/policy/v1beta1", "poddisruptionbudgets", True),
    "HorizontalPodAutoscaler": ("apis/autoscaling/v2beta2", "horizontalpodautoscalers", True),
    "PriorityClass": ("apis/scheduling.k8s.io/v1", "priorityclasses", False),
    "CustomResourceDefinition": ("apis/apiextensions.k8s.io/v1", "customresourcedefinitions", False),
    "APIService": ("apis/apiregistration.k8s.io/v1", "apiservices", False),
    "ScaledObject": ("apis/keda.sh/v1alpha1", "scaledobjects", True),
    "ServiceMonitor": ("apis/monitoring.coreos.com/v1", "servicemonitors", True),
    "PrometheusRule": ("apis/monitoring.coreos.com/v1", "prometheusrules", True),
}


def build_under_way() -> bool:
    """Whether build.sh is running now (its pid file names a live process)."""
    try:
        os.kill(int((CACHE / ".building").read_text().strip()), 0)
    except (OSError, ValueError):
        return False
    return True


def wait_for_build(seconds: float) -> None:
    """Wait up to `seconds` for a build under way to end (CI starts it beside the tests)."""
    deadline = time.monotonic() + seconds
    while build_under_way() and time.monotonic() < deadline:
        time.sleep(5)


def missing_components() -> str | None:
    """Why the control plane cannot start here (None: it can), naming the build script."""
    absent = [name for name in COMPONENTS if not os.access(BIN / name, os.X_OK)]
    if not absent and (BIN / ".complete").exists():
        return None
    log = CACHE / "build.log"
    tail = log.read_text(errors="replace")[-1500:] if log.exists() else "(no build.log)"
    return (
        f"the Kubernetes 1.20.2 control plane is not built in {BIN} "
        f"(missing: {', '.join(absent) or '.complete'}); run {BUILD_SCRIPT.relative_to(ROOT)} "
        f"(10 to 30 minutes, once per machine). Last build output:\n{tail}"
    )


def free_port() -> int:
    """A loopback TCP port free now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def api_path(obj: dict, name: str | None = None) -> str:
    """The REST path of `obj`'s collection, or of the object itself with `name`."""
    prefix, plural, namespaced = RESOURCES[obj["kind"]]
    namespace = obj.get("metadata", {}).get("namespace")
    path = f"/{prefix}/namespaces/{namespace}/{plural}" if namespaced else f"/{prefix}/{plural}"
    return f"{path}/{name}" if name else path


def now_rfc3339() -> str:
    """Now, as the API writes times."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ControlPlane:
    """etcd, kube-apiserver, kube-controller-manager and kube-scheduler on 127.0.0.1 ports."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.processes: list[tuple[str, subprocess.Popen]] = []
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        # One bearer token for the suite and the components, made per run, kept in the work dir.
        self._token = secrets.token_urlsafe(24)
        self.api = self.client()
        self.kubeconfig = workdir / "kubeconfig"

    def client(self, timeout: float = 30) -> httpx.Client:
        """A client of the API (its self-signed loopback certificate is not checked)."""
        return httpx.Client(
            base_url=self.url,
            timeout=timeout,
            verify=False,
            headers={"Authorization": f"Bearer {self._token}"},
        )

    def _start(self, name: str, args: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        process = subprocess.Popen([str(BIN / name), *args], stdout=log, stderr=subprocess.STDOUT)
        self.processes.append((name, process))

    def start(self) -> None:
        """Starts every component and returns once the API serves and the controllers run."""
        work = self.workdir
        subprocess.run(
            ["openssl", "genrsa", "-out", str(work / "sa.key"), "2048"], check=True, capture_output=True
        )
        tokens = work / "tokens.csv"
        tokens.touch(mode=0o600)
        tokens.write_text(f'{self._token},suite,suite,"system:masters"\n')
        client, peer = free_port(), free_port()
        self._start(
            "etcd",
            [
                f"--data-dir={work / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{client}",
                f"--advertise-client-urls=http://127.0.0.1:{client}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=default=http://127.0.0.1:{peer}",
            ],
        )
        self._start(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{client}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--cert-dir={work / 'certs'}",
                f"--token-auth-file={tokens}",
                "--authorization-mode=AlwaysAllow",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={work / 'sa.key'}",
                f"--service-account-signing-key-file={work / 'sa.key'}",
                # No real address to publish for the `kubernetes` Service (loopback is refused).
                "--endpoint-reconciler-type=none",
            ],
        )
        self.wait_for(lambda: self.serves("/readyz"), 120, "the API server to be ready")
        self.kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {"name": "local", "cluster": {"server": self.url, "insecure-skip-tls-verify": True}}
                    ],
                    "users": [{"name": "local", "user": {"token": self._token}}],
                    "contexts": [{"name": "local", "context": {"cluster": "local", "user": "local"}}],
                    "current-context": "local",
                }
            )
        )
        master = f"--kubeconfig={self.kubeconfig}"
        self._start(
            "kube-controller-manager",
            [
                master,
                "--leader-elect=false",
                "--port=0",
                "--secure-port=0",
                "--controllers=*",
                f"--service-account-private-key-file={work / 'sa.key'}",
                "--use-service-account-credentials=false",
                # The stand-in kubelet heartbeats once; nodes stay Ready for the whole suite.
                "--node-monitor-grace-period=1h",
                "--horizontal-pod-autoscaler-sync-period=1s",
            ],
        )
        self._start("kube-scheduler", [master, "--leader-elect=false", "--port=0", "--secure-port=0"])
        self.wait_for(
            lambda: self.serves("/api/v1/namespaces/default/serviceaccounts/default"),
            120,
            "the controller manager to create the default service account",
        )

    def serves(self, path: str) -> bool:
        """Whether GET `path` answers 200 now."""
        try:
            return self.api.get(path).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        """Stops every component, newest first."""
        for _, process in reversed(self.processes):
            process.terminate()
        for _, process in reversed(self.processes):
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        self.api.close()

    def exited(self) -> list[str]:
        """The components that have exited."""
        return [name for name, process in self.processes if process.poll() is not None]

    def wait_for(self, condition: Callable[[], object], seconds: float, what: str, every: float = 0.2):
        """Polls `condition` until it returns something truthy; fails naming `what` after `seconds`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if dead := self.exited():
                raise AssertionError(f"{dead} exited while waiting for {what}; logs in {self.workdir}")
            result = condition()
            if result:
                return result
            time.sleep(every)
        raise AssertionError(f"timed out after {seconds} s waiting for {what}")

    def apply(self, obj: dict, manager: str = "helm") -> httpx.Response:
        """Server-side apply of `obj`, as `helm install --server-side` or `kubectl apply --server-side`."""
        return self.api.patch(
            api_path(obj, obj["metadata"]["name"]),
            params={"fieldManager": manager, "force": "true"},
            content=json.dumps(obj),
            headers={"Content-Type": "application/apply-patch+yaml"},
        )

    def create(self, obj: dict) -> httpx.Response:
        """POST `obj` to its collection: the suite's own objects (1.20's aggregator cannot apply)."""
        return self.api.post(api_path(obj), json=obj)

    def get(self, path: str, **params) -> dict:
        """GET `path` as JSON; an error status raises."""
        response = self.api.get(path, params=params)
        response.raise_for_status()
        return response.json()

    def pods(self, namespace: str, selector: str = "") -> list[dict]:
        """The pods of `namespace` matching the label `selector`."""
        return self.get(f"/api/v1/namespaces/{namespace}/pods", labelSelector=selector)["items"]

    def kubectl(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Runs the built kubectl against this control plane."""
        return subprocess.run(
            [str(BIN / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )


@dataclass
class GpuNode:
    """A node the stand-in kubelet registers: GPUs in its capacity, its taints and labels."""

    name: str
    gpus: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict] = field(default_factory=list)

    def manifest(self) -> dict:
        """The Node object the kubelet registers: capacity, taints, labels, Ready."""
        capacity = {"cpu": "32", "memory": "256Gi", "pods": "110", "ephemeral-storage": "500Gi"}
        if self.gpus:
            capacity["nvidia.com/gpu"] = str(self.gpus)
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": {"kubernetes.io/hostname": self.name, **self.labels}},
            "spec": {"taints": self.taints},
            "status": {
                "capacity": capacity,
                "allocatable": capacity,
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "StandInKubelet",
                        "lastHeartbeatTime": now_rfc3339(),
                        "lastTransitionTime": now_rfc3339(),
                    }
                ],
            },
        }


class StandInKubelet:
    """Registers nodes and plays their kubelet for the pods bound to them: no container runs.

    A bound pod is Running at once and Ready `ready_after` seconds later (a replica loading its
    model), unless its name is in `held`; a pod being deleted leaves at once (grace already spent).
    """

    def __init__(self, plane: ControlPlane, nodes: list[GpuNode], ready_after: float = 1.0):
        self.plane = plane
        self.nodes = {node.name: node for node in nodes}
        self.ready_after = ready_after
        self.held: set[str] = set()
        self.running_since: dict[str, float] = {}
        self.addresses: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stand-in-kubelet", daemon=True)
        self.api = plane.client()

    def start(self) -> None:
        for node in self.nodes.values():
            response = self.api.post("/api/v1/nodes", json=node.manifest())
            assert response.status_code == 201, response.text
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.api.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for pod in self.api.get("/api/v1/pods").json()["items"]:
                    if pod["spec"].get("nodeName") in self.nodes:
                        self._step(pod)
            except (httpx.HTTPError, KeyError, ValueError):
                pass  # the API restarting or a pod gone mid-step: the next pass sees the new state
            self._stop.wait(0.1)

    def _pod_ip(self, uid: str, node: str) -> str:
        if uid not in self.addresses:
            index = list(self.nodes).index(node) + 1
            self.addresses[uid] = f"10.244.{index}.{len(self.addresses) % 250 + 2}"
        return self.addresses[uid]

    def _step(self, pod: dict) -> None:
        meta, status = pod["metadata"], pod.get("status", {})
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        if meta.get("deletionTimestamp"):
            self.api.delete(path, params={"gracePeriodSeconds": "0"})
            return
        uid = meta["uid"]
        if status.get("phase") != "Running":
            self.running_since[uid] = time.monotonic()
        ready = (
            meta["name"] not in self.held
            and time.monotonic() - self.running_since.get(uid, time.monotonic()) >= self.ready_after
        )
        was_ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))
        if status.get("phase") == "Running" and ready == was_ready:
            return
        flag = "True" if ready else "False"
        started = status.get("startTime") or now_rfc3339()
        conditions = [
            {"type": kind, "status": value, "lastTransitionTime": now_rfc3339()}
            for kind, value in (
                ("Initialized", "True"),
                ("PodScheduled", "True"),
                ("ContainersReady", flag),
                ("Ready", flag),
            )
        ]
        containers = [
            {
                "name": c["name"],
                "image": c["image"],
                "imageID": "",
                "ready": ready,
                "restartCount": 0,
                "started": True,
                "state": {"running": {"startedAt": started}},
            }
            for c in pod["spec"]["containers"]
        ]
        ip = self._pod_ip(uid, pod["spec"]["nodeName"])
        self.api.patch(
            f"{path}/status",
            content=json.dumps(
                {
                    "status": {
                        "phase": "Running",
                        "conditions": conditions,
                        "containerStatuses": containers,
                        "podIP": ip,
                        "podIPs": [{"ip": ip}],
                        "hostIP": "192.0.2.1",
                        "startTime": started,
                    }
                }
            ),
            headers={"Content-Type": "application/merge-patch+json"},
        )


class ExternalMetrics:
    """external.metrics.k8s.io/v1beta1 on a loopback HTTPS port: the API KEDA's metrics server serves.

    `values[name]` is the metric's current value; a name set to None answers an error, as KEDA
    does for a query with no result when ignoreNullValues is false.
    """

    GROUP = "external.metrics.k8s.io"

    def __init__(self, workdir: Path):
        self.values: dict[str, float | None] = {}
        self.requests: list[str] = []
        key, cert = workdir / "metrics.key", workdir / "metrics.crt"
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=localhost",
                "-keyout",
                str(key),
                "-out",
                str(cert),
            ],
            check=True,
            capture_output=True,
        )
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # the suite's output stays readable
                pass

            def do_GET(self):
                path = self.path.split("?")[0].rstrip("/")
                metrics.requests.append(path)
                prefix = f"/apis/{metrics.GROUP}/v1beta1"
                if path == prefix:
                    body = {
                        "kind": "APIResourceList",
                        "apiVersion": "v1",
                        "groupVersion": f"{metrics.GROUP}/v1beta1",
                        "resources": [
                            {
                                "name": name,
                                "singularName": "",
                                "namespaced": True,
                                "kind": "ExternalMetricValueList",
                                "verbs": ["get"],
                            }
                            for name in metrics.values
                        ],
                    }
                    return self._answer(200, body)
                parts = path[len(prefix) :].strip("/").split("/")
                if path.startswith(prefix) and len(parts) == 3 and parts[0] == "namespaces":
                    value = metrics.values.get(parts[2])
                    if value is None:
                        return self._answer(
                            404,
                            {
                                "kind": "Status",
                                "apiVersion": "v1",
                                "status": "Failure",
                                "message": f"no value for {parts[2]}",
                                "code": 404,
                            },
                        )
                    item = {
                        "metricName": parts[2],
                        "metricLabels": {},
                        "timestamp": now_rfc3339(),
                        "value": f"{int(value * 1000)}m",
                    }
                    return self._answer(
                        200,
                        {
                            "kind": "ExternalMetricValueList",
                            "apiVersion": f"{metrics.GROUP}/v1beta1",
                            "metadata": {},
                            "items": [item],
                        },
                    )
                return self._answer(
                    404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404}
                )

            def _answer(self, code: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.server.shutdown()
        self.server.server_close()

    def registration(self) -> list[dict]:
        """The Service and APIService that route the aggregated API to this server.

        An ExternalName Service: Endpoints may not hold a loopback address, and the aggregator
        resolves an ExternalName Service to its name and the APIService's port.
        """
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "keda-metrics-apiserver", "namespace": "default"},
            "spec": {"type": "ExternalName", "externalName": "127.0.0.1"},
        }
        api_service = {
            "apiVersion": "apiregistration.k8s.io/v1",
            "kind": "APIService",
            "metadata": {"name": f"v1beta1.{self.GROUP}"},
            "spec": {
                "group": self.GROUP,
                "version": "v1beta1",
                "service": {"name": "keda-metrics-apiserver", "namespace": "default", "port": self.port},
                "insecureSkipTLSVerify": True,
                "groupPriorityMinimum": 100,
                "versionPriority": 100,
            },
        }
        return [service, api_service]


def custom_resource_definitions() -> Iterator[dict]:
    """KEDA's ScaledObject and the Prometheus Operator's ServiceMonitor and PrometheusRule CRDs,
    schema left open.

    Their real schemas are checked against the chart by tests/k8s_crds; 1.20 would drop their CEL
    rules anyway. Installing the kinds lets the API server store the chart's objects.
    """
    for group, kind, plural, version in (
        ("keda.sh", "ScaledObject", "scaledobjects", "v1alpha1"),
        ("monitoring.coreos.com", "ServiceMonitor", "servicemonitors", "v1"),
        ("monitoring.coreos.com", "PrometheusRule", "prometheusrules", "v1"),
    ):
        yield {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{group}"},
            "spec": {
                "group": group,
                "scope": "Namespaced",
                "names": {
                    "kind": kind,
                    "plural": plural,
                    "singular": kind.lower(),
                    "listKind": f"{kind}List",
                },
                "versions": [
                    {
                        "name": version,
                        "served": True,
                        "storage": True,
                        "schema": {
                            "openAPIV3Schema": {
                                "type": "object",
                                "x-kubernetes-preserve-unknown-fields": True,
                            }
                        },
                    }
                ],
            },
        }


class StandInClusterDns:
    """The cluster DNS's rule for a headless Service, on a loopback UDP port.

    `<service>.<namespace>.svc.cluster.local` answers one A record per ready address in the
    Service's Endpoints (what CoreDNS's kubernetes plugin serves); AAAA answers nothing; any
    other name is NXDOMAIN.
    """

    SUFFIX = ".svc.cluster.local"

    def __init__(self, plane: ControlPlane):
        self.api = plane.client(10)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="stand-in-dns", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.sock.close()
        self.api.close()

    def addresses(self, name: str) -> list[str] | None:
        """The A records for `name`; None: no such name."""
        if not name.endswith(self.SUFFIX) or name.count(".") != 4:
            return None
        service, namespace = name.split(".")[:2]
        response = self.api.get(f"/api/v1/namespaces/{namespace}/endpoints/{service}")
        if response.status_code != 200:
            return None
        subsets = response.json().get("subsets") or []
        return sorted({a["ip"] for s in subsets for a in s.get("addresses", [])})

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                query, peer = self.sock.recvfrom(4096)
            except (TimeoutError, OSError):
                continue
            try:
                self.sock.sendto(self.answer(query), peer)
            except (ValueError, IndexError, httpx.HTTPError, OSError):
                continue  # a malformed query or the API gone: the resolver retries

    def answer(self, query: bytes) -> bytes:
        """The response to one DNS query (RFC 1035 wire format, first question only)."""
        end = 12
        labels = []
        while query[end]:
            labels.append(query[end + 1 : end + 1 + query[end]].decode("ascii").lower())
            end += query[end] + 1
        qtype = int.from_bytes(query[end + 1 : end + 3], "big")
        question = query[12 : end + 5]
        found = self.addresses(".".join(labels))
        records = found if found is not None and qtype == 1 else []
        flags = 0x8180 | (3 if found is None else 0)
        header = (
            query[:2] + flags.to_bytes(2, "big") + (1).to_bytes(2, "big") + len(records).to_bytes(2, "big")
        )
        answers = b"".join(
            b"\xc0\x0c\x00\x01\x00\x01" + (5).to_bytes(4, "big") + b"\x00\x04" + socket.inet_aton(ip)
            for ip in records
        )
        return header + b"\x00\x00\x00\x00" + question + answers
