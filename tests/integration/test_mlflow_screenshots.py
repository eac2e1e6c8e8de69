"""The MLflow pages a product reviewer opens, in a real browser: after a canary rolled back on
the session's MLflow server, headless Chromium loads the model version page and the ledger
run page; the rendered pages must show the descriptions, and the screenshots must be real
pictures. They go to a temporary folder, or to docs/images/ with RTRL_UPDATE_SCREENSHOTS=1.

Needs Debian's ``chromium``, which scripts/tools installs (``apt-get install chromium``):
without it the test fails in CI (CI=true) and skips elsewhere."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from deployer_helpers import deployer_settings, rolled_back_canary
from PIL import Image

from deployer import records
from deployer.adapters.ledger_mlflow import MlflowLedger
from services.settings.model import Settings

CHROMIUM = shutil.which("chromium")
DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
MISSING = "chromium is not installed (scripts/tools installs it: apt-get install chromium)"
pytestmark = pytest.mark.skipif(CHROMIUM is None and os.environ.get("CI") != "true", reason=MISSING)


def chromium(profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None, MISSING  # in CI the browser is part of the test setup
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--hide-scrollbars", f"--user-data-dir={profile}", "--window-size=1400,1000",
           "--virtual-time-budget=15000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def shoot(profile: Path, url: str, png: Path, expect: str) -> None:
    """Render ``url``; its DOM must contain ``expect`` and its screenshot be a real picture."""
    dom = chromium(profile, "--dump-dom", url)
    assert expect in dom.stdout, f"{url} did not render {expect!r}: {dom.stdout[-2000:]} {dom.stderr[-1000:]}"
    shot = chromium(profile, f"--screenshot={png}", url)
    assert png.exists(), shot.stderr[-2000:]
    with Image.open(png) as img:
        assert img.size == (1400, 1000)
        pixels = img.convert("RGB").resize((350, 250))
        colours = pixels.getcolors(maxcolors=1_000_000) or []
    assert len(colours) > 50, f"{png.name}: {len(colours)} colours, a blank page?"
    background = max(colours)[0] / (350 * 250)
    assert background < 0.97, f"{png.name}: {background:.0%} one colour, a blank page?"


def test_reviewer_pages_render_in_a_browser(settings: Settings, mlflow_server: str, tmp_path: Path) -> None:
    deploy = deployer_settings(settings, mlflow_server)
    _, cid = rolled_back_canary(deploy, tmp_path)
    led = MlflowLedger(mlflow_server, deploy.mlflow.deployments_experiment)
    run_id = led.run_id(cid)
    assert run_id is not None
    out = DOCS_IMAGES if os.environ.get("RTRL_UPDATE_SCREENSHOTS") == "1" else tmp_path / "shots"
    out.mkdir(parents=True, exist_ok=True)
    profile = tmp_path / "chromium-profile"
    model = deploy.mlflow.registered_model
    shoot(profile, f"{mlflow_server}/#/models/{model}/versions/2", out / "mlflow-model-version.png",
          "rtrl policy v2: rolled back")
    shoot(profile, f"{mlflow_server}/{records.run_link(led.experiment_id(), run_id)}",
          out / "mlflow-ledger-run.png", "v2 was rolled back: v1 stays the champion.")
    shoot(profile, f"{mlflow_server}/#/experiments/{led.experiment_id()}{records.RUN_VIEW}",
          out / "mlflow-ledger-experiment.png", "rtrl deployment ledger.")
    shoot(profile, f"{mlflow_server}/#/models/{model}", out / "mlflow-registered-model.png",
          "rtrl policies.")
