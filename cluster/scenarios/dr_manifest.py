"""``dr-manifest``: a failover replica that lacks its tokenizer or quantization config must not start.

Three regions' artifact folders are written from one validated deployment (``config.manifest``): the
us-east-1 folder complete, eu-west-1 without its tokenizer, ap-south-1 with a quantization config whose
bytes changed. The engine start check (``check_engine``, the same call ``GpuWorker.start`` makes) is run
for each region. On a live cluster the refused engine is left out of the router's view and its region's
requests are served elsewhere: ``tests/integration/test_manifest.py`` launches that case.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from cluster.scenarios import Claim, Finding, Scenario, ScenarioContext, ScenarioResult, Verdict, register_scenario
from config.manifest import ArtifactKind, ManifestSpec, manifest_of, refusal

CLAIM_REFUSE = Claim("dr-three-files", "Replica refuses to start after failover | No tokenizer or quantization config "
                     "| Three-file DR manifest", "lessons-card.md", "Troubleshooting")
CLAIM_32 = Claim("dr-32-percent", "What breaks DR in 32% of cases? Missing tokenizer or quantization configs.",
                 "lessons-card.md", "Q&A")
FILES = {ArtifactKind.WEIGHTS: "model.safetensors", ArtifactKind.TOKENIZER: "tokenizer.json",
         ArtifactKind.QUANT_CONFIG: "quant_config.json"}
MODEL = "llama-3.1-70b-fp8"


def run(ctx: ScenarioContext) -> ScenarioResult:
    with tempfile.TemporaryDirectory(prefix="kvmesh-dr-") as tmp:
        roots = {r: Path(tmp) / r for r in ("us-east-1", "eu-west-1", "ap-south-1")}
        for region, root in roots.items():
            root.mkdir()
            for kind, name in FILES.items():
                if region == "eu-west-1" and kind is ArtifactKind.TOKENIZER:
                    continue
                body = f"{kind.value} of {MODEL}".encode() * 1024
                (root / name).write_bytes(body + (b"!" if region == "ap-south-1" and
                                                   kind is ArtifactKind.QUANT_CONFIG else b""))
        spec = ManifestSpec(models=[manifest_of(MODEL, roots["us-east-1"], FILES)],
                            roots={r: str(p) for r, p in roots.items()})
        outcome = {r: refusal(spec, MODEL, r) for r in roots}
    started = [r for r, why in outcome.items() if why is None]
    refused = {r: why for r, why in outcome.items() if why is not None}
    named = all(("tokenizer.json" in why) if r == "eu-west-1" else ("quant_config.json" in why)
                for r, why in refused.items())
    fig = (f"starts in {', '.join(started)}; refused in " + "; ".join(
        f"{r} ({'tokenizer missing' if 'tokenizer' in why else 'quantization config checksum mismatch'})"
        for r, why in refused.items()))
    f1 = Finding(CLAIM_REFUSE, fig, Verdict.HOLDS if started == ["us-east-1"] and named else Verdict.BREAKS,
                 "with the manifest, a region missing a file is refused at start with the file named (and the router "
                 "routes around it) instead of failing when traffic fails over; without a manifest kvmesh starts the "
                 "engine anyway, as the card's failing replicas did")
    f2 = Finding(CLAIM_32, "not emulated: a share of real incidents", Verdict.NOT_RUN,
                 "an incident statistic; the emulator can only show that the check catches both causes",
                 missing="incident data")
    return ScenarioResult("dr-manifest", "the engine start check on real files (pure); live routing-around in "
                          "tests/integration/test_manifest.py", [f1, f2], {"regions": outcome})


register_scenario(Scenario("dr-manifest", "three-file DR manifest: which failover regions may start an engine",
                           run, (CLAIM_REFUSE, CLAIM_32)))
