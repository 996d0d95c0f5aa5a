"""The documentation: README.md is a front page that starts with the two set-up commands and names
every command; every relative link in README.md and docs/*.md leads to a file (and a `#anchor` to a
heading of it); docs/settings.md is exactly what its generator prints from the settings fields."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

README_START = """\
# dflash-ops

```
python -m venv .venv && . .venv/bin/activate && pip install -c .ci/constraints.txt -e '.[worker]' && dflash-ops eval --host local --prompts 2
bash .ci/run
```
"""
README_MAX_LINES = 400

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans removed."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: the text (links as their text, no markup), lower case,
    everything but letters, digits, `_`, `-` and spaces dropped, spaces as `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    found = []
    for line in _prose(path.read_text()):
        found += LINK.findall(CODE_SPAN.sub("", line))
    return found


def test_every_relative_link_leads_to_a_file_and_a_heading():
    bad = []
    for page in PAGES:
        for target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto:
                continue
            where, _, anchor = target.partition("#")
            dest = (page.parent / where).resolve() if where else page
            name = f"{page.relative_to(REPO)}: ({target})"
            if not dest.exists():
                bad.append(f"{name}: no file {where}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{name}: no heading #{anchor} in {dest.relative_to(REPO)} "
                           f"(headings: {', '.join(sorted(anchors(dest)))})")
    assert not bad, "\n".join(bad)


def test_the_slugs_are_githubs():
    assert slug("Engine τ: `eval --engine`") == "engine-τ-eval---engine"
    assert slug("`sync-ckpt` and `ckpts`") == "sync-ckpt-and-ckpts"
    assert slug("Export → inspect → eval → engine, a real run") == "export--inspect--eval--engine-a-real-run"
    assert slug("A run's report: [show](x.md)") == "a-runs-report-show"


def test_the_readme_is_a_front_page_that_starts_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    assert text.startswith(README_START), "README.md must start with its title and the two set-up commands"
    lines = text.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"
    assert "<!-- tour: generated from tests/test_tour.py's DFLASH_OPS_TOUR_OUT -->" in text
    assert "## Exit codes" in text            # tests/test_architecture.py reads it


def test_the_readme_names_every_command_and_docs_every_page():
    import typer.main

    from orchestrator.cli import app

    def names(group, prefix=""):
        for name, command in group.commands.items():
            yield prefix + name
            if hasattr(command, "commands"):
                yield from names(command, prefix + name + " ")

    readme = (REPO / "README.md").read_text()
    table = readme.split("## Commands", 1)[1].split("\n## ", 1)[0]
    commands = set(names(typer.main.get_command(app)))
    cells = [m.group(1) for m in re.finditer(r"^\| `([^`]+)`", table, re.M)]
    # a row names the longest command its first cell starts with (`hosts check [NAME...]`: hosts check)
    shown = {max((c for c in commands if cell == c or cell.startswith(c + " ")), key=len, default=None)
             for cell in cells}
    missing = commands - shown
    assert not missing, f"README.md's command table does not name {sorted(missing)}"
    index = (REPO / "docs" / "README.md").read_text()
    unlisted = [p.name for p in PAGES[1:] if p.name != "README.md" and f"({p.name})" not in index]
    assert not unlisted, f"docs/README.md does not list {unlisted}"


def test_the_settings_page_is_its_generators_output():
    from remote.contract import settings_doc

    page = (REPO / "docs" / "settings.md").read_text()
    assert settings_doc.BEGIN in page and settings_doc.END in page, "docs/settings.md lost its markers"
    generated = page.split(settings_doc.BEGIN + "\n", 1)[1].split(settings_doc.END, 1)[0]
    assert generated == settings_doc.table(), (
        "docs/settings.md is not what the settings fields say: regenerate the part between its markers with "
        "`python -m remote.contract.settings_doc`")
