"""The DR manifest: an engine may start only where all three files are present with matching checksums."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from config.manifest import ArtifactKind, ManifestError, ManifestSpec, check_engine, manifest_of, refusal

FILES = {ArtifactKind.WEIGHTS: "model.safetensors", ArtifactKind.TOKENIZER: "tokenizer.json",
         ArtifactKind.QUANT_CONFIG: "quant_config.json"}


def region(root: Path, skip: str | None = None, tamper: str | None = None) -> Path:
    root.mkdir(parents=True)
    for f in FILES.values():
        if f != skip:
            (root / f).write_bytes(b"changed" if f == tamper else f.encode() * 100)
    return root


def test_complete_region_passes_and_missing_file_is_named(tmp_path: Path) -> None:
    good = region(tmp_path / "us")
    m = manifest_of("llama-3.1-8b", good, FILES)
    spec = ManifestSpec(models=[m], roots={"us-east-1": str(good), "eu-west-1": str(region(tmp_path / "eu",
                                                                                            skip="tokenizer.json"))})
    check_engine(spec, "llama-3.1-8b", "us-east-1")
    with pytest.raises(ManifestError) as e:
        check_engine(spec, "llama-3.1-8b", "eu-west-1")
    assert e.value.problems == [("tokenizer", "tokenizer.json", f"missing from {tmp_path / 'eu'}")]
    assert "tokenizer.json" in str(e.value) and "eu-west-1" in str(e.value)


def test_checksum_mismatch_and_unknown_region_refuse(tmp_path: Path) -> None:
    good = region(tmp_path / "us")
    m = manifest_of("m", good, FILES)
    spec = ManifestSpec(models=[m], roots={"us": str(good), "ap": str(region(tmp_path / "ap",
                                                                           tamper="quant_config.json"))})
    why = refusal(spec, "m", "ap")
    assert why is not None and "quant_config file 'quant_config.json' checksum mismatch" in why
    why = refusal(spec, "m", "sa-east-1")
    assert why is not None and "no artifact folder for region 'sa-east-1'" in why
    assert refusal(spec, "another-model", "sa-east-1") is None  # no manifest for that model: nothing to check
    assert refusal(None, "m", "ap") is None


def test_manifest_needs_all_three_files_and_relative_paths() -> None:
    digest = "0" * 64
    with pytest.raises(ValidationError, match="lacks quant_config"):
        ManifestSpec.model_validate({"models": [{"model": "m", "artifacts": {
            "weights": {"path": "w", "sha256": digest}, "tokenizer": {"path": "t", "sha256": digest}}}], "roots": {}})
    with pytest.raises(ValidationError, match="relative path"):
        ManifestSpec.model_validate({"models": [{"model": "m", "artifacts": {
            k: {"path": "../w" if k == "weights" else k, "sha256": digest} for k in FILES}}], "roots": {}})
