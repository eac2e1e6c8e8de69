"""The check `helm test` runs: GET each URL given on the command line and exit 1 unless
every one answers 200. Runs as ``python -c`` in the rtrl image, standard library only.

The gateway's /v1/ paths need a client key: the first key of RTRL_GATEWAY__API_KEYS (the
JSON object of key id -> key the gateway reads) is sent as a bearer token when the pod is
given that variable. RTRL_TEST_TIMEOUT is the time in seconds each request may take.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.error import HTTPError, URLError

Opener = Callable[..., Any]


def bearer(keys_json: str) -> str | None:
    """The first key of the gateway's key map, or None when there is none."""
    keys = json.loads(keys_json) if keys_json.strip() else {}
    if not isinstance(keys, dict):
        return None
    return next((str(v) for v in keys.values()), None)


def check(url: str, token: str | None, timeout: float, opener: Opener = urllib.request.urlopen) -> str | None:
    """None when ``url`` answers 200, else what went wrong."""
    if not url.startswith(("http://", "https://")):
        return f"{url}: not an http(s) URL"
    request = urllib.request.Request(url)  # noqa: S310 -- the scheme is checked above
    if token and "/v1/" in url:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with opener(request, timeout=timeout) as response:
            status = int(response.status)
    except HTTPError as exc:  # /readyz answers 503 with {"failing": [...checks]}: show it
        body = exc.read(300).decode("utf-8", errors="replace").strip() if exc.fp else ""
        return f"{url}: HTTP {exc.code} {body}".rstrip()
    except (URLError, OSError) as exc:
        return f"{url}: {exc}"
    return None if status == 200 else f"{url}: HTTP {status}"


def main(urls: Sequence[str], env: Mapping[str, str], opener: Opener = urllib.request.urlopen) -> int:
    if not urls:
        print("no URL to check", file=sys.stderr)
        return 2
    token = bearer(env.get("RTRL_GATEWAY__API_KEYS", ""))
    timeout = float(env.get("RTRL_TEST_TIMEOUT", "10"))
    failed = 0
    for url in urls:
        problem = check(url, token, timeout, opener)
        print(f"FAIL {problem}" if problem else f"ok   {url}", file=sys.stderr if problem else sys.stdout)
        failed += problem is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], os.environ))
