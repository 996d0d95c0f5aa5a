"""The (fault x point -> outcome) table each fault-injection suite prints as its summary (a
markdown table, as kept in docs/reliability.md). Each test's row travels on its report (a user
property, so pytest-xdist brings it back from the worker process); tests/conftest.py prints the
tables after the run, rows in test order."""
from __future__ import annotations

KEY = "fault-table"


def markdown(head: tuple[str, ...], rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


class Table:
    """What a test appends its row to (``table.append(row)``)."""

    def __init__(self, request, title: str, head: tuple[str, ...]):
        self.node, self.title, self.head = request.node, title, head

    def append(self, row: tuple) -> None:
        indices = self.node.callspec.indices
        order = [indices[name] for name in self.head if name in indices]
        self.node.user_properties.append((KEY, {"title": self.title, "head": list(self.head), "order": order,
                                                "row": [str(c) for c in row]}))


def print_tables(terminalreporter) -> None:
    """Every table whose rows the run's reports carry."""
    tables: dict[str, tuple[list, list]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) != "call":
                continue
            for key, value in getattr(report, "user_properties", ()):
                if key == KEY:
                    _, rows = tables.setdefault(value["title"], (value["head"], []))
                    rows.append((value["order"], tuple(value["row"])))
    for title, (head, rows) in tables.items():
        terminalreporter.write_line(f"\n--- {title} (fault x point -> outcome)\n"
                                    + markdown(tuple(head), [row for _, row in sorted(rows)]))
