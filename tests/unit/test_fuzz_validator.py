"""The pure validator against the generated hostile corpus (tests/reliability/fuzz_corpus.py) at
unit speed: 12,000 hostile records of every class (deep nesting, integers beyond 64 bits,
duplicate keys, dates outside the UTC range, non-finite numbers, mixed encodings, mismatched
keys, forged signatures...) mixed with valid requests; every record gets the reason the
corpus expects, and no detail echoes a field value."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime

import pytest

from ingest.auth import AuthPolicy
from ingest.validate import DETAIL_MAX, REASONS, Limits, Rejected, validate
from tests.reliability import fuzz_corpus

pytestmark = pytest.mark.unit

KEYS = {"gw": b"fuzz-secret-1", "client": b"fuzz-secret-2"}


@pytest.mark.parametrize("seed", [3, 4])
def test_generated_corpus_gets_the_expected_reason(seed: int) -> None:
    now = datetime.now(UTC)
    corpus = fuzz_corpus.build(seed, 12_000, 100, now, KEYS)
    expected = corpus.count()
    assert sum(n for k, n in expected.items() if k != "valid") >= 12_000
    assert set(REASONS) - {"duplicate"} <= set(expected), "every reason code must be exercised"
    policy = AuthPolicy(keys=KEYS)
    wrong: Counter[tuple[str, str, str]] = Counter()
    long_details = 0
    for r in corpus.records:
        want = "valid" if r.expect == "duplicate" else r.expect
        out = validate(r.value, r.headers, r.key, now, Limits(), policy)
        got = out.reason if isinstance(out, Rejected) else "valid"
        wrong[(r.case, want, got)] += got != want
        long_details += isinstance(out, Rejected) and len(out.detail) > DETAIL_MAX
    assert not +wrong, f"validator and corpus disagree (case, expected, got): {dict(+wrong)}"
    assert long_details == 0
    cases = {r.case for r in corpus.records if r.expect != "valid"}
    assert len(cases) >= 150, len(cases)
