"""Renders the kustomizations of deploy/kubernetes when no `kustomize` binary is at hand.

Only what those files use: `resources` (files and directories), `namespace`, `labels` (with
`includeTemplates`), `configMapGenerator` with `files` (hash suffix disabled), and `patches` given as
strategic-merge files (maps merge; lists of maps merge by `name`; other lists are replaced). Any other
field is an error, so a new kustomize feature in the manifests cannot be silently ignored here.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {
    "apiVersion",
    "kind",
    "resources",
    "namespace",
    "labels",
    "configMapGenerator",
    "generatorOptions",
    "patches",
}
CLUSTER_SCOPED = {"Namespace", "DeviceClass", "ClusterRole", "ClusterRoleBinding"}


def inside(directory: Path, rel: str) -> Path:
    """A file the kustomization reads, refused outside its directory (kustomize's default
    `--load-restrictor LoadRestrictionsRootOnly`; other kustomizations' directories are resources)."""
    path = (directory / rel).resolve()
    if not path.is_relative_to(directory.resolve()):
        raise ValueError(f"{directory}/kustomization.yaml: {rel} is outside the kustomization's directory")
    return path


def build(directory: Path) -> list[dict[str, Any]]:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - SUPPORTED
    if unknown:
        raise ValueError(
            f"{directory}/kustomization.yaml: fields this renderer does not know: {sorted(unknown)}"
        )
    if k.get("configMapGenerator") and not k.get("generatorOptions", {}).get("disableNameSuffixHash"):
        raise ValueError(f"{directory}: hashed generator names are not rendered here")
    out: list[dict[str, Any]] = []
    for res in k.get("resources", []):
        path = (directory / res).resolve()
        if path.is_dir():
            out += build(path)
        else:
            out += [d for d in yaml.safe_load_all(inside(directory, res).read_text()) if d]
    for gen in k.get("configMapGenerator", []):
        data = {}
        for item in gen["files"]:
            key, _, rel = item.partition("=") if "=" in item else (Path(item).name, "", item)
            data[key] = inside(directory, rel).read_text()
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    for patch in k.get("patches", []):
        p = yaml.safe_load(inside(directory, patch["path"]).read_text())
        (target,) = [
            d for d in out if d["kind"] == p["kind"] and d["metadata"]["name"] == p["metadata"]["name"]
        ]
        merged = merge(target, p)
        target.clear()
        target.update(merged)
    for entry in k.get("labels", []):
        for d in out:
            d["metadata"].setdefault("labels", {}).update(entry["pairs"])
            if entry.get("includeTemplates") and "template" in d.get("spec", {}):
                d["spec"]["template"].setdefault("metadata", {}).setdefault("labels", {}).update(
                    entry["pairs"]
                )
    if "namespace" in k:
        for d in out:
            if d["kind"] not in CLUSTER_SCOPED:
                d["metadata"]["namespace"] = k["namespace"]
    return out


def merge(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            out[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(x, dict) and "name" in x for x in base + patch)
    ):
        out = copy.deepcopy(base)
        for item in patch:
            same = [i for i, x in enumerate(out) if x["name"] == item["name"]]
            if same:
                out[same[0]] = merge(out[same[0]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)
