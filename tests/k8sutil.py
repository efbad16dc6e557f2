"""Render the Kustomize trees under ``deploy/kubernetes/`` without kustomize.

Only what those trees use is supported, and anything else is an error (so a manifest change
that needs more fails the tests instead of rendering wrong): ``resources`` (YAML files and
directories with a ``kustomization.yaml``), ``namespace``, ``images`` (``name`` → ``newName``
/ ``newTag``), and ``patches`` whose ``patch`` is an RFC 6902 JSON Patch list (``add``,
``replace``, ``remove``) with a ``target`` naming ``kind`` and ``name``. Where ``kubectl``
is installed, tests compare this rendering with ``kubectl kustomize``.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}
# kinds whose objects live in a namespace (the ones our trees use)
NAMESPACED = {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "NetworkPolicy",
              "Job", "ConfigMap", "Secret", "ServiceAccount"}


class Unsupported(Exception):
    """The kustomization uses something this renderer does not do."""


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kustomize build directory`` gives, in resource order."""
    directory = Path(directory)
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    extra = set(k) - SUPPORTED
    if extra:
        raise Unsupported(f"{directory}: kustomization fields not supported here: {sorted(extra)}")
    objs: list[dict[str, Any]] = []
    for res in k.get("resources", []):
        path = (directory / res).resolve()
        if path.is_dir():
            objs += render(path)
        else:
            objs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in k.get("patches", []):
        _apply_patch(objs, patch, directory)
    for img in k.get("images", []):
        for pod in (pod_spec(o) for o in objs):
            if pod is None:
                continue
            for c in containers(pod):
                name, _, tag = c["image"].partition(":")
                if name == img["name"]:
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag)}"
    ns = k.get("namespace")
    if ns:
        for o in objs:
            if o["kind"] in NAMESPACED:
                o.setdefault("metadata", {})["namespace"] = ns
            elif o["kind"] != "Namespace":
                raise Unsupported(f"namespace for kind {o['kind']}")
    return objs


def _apply_patch(objs: list[dict], patch: dict, directory: Path) -> None:
    target = patch.get("target") or {}
    if set(patch) - {"target", "patch"} or not target.get("kind") or not target.get("name"):
        raise Unsupported(f"{directory}: only inline JSON patches with target kind and name")
    ops = yaml.safe_load(patch["patch"])
    if not isinstance(ops, list):
        raise Unsupported(f"{directory}: only RFC 6902 JSON patches (a list of operations)")
    hits = [o for o in objs if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
    if len(hits) != 1:
        raise Unsupported(f"{directory}: patch target {target} matches {len(hits)} objects")
    for op in ops:
        _json_patch(hits[0], op)


def _json_patch(doc: dict, op: dict) -> None:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    parent = doc
    for p in parts[:-1]:
        parent = parent[int(p)] if isinstance(parent, list) else parent[p]
    last = parts[-1]
    if op["op"] in ("add", "replace"):
        if op["op"] == "replace" and last not in parent:
            raise KeyError(f"replace of a missing member: {op['path']}")
        if isinstance(parent, list):
            idx = len(parent) if last == "-" else int(last)
            parent.insert(idx, copy.deepcopy(op["value"])) if op["op"] == "add" else parent.__setitem__(idx, op["value"])
        else:
            parent[last] = copy.deepcopy(op["value"])
    elif op["op"] == "remove":
        del parent[int(last) if isinstance(parent, list) else last]
    else:
        raise Unsupported(f"JSON patch op {op['op']}")


def pod_spec(obj: dict) -> dict | None:
    """The pod spec of a workload object (Pod, Deployment, StatefulSet, Job), or None."""
    if obj["kind"] == "Pod":
        return obj["spec"]
    if obj["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet", "ReplicaSet"):
        return obj["spec"]["template"]["spec"]
    return None


def pod_labels(obj: dict) -> dict:
    """The labels a workload's pods carry."""
    if obj["kind"] == "Pod":
        return obj["metadata"].get("labels", {})
    return obj["spec"]["template"]["metadata"].get("labels", {})


def containers(pod: dict) -> list[dict]:
    """Init containers (sidecars included) and containers of a pod spec."""
    return [*pod.get("initContainers", []), *pod.get("containers", [])]
