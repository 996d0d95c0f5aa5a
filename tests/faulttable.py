"""What the fault-injection suites share: waiting for a point, and the (fault x point -> outcome)
table each prints as its summary (a markdown table, as kept in docs/reliability.md)."""
from __future__ import annotations

import time


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def markdown(head: tuple[str, ...], rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def collect_table(request, title: str, head: tuple[str, ...]):
    """Generator for a module fixture: yields the list the tests append rows to, then prints the
    table past pytest's capture."""
    rows: list[tuple] = []
    yield rows
    if rows:
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled():
            print(f"\n--- {title} (fault x point -> outcome)\n" + markdown(head, rows), flush=True)
