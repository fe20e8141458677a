"""Container health probe: exit 0 when kvstrata's GET /health answers 200, 1 otherwise.

Standard library only, so it runs in any image that has the kvstrata environment. The address comes
from KVSTRATA_HEALTH_URL, or else from KVSTRATA_PORT on the loopback (the server may bind 0.0.0.0).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def health_url(env: dict[str, str]) -> str:
    if env.get("KVSTRATA_HEALTH_URL"):
        return env["KVSTRATA_HEALTH_URL"]
    return f"http://127.0.0.1:{env.get('KVSTRATA_PORT', '30000')}/health"


def probe(url: str, timeout: float = 4.0) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200, f"{url}: HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return False, f"{url}: HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"{url}: {exc}"


def main() -> int:
    ok, message = probe(health_url(dict(os.environ)))
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
