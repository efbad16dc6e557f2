"""The Kubernetes manifests (``deploy/kubernetes/base`` and its ``examples`` overlay), rendered
and checked: against the Kubernetes schemas of 1.29 and the newest version
``kubernetes-validate`` knows (``--strict``, schemas bundled: no network), and for what a
schema cannot see: fieldRefs that resolve, probe ports that exist, requests and limits
everywhere, size limits on every emptyDir, one image tag, least privilege, an admin port that
no one can use to change mounts, a control plane that survives rolling updates."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from k8sutil import containers, pod_labels, pod_spec, render

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
TREES = {"base": DEPLOY / "base", "examples": DEPLOY / "examples"}
OLDEST = "1.29.0"  # native sidecars (init containers with restartPolicy: Always) need 1.29
SIDECAR = "memfuse"


@pytest.fixture(scope="module", params=sorted(TREES))
def tree(request) -> tuple[str, list[dict]]:
    return request.param, render(TREES[request.param])


def _workloads(objs: list[dict]) -> list[dict]:
    return [o for o in objs if pod_spec(o) is not None]


def _find(objs: list[dict], kind: str, name: str) -> dict:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, (kind, name, len(hits))
    return hits[0]


def _args(c: dict) -> list[str]:
    return [*c.get("command", []), *c.get("args", [])]


def _flag(c: dict, name: str) -> str | None:
    args = _args(c)
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a[len(name) + 1:]
    return None


def _quantity(q: str | int) -> float:
    """A Kubernetes quantity in bytes (memory, storage) or cores (cpu)."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "m": 1e-3}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    assert m, q
    return float(m.group(1)) * units.get(m.group(2), 1)


# ---------------------------------------------------------------- rendering and schemas


def test_our_rendering_matches_kubectl_kustomize():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the renderer is checked where it is")
    for name, path in TREES.items():
        out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        theirs = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out.stdout) if o}
        ours = {(o["kind"], o["metadata"]["name"]): o for o in render(path)}
        assert ours == theirs, name


def test_every_rendered_manifest_passes_kubernetes_validate_strict(tree, tmp_path):
    import kubernetes_validate

    name, objs = tree
    newest = kubernetes_validate.latest_version()
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all(objs, sort_keys=False))
    for version in (OLDEST, newest):
        # the command line, as a user runs it; its schemas ship in the package
        p = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet",
                            "-k", version, str(path)], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, (version, p.stdout[-3000:], p.stderr[-2000:])
        for obj in objs:  # and the API, object by object, so a failure names the object
            kubernetes_validate.validate(obj, version, strict=True)
    assert len(objs) >= 6


def test_the_schema_check_is_not_a_rubber_stamp():
    import kubernetes_validate

    objs = render(TREES["base"])
    bad = yaml.safe_load(yaml.safe_dump(_find(objs, "Deployment", "agent")))
    bad["spec"]["template"]["spec"]["initContainers"][0]["restartPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, OLDEST, strict=True)


# ---------------------------------------------------------------- what a schema cannot see


def test_every_fieldref_label_or_annotation_is_set_by_the_same_manifest(tree):
    _, objs = tree
    seen = 0
    for w in _workloads(objs):
        meta = w["metadata"] if w["kind"] == "Pod" else w["spec"]["template"]["metadata"]
        for c in containers(pod_spec(w)):
            for env in c.get("env", []):
                path = ((env.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath", "")
                m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
                if m:
                    seen += 1
                    value = meta.get(m.group(1), {}).get(m.group(2))
                    assert value, f"{w['metadata']['name']}/{c['name']}: {path} is not set on the pod"
    assert seen >= 1


def test_every_probe_port_is_a_declared_container_port(tree):
    _, objs = tree
    probes = 0
    for w in _workloads(objs):
        for c in containers(pod_spec(w)):
            declared = {p["containerPort"] for p in c.get("ports", [])} | {p.get("name") for p in c.get("ports", [])}
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if not probe:
                    continue
                handler = probe.get("httpGet") or probe.get("tcpSocket") or probe.get("grpc")
                if handler is None:
                    assert "exec" in probe
                    continue
                probes += 1
                assert handler["port"] in declared, (w["metadata"]["name"], c["name"], kind, handler["port"])
    assert probes >= 5


def test_every_container_has_requests_and_limits(tree):
    _, objs = tree
    for w in _workloads(objs):
        for c in containers(pod_spec(w)):
            res = c.get("resources", {})
            for part in ("requests", "limits"):
                for what in ("cpu", "memory"):
                    assert what in res.get(part, {}), (w["metadata"]["name"], c["name"], part, what)
                assert _quantity(res["requests"]["memory"]) <= _quantity(res["limits"]["memory"])
                assert _quantity(res["requests"]["cpu"]) <= _quantity(res["limits"]["cpu"])


def test_every_emptydir_has_a_size_limit(tree):
    _, objs = tree
    n = 0
    for w in _workloads(objs):
        for v in pod_spec(w).get("volumes", []):
            if "emptyDir" in v:
                n += 1
                assert (v["emptyDir"] or {}).get("sizeLimit"), (w["metadata"]["name"], v["name"])
    assert n >= 4


def test_memfuse_images_share_one_tag_and_none_floats(tree):
    _, objs = tree
    memfuse, others = set(), set()
    for w in _workloads(objs):
        for c in containers(pod_spec(w)):
            image = c["image"]
            name, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "")
            assert tag and tag != "latest", f"{c['name']}: image {image} has no fixed tag"
            (memfuse if name.split("/")[-1] == "memfuse" else others).add(image)
    assert len(memfuse) == 1, memfuse


def test_the_admin_port_is_not_reachable_for_mutations(tree):
    """The sidecar's TCP admin API has no admin token (so it refuses every mount change),
    and no NetworkPolicy rule lets anything reach that port (the kubelet always can)."""
    _, objs = tree
    agent = _find(objs, "Deployment", "agent")
    sidecar = next(c for c in pod_spec(agent)["initContainers"] if c["name"] == SIDECAR)
    listen = _flag(sidecar, "--admin-listen")
    port = int(listen.rpartition(":")[2])
    assert _flag(sidecar, "--admin-token-file") is None
    assert not any(e["name"] in ("MEMFUSE_ADMIN_TOKEN_FILE", "MEMFUSE_SIDECAR_ADMIN_TOKEN_FILE")
               for e in sidecar.get("env", []))
    port_names = {p["name"] for p in sidecar["ports"] if p["containerPort"] == port}
    labels = pod_labels(agent)
    policies = [p for p in objs if p["kind"] == "NetworkPolicy"
                and all(labels.get(k) == v for k, v in p["spec"]["podSelector"].get("matchLabels", {}).items())
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    assert policies, "no NetworkPolicy isolates the agent pods"
    for pol in policies:
        for rule in pol["spec"].get("ingress", []):
            ports = rule.get("ports")
            assert ports, f"{pol['metadata']['name']}: an ingress rule without ports opens 9464 too"
            for p in ports:
                assert p.get("port") not in {port, *port_names}, pol["metadata"]["name"]
                assert not (p.get("endPort") and p["port"] <= port <= p["endPort"])


def test_sidecar_pod_settings(tree):
    _, objs = tree
    agent = _find(objs, "Deployment", "agent")
    pod = pod_spec(agent)
    sidecar = next(c for c in pod["initContainers"] if c["name"] == SIDECAR)
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar
    assert _args(sidecar)[0] == "mount"
    assert sidecar["startupProbe"]["httpGet"]["path"] == "/readyz"
    live = sidecar["livenessProbe"]
    assert live["httpGet"]["path"] == "/healthz"
    # a busy FUSE loop may answer late: never fewer than 10 s per try and a minute in all
    assert live["timeoutSeconds"] >= 10 and live["periodSeconds"] * live["failureThreshold"] >= 60
    # the grace period covers the sidecar's drain plus its unmount
    drain = float(_flag(sidecar, "--drain-timeout") or 20)
    assert pod["terminationGracePeriodSeconds"] >= drain + 10
    # the workspace comes from a label this pod template sets: never empty
    assert _flag(sidecar, "--workspace") == "$(MEMFUSE_WORKSPACE)"
    assert pod_labels(agent)["memfuse.io/workspace"]
    mounts = {m["name"]: m for m in sidecar["volumeMounts"]}
    assert mounts["memory"]["mountPropagation"] == "Bidirectional"
    agent_c = next(c for c in pod["containers"] if c["name"] == "agent")
    assert {m["name"]: m for m in agent_c["volumeMounts"]}["memory"]["mountPropagation"] == "HostToContainer"
    # the cache emptyDir holds the attached stores: sizeLimit from the documented formula
    # (docs/DEPLOY.md "Sizing"), for the two default-limit stores the manifest is sized for
    cache = next(v for v in pod["volumes"] if v["name"] == "memfuse-cache")
    stores = [(64 * 2**20, 10_000)] * 2
    need = sum(2.2 * b + 1.5 * 2**10 * n for b, n in stores) + 64 * 2**20
    assert _quantity(cache["emptyDir"]["sizeLimit"]) >= need
    # the kubelet measures the memory volume through the FUSE mount on it: the stores' bytes
    memory = next(v for v in pod["volumes"] if v["name"] == "memory")
    assert _quantity(memory["emptyDir"]["sizeLimit"]) >= sum(b for b, _ in stores)
    # memory: 64 MiB + 4 MiB per 1,000 records + twice the largest store (a snapshot at load)
    need = 64 * 2**20 + 4 * 2**20 * sum(n for _, n in stores) / 1000 + 2 * max(b for b, _ in stores)
    assert _quantity(sidecar["resources"]["limits"]["memory"]) >= need


def test_least_privilege(tree):
    """Only the memfuse sidecar is privileged (it says why); every other container runs
    non-root without privilege escalation or capabilities, on a read-only root filesystem;
    no pod mounts a service-account token; seccomp RuntimeDefault at pod level."""
    _, objs = tree
    text = " ".join((TREES["base"] / "agent.yaml").read_text().split())
    assert re.search(r"# mount\(2\) of FUSE, and mountPropagation: Bidirectional .* need a privileged "
                     r"container: .* Pod Security Admission .* privileged: true", text)
    for w in _workloads(objs):
        pod = pod_spec(w)
        assert pod.get("automountServiceAccountToken") is False, w["metadata"]["name"]
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for c in containers(pod):
            sc = c.get("securityContext", {})
            assert sc.get("readOnlyRootFilesystem") is True, c["name"]
            if c["name"] == SIDECAR:
                assert sc.get("privileged") is True
                continue
            assert not sc.get("privileged")
            non_root = sc.get("runAsNonRoot", pod["securityContext"].get("runAsNonRoot"))
            assert non_root is True, (w["metadata"]["name"], c["name"])
            assert sc.get("allowPrivilegeEscalation") is False, c["name"]
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], c["name"]
            assert not sc.get("capabilities", {}).get("add"), c["name"]


def test_control_plane_is_safe_to_roll_and_meets_restricted(tree):
    _, objs = tree
    cp = _find(objs, "Deployment", "memfuse-control-plane")
    pod = pod_spec(cp)
    assert cp["spec"]["replicas"] >= 2
    assert cp["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    # stateless: no PersistentVolumeClaim, nothing two replicas would have to share
    assert all(set(v) & {"secret", "emptyDir"} for v in pod["volumes"]), pod["volumes"]
    migrate = next(c for c in pod["initContainers"] if c["name"] == "migrate")
    assert _args(migrate)[:2] == ["db", "upgrade"]
    serve = next(c for c in pod["containers"] if c["name"] == "serve")
    assert _args(serve)[0] == "serve" and "--migrate" not in _args(serve)
    assert serve["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert serve["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for c in (migrate, serve):
        env = {e["name"]: e for e in c["env"]}
        assert env["MEMFUSE_DB"]["valueFrom"]["secretKeyRef"] == {"name": "memfuse-db", "key": "url"}
    # Pod Security Standard "restricted"
    psc = pod["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0
    assert psc["seccompProfile"]["type"] == "RuntimeDefault"
    labels = pod_labels(cp)
    pdb = [o for o in objs if o["kind"] == "PodDisruptionBudget"
           and o["spec"]["selector"]["matchLabels"].items() <= labels.items()]
    assert len(pdb) == 1 and pdb[0]["spec"]["minAvailable"] == 1
    svc = _find(objs, "Service", "memfuse-control-plane")
    assert svc["spec"]["selector"].items() <= labels.items()
    # the sidecar's control-plane URL names that Service and its port
    sidecar = next(c for c in pod_spec(_find(objs, "Deployment", "agent"))["initContainers"]
                   if c["name"] == SIDECAR)
    port = svc["spec"]["ports"][0]["port"]
    assert _flag(sidecar, "--control-plane") == f"http://memfuse-control-plane:{port}"
    # only agent pods reach it
    pol = _find(objs, "NetworkPolicy", "memfuse-control-plane")
    assert pol["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    (rule,) = pol["spec"]["ingress"]
    assert [f["podSelector"]["matchLabels"] for f in rule["from"]] == [{"memfuse.io/agent": "true"}]
    assert pod_labels(_find(objs, "Deployment", "agent"))["memfuse.io/agent"] == "true"


def test_every_secret_is_referenced_by_name_and_documented(tree):
    _, objs = tree
    names: set[str] = set()
    for w in _workloads(objs):
        pod = pod_spec(w)
        names |= {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
        for c in containers(pod):
            names |= {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
                      if "secretKeyRef" in (e.get("valueFrom") or {})}
    assert not [o for o in objs if o["kind"] == "Secret"]  # never a secret in the repository
    docs = (ROOT / "docs" / "DEPLOY.md").read_text()
    for n in names:
        assert re.search(rf"kubectl (-n \S+ )?create secret generic {n}\b", docs), n


def test_examples_postgres_is_marked_not_for_production():
    text = (TREES["examples"] / "postgres.yaml").read_text()
    assert text.startswith("# NOT FOR PRODUCTION")
    objs = render(TREES["examples"])
    assert _find(objs, "StatefulSet", "memfuse-postgres")
    assert pod_labels(_find(objs, "Deployment", "agent"))["memfuse.io/workspace"] == "example"
    ns = _find(objs, "Namespace", "memfuse-example")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"} == {"memfuse-example"}
