"""The DR manifest: what a model's deployment needs in every region, with checksums.

A model's deployable artifact is three files: the weights, the tokenizer and the quantization config
(the lessons card's troubleshooting table: a replica that refuses to start after a failover lacks its
tokenizer or its quantization config). ``ModelManifest`` names each file (a path relative to a region's
artifact folder) with its SHA-256; ``ManifestSpec`` (``ClusterSpec.manifest``) gives the artifact folder
of each region.

Invariant: an engine starts only when every one of the three files is present in its region's folder and
its checksum matches (``check_region``). Otherwise it does not start: ``ManifestError`` names every
missing or mismatching file, and the launcher leaves the engine out of the router's view (the router
routes around it). A region with no folder in the spec fails the same way, naming the region.

The checksums are SHA-256 (``hashlib.file_digest``): the digest a model registry publishes, so a
manifest can be written from the registry's listing without reading the files again.
"""

from __future__ import annotations

import hashlib
from enum import StrEnum
from pathlib import Path, PurePosixPath

from pydantic import Field, field_validator, model_validator

from config.base import Frozen, Name


class ArtifactKind(StrEnum):
    WEIGHTS = "weights"
    TOKENIZER = "tokenizer"
    QUANT_CONFIG = "quant_config"


class ManifestError(RuntimeError):
    """An engine's region lacks a file of the manifest, or holds one whose checksum differs.

    ``problems``: one ``(artifact kind, file, reason)`` per defect."""

    def __init__(self, model: str, region: str, problems: list[tuple[str, str, str]]) -> None:
        self.model = model
        self.region = region
        self.problems = problems
        parts = "; ".join(f"{kind} file {path!r} {why}" for kind, path, why in problems)
        super().__init__(f"engine for model {model!r} not started in region {region!r}: {parts} "
                         "(copy the manifest's files into the region's artifact folder)")


class ArtifactSpec(Frozen):
    path: str = Field(min_length=1)
    """Relative to the region's artifact folder."""
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @field_validator("path")
    @classmethod
    def _relative(cls, v: str) -> str:
        p = PurePosixPath(v)
        if p.is_absolute() or ".." in p.parts:
            raise ValueError("must be a relative path inside the artifact folder (no '..')")
        return v


class ModelManifest(Frozen):
    """The three files of one model's deployment, each with its checksum."""

    model: Name
    artifacts: dict[ArtifactKind, ArtifactSpec]

    @model_validator(mode="after")
    def _all_three(self) -> ModelManifest:
        missing = [k.value for k in ArtifactKind if k not in self.artifacts]
        if missing:
            raise ValueError(f"manifest of {self.model!r} lacks {', '.join(missing)} (a deployment needs all three)")
        return self


class ManifestSpec(Frozen):
    """``ClusterSpec.manifest``: the models' manifests and each region's artifact folder."""

    models: list[ModelManifest] = Field(min_length=1)
    roots: dict[Name, str]
    """Region name -> artifact folder (on the host that runs the region's engines)."""

    def for_model(self, model: str) -> ModelManifest | None:
        return next((m for m in self.models if m.model == model), None)


def sha256_of(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_region(manifest: ModelManifest, region: str, root: Path | None) -> None:
    """Raise ``ManifestError`` unless every file of ``manifest`` is in ``root`` with its checksum."""
    if root is None:
        raise ManifestError(manifest.model, region, [(k.value, a.path, f"has no artifact folder for region {region!r}")
                                                     for k, a in manifest.artifacts.items()])
    problems: list[tuple[str, str, str]] = []
    for kind in ArtifactKind:
        art = manifest.artifacts[kind]
        p = root / art.path
        if not p.is_file():
            problems.append((kind.value, art.path, f"missing from {root}"))
        elif (got := sha256_of(p)) != art.sha256:
            problems.append((kind.value, art.path, f"checksum mismatch (sha256 {got[:12]}..., manifest "
                                                   f"{art.sha256[:12]}...)"))
    if problems:
        raise ManifestError(manifest.model, region, problems)


def check_engine(spec: ManifestSpec | None, model: str, region: str) -> None:
    """The engine start check: nothing to check without a manifest for ``model``."""
    if spec is None or (m := spec.for_model(model)) is None:
        return
    root = spec.roots.get(region)
    check_region(m, region, Path(root) if root is not None else None)


def refusal(spec: ManifestSpec | None, model: str, region: str) -> str | None:
    """Why an engine of ``model`` may not start in ``region`` (``check_engine``'s error), or None."""
    try:
        check_engine(spec, model, region)
    except ManifestError as e:
        return str(e)
    return None


def manifest_of(model: str, root: Path, files: dict[ArtifactKind, str]) -> ModelManifest:
    """A manifest from the files as they are in ``root`` (the region a deployment was validated in)."""
    return ModelManifest(model=model, artifacts={k: ArtifactSpec(path=f, sha256=sha256_of(root / f))
                                                 for k, f in files.items()})
