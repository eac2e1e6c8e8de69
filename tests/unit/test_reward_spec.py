"""Reward spec loading and its error messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from ingest.reward.spec import SpecError, default_spec_text, load_spec, parse_spec


def test_packaged_default_loads_with_version() -> None:
    spec = load_spec()
    assert spec.version == "default-v1"
    assert spec.persistence.primary_horizon_s in spec.persistence.horizons_s
    assert spec.window_s == max(spec.persistence.horizons_s) + spec.window.grace_s
    assert spec.acceptance.accepted == 0.75 and spec.acceptance.rejected == -0.25


def test_a_file_overrides_the_default(tmp_path: Path) -> None:
    text = default_spec_text().replace('version = "default-v1"', 'version = "team-v7"')
    text = text.replace("primary_horizon_s = 600", "primary_horizon_s = 3600")
    p = tmp_path / "spec.toml"
    p.write_text(text)
    spec = load_spec(p)
    assert spec.version == "team-v7" and spec.persistence.primary_horizon_s == 3600


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[persistence]\nweight = 1", "version"),
        ('version = "v"\n[persistence]\nhorizons_s=[30]\nprimary_horizon_s=600', "primary_horizon_s=600"),
        ('version = "v"\n[latency]\nslo_ms = 0', "latency.slo_ms"),
        ('version = "v"\n[window]\ngrace = 1', "window.grace"),
        ('version = "v"\n[persistence]\nhorizons_s=[]', "persistence.horizons_s"),
        ('version = "has space"', "version"),
        ("version = ", "not valid TOML"),
    ],
)
def test_invalid_specs_name_the_problem(text: str, needle: str) -> None:
    with pytest.raises(SpecError, match="reward spec") as info:
        parse_spec(text, "x.toml")
    assert needle in str(info.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read reward spec"):
        load_spec(tmp_path / "nope.toml")
