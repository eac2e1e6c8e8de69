"""Fixtures of the chart tests (test_chart_*.py): helm, a helm home of the session's own
(helm's cache, config and data stay out of the user's), and rendering the chart with them.
Helpers that read the rendered documents are in chart_docs.py."""

from __future__ import annotations

import pytest
from chart_docs import Refusal, Render, ct, refusal_with, render_with


@pytest.fixture(scope="session")
def helm() -> str:
    return ct.tool("helm")


@pytest.fixture(scope="session")
def helm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return ct.helm_env(tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="session")
def render(helm: str, helm_env: dict[str, str]) -> Render:
    return render_with(helm, helm_env)


@pytest.fixture(scope="session")
def refusal(helm: str, helm_env: dict[str, str]) -> Refusal:
    return refusal_with(helm, helm_env)
