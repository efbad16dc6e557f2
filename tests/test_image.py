"""The image and the package metadata, checked without a Docker engine (CI has none): the
Dockerfile is parsed and its properties asserted (multi-stage, pinned base, dependencies
from the hashed lock file with the PostgreSQL driver, no pip or setuptools at run time, a
non-root default user, OCI labels, a HEALTHCHECK); the lock agrees with pyproject.toml;
pyproject declares a license, classifiers, URLs and every package memfuse imports."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), " ".join(rest.split())))
        buf = ""
    assert not buf, "dangling continuation"
    return out


def _stages() -> tuple[dict[str, str], list[list[tuple[str, str]]]]:
    ins = _instructions((ROOT / "Dockerfile").read_text())
    args: dict[str, str] = {}
    stages: list[list[tuple[str, str]]] = []
    for word, rest in ins:
        if word == "FROM":
            stages.append([])
        if not stages:
            assert word == "ARG", word
            name, _, default = rest.partition("=")
            args[name] = default
            continue
        stages[-1].append((word, rest))
    return args, stages


def _resolve(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], text)


def test_multi_stage_on_a_pinned_base():
    args, stages = _stages()
    assert len(stages) >= 2
    froms = [_resolve(s[0][1], args) for s in stages]
    assert froms[0].endswith(" AS build") and " AS " not in froms[-1]
    for f in froms:
        image = f.split()[0]
        name, _, tag = image.partition(":")
        assert tag and tag != "latest" and re.match(r"\d+\.\d+", tag), f"unpinned base {image}"
    assert froms[0].split()[0] == froms[-1].split()[0]  # the venv's python is the runtime's


def test_dependencies_come_from_the_hashed_lock_with_postgres():
    _, stages = _stages()
    build = " ".join(f"{w} {r}" for w, r in stages[0])
    assert "COPY requirements.lock" in build and "--require-hashes" in build and "-r requirements.lock" in build
    assert "pip install --no-cache-dir --disable-pip-version-check --no-deps ." in build
    lock = (ROOT / "requirements.lock").read_text()
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^\s\\]+)", lock, re.M))
    pins = {canonicalize_name(k): v for k, v in pins.items()}
    blocks = re.split(r"\n(?=[A-Za-z0-9])", lock.split("\n", 6)[-1])
    for block in blocks:
        if "==" in block:
            assert "--hash=sha256:" in block, block.splitlines()[0]
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in meta["dependencies"] + meta["optional-dependencies"]["postgres"]]
    for req in wanted:  # the lock satisfies pyproject: regenerate it when this fails
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} missing from requirements.lock"
        assert req.specifier.contains(pins[name], prereleases=True), (req, pins[name])
    assert "psycopg-binary" in pins and "psycopg" in pins


def test_runtime_stage_has_no_installer_and_runs_non_root():
    args, stages = _stages()
    build = " ".join(f"{w} {r}" for w, r in stages[0])
    assert "pip uninstall -y pip setuptools wheel" in build
    final = stages[-1]
    text = " ".join(f"{w} {r}" for w, r in final)
    assert "pip install" not in text and "python3-pip" not in text and "python3-setuptools" not in text
    assert "COPY --from=build /opt/memfuse /opt/memfuse" in text
    users = [rest for word, rest in final if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert "useradd --system --uid 10001" in text
    envs = " ".join(rest for word, rest in final if word == "ENV")
    assert "0.0.0.0" not in envs and "ADMIN_LISTEN" not in envs  # the admin API is not opened by the image


def test_oci_labels_and_healthcheck():
    args, stages = _stages()
    final = stages[-1]
    labels = " ".join(rest for word, rest in final if word == "LABEL")
    for key in ("title", "description", "version", "revision", "created", "licenses", "source"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    assert 'org.opencontainers.image.licenses="Apache-2.0"' in labels
    # no made-up address: the source label is the SOURCE_URL build argument, empty by default
    assert 'org.opencontainers.image.source="${SOURCE_URL}"' in labels
    assert "SOURCE_URL=" in [rest for word, rest in final if word == "ARG"]
    assert "github.com" not in labels
    (health,) = [rest for word, rest in final if word == "HEALTHCHECK"]
    assert "--timeout=" in health and " CMD " in f" {health}" and "/healthz" in health
    assert [rest for word, rest in final if word == "ENTRYPOINT"] == ['["memfuse"]']


def test_build_script_and_manifest_tag_agree_with_the_version():
    script = ROOT / "scripts" / "build-image"
    assert script.stat().st_mode & 0o111
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "docker build" in text and "buildah bud" in text
    assert '--build-arg "SOURCE_URL=${SOURCE_URL:-}"' in text
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    kust = (ROOT / "deploy" / "kubernetes" / "base" / "kustomization.yaml").read_text()
    assert re.search(rf"newTag: {re.escape(version)}\b", kust)


def test_pyproject_metadata_is_complete():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["license"] == "Apache-2.0" and meta["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    # no invented project URLs: there is no published home to point at
    assert "urls" not in meta
    assert any(c.startswith("Topic :: System :: Filesystems") for c in meta["classifiers"])
    assert any(c.startswith("Programming Language :: Python :: 3.11") for c in meta["classifiers"])


def test_every_directly_imported_package_is_declared():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {canonicalize_name(Requirement(r).name) for r in meta["dependencies"]}
    declared |= {canonicalize_name(Requirement(r).name) for extra in meta["optional-dependencies"].values()
                 for r in extra}
    dists = packages_distributions()
    missing = set()
    for path in (ROOT / "memfuse").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for mod in mods:
                top = mod.split(".")[0]
                if top in sys.stdlib_module_names or top == "memfuse":
                    continue
                names = {canonicalize_name(d) for d in dists.get(top, [top])}
                if not names & declared:
                    missing.add(f"{top} ({path.relative_to(ROOT)})")
    assert not missing, sorted(missing)
