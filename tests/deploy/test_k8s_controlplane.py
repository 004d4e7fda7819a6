"""The chart on a real Kubernetes 1.20.2 control plane: applied, scheduled, rolled, drained, autoscaled.

Real etcd, kube-apiserver, kube-controller-manager and kube-scheduler on 127.0.0.1
(tests/support/k8s_controlplane.py; built once per machine by stacks/semif-k8s/controlplane/build.sh);
a stand-in kubelet plays the nodes (GPU capacity, taints, labels; pod status, no containers). The
scheduler, the deployment, endpoints, disruption and HPA controllers are Kubernetes' own.
Run alone: `uv run pytest -m k8s_controlplane` (under 3 minutes). Skips, naming the build script and
its last output, where the control plane is not built.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import shutil
import socket
import time
from collections.abc import Iterator

import pytest

from bench.gateway import Gateway
from tests.deploy.test_k8s_chart import RELEASE, VALUE_SETS, render, required_tool
from tests.support.k8s_controlplane import (
    ControlPlane,
    ExternalMetrics,
    GpuNode,
    StandInClusterDns,
    StandInKubelet,
    custom_resource_definitions,
    missing_components,
    wait_for_build,
)

pytestmark = pytest.mark.k8s_controlplane
BUILD_WAIT_SECONDS = 40 * 60  # a cold build on 2 busy cores, started by .ci/run beside the tests

FULLNAME = f"{RELEASE}-semif-serve"
SERVER = "app.kubernetes.io/component=server"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
NODES = [
    GpuNode("gpu-a", 2, {"nvidia.com/gpu.product": "NVIDIA-L4"}, [GPU_TAINT]),
    GpuNode("gpu-b", 2, {"nvidia.com/gpu.product": "NVIDIA-A100"}, [GPU_TAINT]),
    GpuNode("cpu-a"),
    GpuNode("cpu-b"),
    GpuNode("cpu-c"),
]
GPU_POOL = sum(node.gpus for node in NODES)
# A fixed fleet from a host path, no gateway: the rollouts' and drains' values.
FIXED = {"autoscaling": {"enabled": False}, "gateway": {"enabled": False}}
NAMESPACES = itertools.count()
HOST_PATH = {"model": {"source": "hostPath", "hostPath": {"path": "/srv/models"}}}


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> Iterator[tuple[ControlPlane, StandInKubelet, ExternalMetrics]]:
    wait_for_build(BUILD_WAIT_SECONDS)
    if reason := missing_components():
        print(f"\n*** SKIPPING the control-plane suite: {reason}\n", flush=True)
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("k8s")
    with contextlib.ExitStack() as teardown:
        # Each part stops even when another's stop fails (no component outlives the session).
        plane = ControlPlane(work)
        teardown.callback(plane.stop)
        plane.start()
        metrics = ExternalMetrics(work)
        teardown.callback(metrics.stop)
        metrics.start()
        kubelet = StandInKubelet(plane, NODES)
        teardown.callback(kubelet.stop)
        kubelet.start()
        for obj in [*custom_resource_definitions(), *metrics.registration()]:
            response = plane.create(obj)
            assert response.status_code == 201, response.text
        plane.wait_for(
            lambda: plane.serves("/apis/keda.sh/v1alpha1") and plane.serves("/apis/monitoring.coreos.com/v1"),
            60,
            "the CRDs to be served",
        )
        plane.wait_for(
            lambda: plane.serves(f"/apis/{ExternalMetrics.GROUP}/v1beta1"), 60, "the external metrics API"
        )
        priority = {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": "gpu-serving"},
            "value": 1000,
        }
        assert plane.create(priority).status_code == 201
        yield plane, kubelet, metrics


@pytest.fixture
def plane(cluster) -> ControlPlane:
    return cluster[0]


@pytest.fixture
def kubelet(cluster) -> StandInKubelet:
    return cluster[1]


@pytest.fixture
def namespace(plane, request) -> Iterator[str]:
    """A fresh namespace with the token Secret; its pods are gone (GPUs free) when the test ends."""
    name = request.node.name.split("[")[0].removeprefix("test_")[:40].replace("_", "-").strip("-")
    name = f"{name}-{next(NAMESPACES)}"
    assert (
        plane.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}).status_code == 201
    )
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "semif-api-token", "namespace": name},
        "stringData": {"api-token": "not-a-real-token-for-the-suite"},
    }
    assert plane.create(secret).status_code == 201
    yield name
    plane.api.delete(
        f"/apis/apps/v1/namespaces/{name}/deployments", params={"propagationPolicy": "Foreground"}
    )
    plane.api.delete(f"/api/v1/namespaces/{name}/pods")
    plane.wait_for(lambda: not plane.pods(name), 60, f"the pods of {name} to go")
    plane.api.delete(f"/api/v1/namespaces/{name}")


def compat_1_20(objects: list[dict]) -> tuple[list[dict], list[str]]:
    """The rendering 1.20 can store, and what was changed for it (everything else unchanged).

    1.20 lacks policy/v1 (1.21) and image volumes (1.33); Helm creates test hooks only on
    `helm test`, so an install never applies them.
    """
    changed, notes = [], []
    for original in objects:
        obj = copy.deepcopy(original)
        kind, name = obj["kind"], obj["metadata"]["name"]
        if "helm.sh/hook" in obj["metadata"].get("annotations", {}):
            notes.append(f"{kind} {name}: a test hook, not part of an install")
            continue
        if kind == "PodDisruptionBudget" and obj["apiVersion"] == "policy/v1":
            obj["apiVersion"] = "policy/v1beta1"
            notes.append(f"{kind} {name}: policy/v1 -> policy/v1beta1")
        for volume in obj.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
            if "image" in volume:
                del volume["image"]
                volume["emptyDir"] = {}
                notes.append(f"{kind} {name}: image volume {volume['name']} -> emptyDir")
        changed.append(obj)
    return changed, notes


def install(plane: ControlPlane, values: dict, namespace: str) -> list[dict]:
    """Renders the chart for `values` and server-side applies it; returns what was applied."""
    objects, _ = compat_1_20(render(values, namespace=namespace))
    for obj in objects:
        response = plane.apply(obj)
        assert response.status_code in (200, 201), (obj["kind"], obj["metadata"]["name"], response.text)
    return objects


def ready(pod: dict) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", [])
    )


def deployment(plane: ControlPlane, namespace: str, name: str = FULLNAME) -> dict:
    return plane.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}")


def rolled_out(plane: ControlPlane, namespace: str, replicas: int) -> bool:
    d = deployment(plane, namespace)
    status = d.get("status", {})
    return (
        status.get("observedGeneration", 0) >= d["metadata"]["generation"]
        and status.get("updatedReplicas") == replicas
        and status.get("readyReplicas") == replicas
        and status.get("replicas") == replicas
    )


def stalled(plane: ControlPlane, namespace: str) -> bool:
    """Whether the deployment controller reports the rollout past its progress deadline."""
    conditions = deployment(plane, namespace).get("status", {}).get("conditions", [])
    stuck = ("Progressing", "False", "ProgressDeadlineExceeded")
    return any((c["type"], c["status"], c.get("reason")) == stuck for c in conditions)


def scheduling_events(plane: ControlPlane, namespace: str) -> str:
    events = plane.get(f"/api/v1/namespaces/{namespace}/events")["items"]
    return " | ".join(e["message"] for e in events if e["reason"] == "FailedScheduling")


PDB_V1BETA1 = "PodDisruptionBudget {}: policy/v1 -> policy/v1beta1"
HOOK = f"Pod {FULLNAME}-test: a test hook, not part of an install"
# What the 1.20 rendering of each values file changes; nothing else differs from Helm's output.
EXPECTED_COMPAT = {
    "default": {HOOK, PDB_V1BETA1.format(FULLNAME), PDB_V1BETA1.format(f"{FULLNAME}-gateway")},
    "hostpath-fixed": {HOOK, PDB_V1BETA1.format(FULLNAME)},
    "image-volume-monitored": {
        HOOK,
        PDB_V1BETA1.format(FULLNAME),
        PDB_V1BETA1.format(f"{FULLNAME}-gateway"),
        f"Deployment {FULLNAME}: image volume model -> emptyDir",
    },
}


@pytest.mark.parametrize("set_name", VALUE_SETS)
def test_server_side_apply_stores_every_value_sets_rendering(plane, namespace, set_name):
    rendered = render(VALUE_SETS[set_name], namespace=namespace)
    objects, notes = compat_1_20(rendered)
    assert set(notes) == EXPECTED_COMPAT[set_name]
    installed = [o for o in rendered if "helm.sh/hook" not in o["metadata"].get("annotations", {})]
    noted = {note.split(":")[0] for note in notes}
    for original, changed in zip(installed, objects, strict=True):
        if f"{original['kind']} {original['metadata']['name']}" not in noted:
            assert changed == original
    for other in {o["metadata"].get("namespace") for o in objects} - {namespace, None}:
        # The namespace Grafana's sidecar watches (`grafanaDashboard.namespace`) exists where
        # kube-prometheus-stack runs; 409: an earlier value set made it.
        made = plane.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": other}})
        assert made.status_code in (201, 409), made.text
    for obj in objects:
        response = plane.apply(obj)
        assert response.status_code in (200, 201), (obj["kind"], obj["metadata"]["name"], response.text)
        stored = response.json()
        managers = {(m["manager"], m["operation"]) for m in stored["metadata"]["managedFields"]}
        assert ("helm", "Apply") in managers
    server = deployment(plane, namespace)
    (container,) = server["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    if set_name != "hostpath-fixed":
        scaled = plane.get(f"/apis/keda.sh/v1alpha1/namespaces/{namespace}/scaledobjects/{FULLNAME}")
        assert scaled["spec"]["maxReplicaCount"] == VALUE_SETS[set_name].get("autoscaling", {}).get(
            "maxReplicas", 4
        )


def test_server_side_apply_rejects_a_bare_number_quantity(plane, namespace):
    """Why the chart renders every quantity as a string: the defect, on the real server."""
    (server,) = [
        o
        for o in install(plane, {**FIXED, **HOST_PATH, "replicaCount": 1}, namespace)
        if o["kind"] == "Deployment"
    ]
    broken = copy.deepcopy(server)
    broken["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 1
    response = plane.apply(broken)
    assert response.status_code >= 400 and "expected string" in response.text, response.text


def test_replicas_land_on_gpu_nodes_through_taint_selector_and_a_bound_claim(plane, namespace):
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "qwen3-5-4b", "namespace": namespace},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "resources": {"requests": {"storage": "20Gi"}},
        },
    }
    volume = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"{namespace}-model"},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "capacity": {"storage": "20Gi"},
            "storageClassName": "",
            "hostPath": {"path": "/srv/models"},
            "claimRef": {"namespace": namespace, "name": "qwen3-5-4b"},
        },
    }
    assert plane.create(volume).status_code == 201 and plane.create(claim).status_code == 201
    install(plane, {"autoscaling": {"enabled": False}, "replicaCount": 3}, namespace)
    plane.wait_for(
        lambda: (
            plane.get(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/qwen3-5-4b")["status"].get(
                "phase"
            )
            == "Bound"
        ),
        60,
        "the claim to bind",
    )
    plane.wait_for(lambda: rolled_out(plane, namespace, 3), 60, "three ready replicas")
    gpu_nodes = {n.name for n in NODES if n.gpus}
    placed = [p["spec"]["nodeName"] for p in plane.pods(namespace, SERVER)]
    assert set(placed) <= gpu_nodes and max(placed.count(n) for n in gpu_nodes) <= 2, placed
    # The gateway does not tolerate the GPU taint; its two pods go to two different CPU nodes.
    gateways = [
        p["spec"].get("nodeName") for p in plane.pods(namespace, "app.kubernetes.io/component=gateway")
    ]
    assert len(gateways) == 2 and len(set(gateways)) == 2 and not set(gateways) & gpu_nodes, gateways
    plane.api.delete(f"/api/v1/persistentvolumes/{namespace}-model")


def test_the_node_selector_keeps_replicas_off_other_gpus(plane, namespace):
    values = copy.deepcopy(VALUE_SETS["hostpath-fixed"])  # 3 replicas on NVIDIA-L4 nodes: gpu-a has 2 GPUs
    install(plane, values, namespace)
    plane.wait_for(
        lambda: (
            sum(ready(p) for p in plane.pods(namespace, SERVER)) == 2 and scheduling_events(plane, namespace)
        ),
        60,
        "two replicas on gpu-a and the third refused",
    )
    pods = plane.pods(namespace, SERVER)
    assert sorted(p["spec"].get("nodeName", "") for p in pods) == ["", "gpu-a", "gpu-a"]
    events = scheduling_events(plane, namespace)
    assert "Insufficient nvidia.com/gpu" in events and "didn't match Pod's node affinity" in events, events


def test_endpoints_list_only_ready_replicas(plane, kubelet, namespace):
    install(plane, {**FIXED, **HOST_PATH, "replicaCount": 3}, namespace)
    plane.wait_for(lambda: rolled_out(plane, namespace, 3), 60, "three ready replicas")
    pods = plane.pods(namespace, SERVER)
    held = pods[0]["metadata"]["name"]
    kubelet.held.add(held)
    try:
        plane.wait_for(
            lambda: sum(ready(p) for p in plane.pods(namespace, SERVER)) == 2,
            30,
            "the held pod to turn unready",
        )
        addresses = {p["status"]["podIP"]: ready(p) for p in plane.pods(namespace, SERVER)}
        for service in (FULLNAME, f"{FULLNAME}-replicas"):

            def listed(service=service):
                (subset,) = plane.get(f"/api/v1/namespaces/{namespace}/endpoints/{service}")["subsets"]
                return {a["ip"] for a in subset.get("addresses", [])}, {
                    a["ip"] for a in subset.get("notReadyAddresses", [])
                }

            plane.wait_for(
                lambda listed=listed: len(listed()[0]) == 2, 30, f"{service} to drop the unready pod"
            )
            serving, waiting = listed()
            assert serving == {ip for ip, ok in addresses.items() if ok}
            assert waiting == {ip for ip, ok in addresses.items() if not ok}
    finally:
        kubelet.held.discard(held)
    plane.wait_for(
        lambda: (
            len(
                plane.get(f"/api/v1/namespaces/{namespace}/endpoints/{FULLNAME}-replicas")["subsets"][0].get(
                    "addresses", []
                )
            )
            == 3
        ),
        30,
        "the pod to return once ready",
    )


def roll(plane: ControlPlane, namespace: str, values: dict, replicas: int, seconds: float) -> int:
    """Changes the calibration, waits for the rollout; returns the fewest ready replicas seen."""
    before = {p["metadata"]["labels"]["pod-template-hash"] for p in plane.pods(namespace, SERVER)}
    install(plane, {**values, "calibration": {"authored144": 1.5}}, namespace)
    fewest = replicas
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pods = plane.pods(namespace, SERVER)
        fewest = min(fewest, sum(ready(p) for p in pods))
        if rolled_out(plane, namespace, replicas) and all(
            p["metadata"]["labels"]["pod-template-hash"] not in before for p in pods
        ):
            return fewest
        time.sleep(0.1)
    raise AssertionError(f"the rollout did not finish in {seconds} s: {scheduling_events(plane, namespace)}")


@pytest.mark.parametrize("replicas", [2, GPU_POOL], ids=["partial-scale", "full-scale"])
def test_a_calibration_change_rolls_every_replica_and_finishes(plane, namespace, replicas):
    values = {**FIXED, **HOST_PATH, "replicaCount": replicas}
    install(plane, values, namespace)
    plane.wait_for(lambda: rolled_out(plane, namespace, replicas), 60, f"{replicas} ready replicas")
    fewest = roll(plane, namespace, values, replicas, 90)
    # maxUnavailable 1: one replica's capacity is the roll's cost, never more.
    assert fewest >= replicas - 1


def test_the_old_surge_strategy_stalls_at_full_scale(plane, namespace):
    """The defect the default strategy fixes: a surge pod needs a GPU that no node has free."""
    values = {**FIXED, **HOST_PATH, "replicaCount": GPU_POOL, "rollout": {"maxSurge": 1, "maxUnavailable": 0}}
    install(plane, values, namespace)
    plane.wait_for(lambda: rolled_out(plane, namespace, GPU_POOL), 60, "a full pool")
    # A short progress deadline: the deployment controller itself then says when a rollout stalls.
    patched = plane.api.patch(
        f"/apis/apps/v1/namespaces/{namespace}/deployments/{FULLNAME}",
        content=json.dumps({"spec": {"progressDeadlineSeconds": 5}}),
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert patched.status_code == 200, patched.text
    install(plane, {**values, "calibration": {"authored144": 1.5}}, namespace)
    plane.wait_for(
        lambda: "Insufficient nvidia.com/gpu" in scheduling_events(plane, namespace),
        30,
        "the surge pod refused",
    )
    plane.wait_for(lambda: stalled(plane, namespace), 60, "the controller to report the rollout stalled")
    status = deployment(plane, namespace)["status"]
    assert status["updatedReplicas"] == 1 and status["readyReplicas"] == GPU_POOL, status


def test_drains_go_one_replica_at_a_time_and_the_budget_refuses_the_last(plane, namespace):
    install(plane, {**FIXED, **HOST_PATH, "replicaCount": 2}, namespace)
    plane.wait_for(lambda: rolled_out(plane, namespace, 2), 60, "two ready replicas")
    try:
        first = plane.kubectl(
            "drain", "gpu-a", "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=60s"
        )
        assert first.returncode == 0, first.stdout + first.stderr
        plane.wait_for(lambda: rolled_out(plane, namespace, 2), 60, "both replicas back, on gpu-b")
        assert {p["spec"]["nodeName"] for p in plane.pods(namespace, SERVER)} == {"gpu-b"}
        budget = f"/apis/policy/v1beta1/namespaces/{namespace}/poddisruptionbudgets/{FULLNAME}"
        plane.wait_for(
            lambda: plane.get(budget).get("status", {}).get("disruptionsAllowed") == 1,
            30,
            "the budget to allow one eviction again",
        )
        # Draining gpu-b too: the first eviction is allowed, its replacement has no GPU anywhere,
        # so the budget (maxUnavailable 1) refuses the second and one replica keeps serving.
        # kubectl retries a refused eviction every 5 s: 8 s sees the second refused twice.
        second = plane.kubectl(
            "drain", "gpu-b", "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=8s"
        )
        assert second.returncode != 0
        assert "disruption budget" in second.stdout + second.stderr, second.stdout + second.stderr
        assert sum(ready(p) for p in plane.pods(namespace, SERVER)) == 1
    finally:
        for node in ("gpu-a", "gpu-b"):
            plane.kubectl("uncordon", node)
    plane.wait_for(lambda: rolled_out(plane, namespace, 2), 60, "two ready replicas after uncordoning")


def keda_hpa(scaled: dict) -> tuple[dict, str]:
    """The HPA KEDA (2.x) creates for `scaled`, and the external metric name it serves for it."""
    spec, name = scaled["spec"], scaled["metadata"]["name"]
    (trigger,) = spec["triggers"]
    metric = f"s0-{trigger['type']}"
    hpa = {
        "apiVersion": "autoscaling/v2beta2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": f"keda-hpa-{name}", "namespace": scaled["metadata"]["namespace"]},
        "spec": {
            "scaleTargetRef": spec["scaleTargetRef"],
            "minReplicas": spec["minReplicaCount"],
            "maxReplicas": spec["maxReplicaCount"],
            "behavior": spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
            "metrics": [
                {
                    "type": "External",
                    "external": {
                        "metric": {
                            "name": metric,
                            "selector": {"matchLabels": {"scaledobject.keda.sh/name": name}},
                        },
                        "target": {
                            "type": trigger["metricType"],
                            "averageValue": trigger["metadata"]["threshold"],
                        },
                    },
                }
            ],
        },
    }
    return hpa, metric


def test_the_hpa_keda_would_create_scales_up_one_a_period_to_the_cap_and_waits_to_scale_down(
    cluster, namespace
):
    plane, _, metrics = cluster
    # Short periods (the controller syncs each second): a missing policy still jumps or drops at once.
    up, window, down = 4, 8, 2
    slack = 15  # seconds a busy machine may add to a step; a deadline only, never an assertion
    values = {
        **HOST_PATH,
        "gateway": {"enabled": False},
        "autoscaling": {
            "scaleUpPeriodSeconds": up,
            "scaleDownStabilizationSeconds": window,
            "scaleDownPeriodSeconds": down,
        },
    }
    objects = install(plane, values, namespace)
    (scaled,) = [o for o in objects if o["kind"] == "ScaledObject"]
    hpa, metric = keda_hpa(scaled)
    target, cap = (
        float(scaled["spec"]["triggers"][0]["metadata"]["threshold"]),
        scaled["spec"]["maxReplicaCount"],
    )
    metrics.values[metric] = 0.0
    assert plane.apply(hpa, "keda-operator").status_code == 201
    path = (
        f"/apis/autoscaling/v2beta2/namespaces/{namespace}/horizontalpodautoscalers/{hpa['metadata']['name']}"
    )

    def replicas() -> int:
        return deployment(plane, namespace)["spec"]["replicas"]

    plane.wait_for(
        lambda: plane.get(path).get("status", {}).get("currentMetrics"), 60, "the HPA to read the metric"
    )
    assert replicas() == 1
    # Read through the aggregator from the loopback server, by Kubernetes' own HPA controller.
    metric_path = f"/apis/{ExternalMetrics.GROUP}/v1beta1/namespaces/{namespace}/{metric}"
    assert metric_path in metrics.requests
    # Load for 10 replicas: up by one a period, capped at maxReplicas (the GPU pool).
    metrics.values[metric] = target * 10
    steps = [time.monotonic()]
    for count in range(2, cap + 1):
        plane.wait_for(lambda count=count: replicas() >= count, up + slack, f"{count} replicas")
        steps.append(time.monotonic())
        assert replicas() == count
    gaps = [b - a for a, b in zip(steps[1:], steps[2:], strict=False)]
    assert all(gap >= up - 1.5 for gap in gaps), gaps
    plane.wait_for(
        lambda: any(
            c["type"] == "ScalingLimited" and c["status"] == "True"
            for c in plane.get(path)["status"]["conditions"]
        ),
        30,
        "the HPA to report the cap",
    )
    # The policy would allow another step a period after the last; the HPA then decides at its syncs.
    plane.wait_for(
        lambda: time.monotonic() >= steps[-1] + up, up * 2, "a scale-up period after the last step"
    )
    read = metrics.requests.count(metric_path)  # the HPA reads the metric once per sync
    plane.wait_for(
        lambda: metrics.requests.count(metric_path) >= read + 2, 30, "an HPA sync after that period"
    )
    assert replicas() == cap
    # Re-applying the chart (an upgrade) keeps the HPA's count: the Deployment renders no replicas.
    install(plane, values, namespace)
    assert replicas() == cap
    # Load gone: nothing leaves within the stabilization window, then one a period.
    metrics.values[metric] = 0.0
    dropped = time.monotonic()
    plane.wait_for(lambda: replicas() < cap, window + down + slack, "the first scale-down")
    assert time.monotonic() - dropped >= window - 2
    plane.wait_for(
        lambda: replicas() == scaled["spec"]["minReplicaCount"], (down + slack) * cap, "minReplicas"
    )


def test_an_empty_metric_holds_the_replicas_and_says_so(cluster, namespace):
    """ignoreNullValues false: KEDA answers an error for an empty query; the HPA reports it."""
    plane, _, metrics = cluster
    objects = install(plane, {**HOST_PATH, "gateway": {"enabled": False}}, namespace)
    (scaled,) = [o for o in objects if o["kind"] == "ScaledObject"]
    assert scaled["spec"]["triggers"][0]["metadata"]["ignoreNullValues"] == "false"
    hpa, metric = keda_hpa(scaled)
    hpa["metadata"]["name"] = f"keda-hpa-{namespace}"
    metric_name = f"{metric}-{namespace}"
    hpa["spec"]["metrics"][0]["external"]["metric"]["name"] = metric_name
    metrics.values[metric_name] = None
    assert plane.apply(hpa, "keda-operator").status_code == 201
    path = (
        f"/apis/autoscaling/v2beta2/namespaces/{namespace}/horizontalpodautoscalers/{hpa['metadata']['name']}"
    )

    def active() -> dict | None:
        conditions = plane.get(path).get("status", {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == "ScalingActive"), None)

    condition = plane.wait_for(active, 60, "the HPA's ScalingActive condition")
    assert condition["status"] == "False" and condition["reason"] == "FailedGetExternalMetric", condition
    assert deployment(plane, namespace)["spec"]["replicas"] == 1


def gateway_slots(gateway: Gateway, backend: str) -> set[str]:
    """The addresses HAProxy's DNS-filled server slots hold now (its runtime API)."""
    with socket.socket(socket.AF_UNIX) as runtime:
        runtime.connect(str(gateway.config.parent / "haproxy.sock"))
        runtime.sendall(f"show servers state {backend}\n".encode())
        text = b"".join(iter(lambda: runtime.recv(65536), b"")).decode()
    rows = [line.split() for line in text.splitlines()[1:] if line and not line.startswith("#")]
    return {row[4] for row in rows if len(row) > 4 and row[4] not in ("0.0.0.0", "-")}


def test_the_gateway_fills_its_slots_from_the_headless_services_ready_endpoints(
    plane, kubelet, namespace, tmp_path
):
    """The chart's HAProxy config and environment, with the cluster DNS played on loopback."""
    haproxy = shutil.which("haproxy")
    required_tool(haproxy is not None, "haproxy")
    objects = install(
        plane, {**FIXED, **HOST_PATH, "replicaCount": 3, "gateway": {"enabled": True}}, namespace
    )
    plane.wait_for(lambda: rolled_out(plane, namespace, 3), 60, "three ready replicas")
    (config,) = [
        o["data"]["haproxy.cfg"] for o in objects if o["kind"] == "ConfigMap" and "haproxy.cfg" in o["data"]
    ]
    (container,) = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-gateway")
    ][0]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    dns = StandInClusterDns(plane)
    dns.start()
    # The pod's resolv.conf names the cluster DNS; here it is the stand-in's loopback port.
    assert config.count("parse-resolv-conf") == 1
    config = config.replace("parse-resolv-conf", f"nameserver cluster 127.0.0.1:{dns.port}")
    config = config.replace(
        "global\n", f"global\n    stats socket {tmp_path / 'haproxy.sock'} level admin\n", 1
    )
    names = {k: env[k] for k in ("SEMIF_GATEWAY_REPLICAS", "SEMIF_GATEWAY_SLOTS")}
    endpoints = f"/api/v1/namespaces/{namespace}/endpoints/{FULLNAME}-replicas"

    def ready_addresses() -> set[str]:
        subsets = plane.get(endpoints).get("subsets") or []
        return {a["ip"] for s in subsets for a in s.get("addresses", [])}

    try:
        with Gateway([], tmp_path, haproxy=haproxy, config=config, env=names) as gateway:
            serving = ready_addresses()
            assert len(serving) == 3
            for backend in ("by_state", "least_load"):
                plane.wait_for(
                    lambda b=backend: gateway_slots(gateway, b) == serving, 30, f"{backend} to fill 3 slots"
                )
            held = plane.pods(namespace, SERVER)[0]
            kubelet.held.add(held["metadata"]["name"])
            plane.wait_for(lambda: len(ready_addresses()) == 2, 30, "the endpoints to drop the unready pod")
            plane.wait_for(
                lambda: gateway_slots(gateway, "by_state") == ready_addresses(), 30, "the gateway to drop it"
            )
            plane.wait_for(
                lambda: gateway_slots(gateway, "least_load") == ready_addresses(), 30, "least_load to drop it"
            )
            assert held["status"]["podIP"] not in gateway_slots(gateway, "least_load")
    finally:
        kubelet.held.clear()
        dns.stop()
