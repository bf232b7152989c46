"""What an in-process CLI run returns, and the one-error-line assertion (a uniquely named
module: ``from conftest import`` can pick up another directory's conftest)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Result:
    rc: int
    out: str
    err: str


def one_error_line(res: Result) -> str:
    """Assert exit status 2 and a single ``error: ...`` line on stderr; return it."""
    assert res.rc == 2, (res.out, res.err)
    lines = [ln for ln in res.err.splitlines() if ln.strip()]
    assert len(lines) == 1, res.err
    assert lines[0].startswith("error: "), res.err
    assert "Traceback" not in res.err
    return lines[0]
