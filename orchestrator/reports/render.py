"""Formatting shared by documents and messages, and documents written to disk: Markdown plus a self-contained HTML page (inline CSS, plots as
``data:`` SVG images) from one list of blocks. ``report.md/.html`` of a run and ``compare.md/.html``
are both :class:`Document` s; terminal tables are the CLI's (orchestrator/cli/console.py).

Inline markup in paragraphs: ``**bold**`` and ```code``` (rendered as <b>/<code> in HTML).
Everything else is text, escaped in both renderings: a prompt id, a category or a run name from a
run folder is never markup (:func:`md_text` in Markdown).
"""
from __future__ import annotations

import base64
import html
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from ..runs.record import write_atomic

CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1100px;padding:0 16px;
color:#222;background:#fff;line-height:1.4}
h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.6em 0;font-size:.92em}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f2f4f7}td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
.warn{background:#fff4e5;border:2px solid #f0a020;padding:8px 14px;margin:12px 0;border-radius:4px}
.warn h3{margin:0 0 4px 0;color:#a05a00}.note{color:#666;font-size:.9em}
.published{font-style:italic;color:#555}
.verdict{font-size:1.25em;font-weight:600;background:#eef4fb;border-left:5px solid #1f77b4;padding:8px 14px;
margin:10px 0 14px 0}.verdict p{margin:4px 0}
img.plot{max-width:100%;border:1px solid #eee;margin:6px 0;display:block}
"""

_NUMERIC = re.compile(r"^[+\-−<]?\d[\d.]*( \[.*\])?$|^\d+ / \d+ / \d+$|^\d+/\d+/\d+$")
_INLINE = re.compile(r"\*\*(.+?)\*\*|`(.+?)`")
_MD_TAG = re.compile(r"<(?=[A-Za-z/!?])")
_MD_ENTITY = re.compile(r"&(?=#?[A-Za-z0-9]+;)")


def fnum(x, digits: int = 4) -> str:
    """A cell value: '—' for missing, yes/no for booleans, fixed digits for floats."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.{digits}f}"
    return str(x)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def md_text(text) -> str:
    """``text`` as Markdown that never becomes HTML, a link or an image, whatever a run folder put
    in it: a ``<`` that would open a tag, comment or autolink and an ``&`` that would make a
    character reference are written as HTML escapes them (in a code span too, whichever backticks
    pair up), ``](`` is escaped; ``**bold**``, ```code``` and any other ``<`` are left as they are."""
    return _MD_TAG.sub("&lt;", _MD_ENTITY.sub("&amp;", str(text))).replace("](", "\\](")


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def cell(x):
        return md_text(x).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def html_table(header: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    e = html.escape
    head = "".join(f"<th>{e(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(
        f'<td class="num">{e(str(c))}</td>' if _NUMERIC.match(str(c)) else f"<td>{e(str(c))}</td>" for c in r)
        + "</tr>" for r in rows)
    return f'<table class="{e(cls)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _inline_html(text: str) -> str:
    out, pos = [], 0
    for m in _INLINE.finditer(text):
        out.append(html.escape(text[pos:m.start()]))
        out.append(f"<b>{html.escape(m.group(1))}</b>" if m.group(1) is not None
                   else f"<code>{html.escape(m.group(2))}</code>")
        pos = m.end()
    return "".join(out) + html.escape(text[pos:])


@dataclass
class Document:
    """A titled document; blocks render to Markdown and HTML alike (see :meth:`write`)."""

    title: str
    blocks: list[tuple] = field(default_factory=list)

    def heading(self, text: str, level: int = 2) -> None:
        self.blocks.append(("heading", text, level))

    def para(self, text: str, cls: str = "") -> None:
        """A paragraph; ``cls`` 'note' (small, grey) or 'published' (italic) styles it."""
        self.blocks.append(("para", text, cls))

    def verdict(self, lines: Sequence[str]) -> None:
        """The answer, first and large: one line a person can read aloud per item."""
        if lines:
            self.blocks.append(("verdict", list(lines)))

    def warnings(self, title: str, items: Sequence[str]) -> None:
        """A highlighted box listing ``items`` (nothing when there are none)."""
        if items:
            self.blocks.append(("warnings", title, list(items)))

    def table(self, header: Sequence[str], rows: Sequence[Sequence[str]], heading: str | None = None,
              level: int = 2, cls: str = "") -> None:
        if heading:
            self.heading(heading, level)
        self.blocks.append(("table", list(header), [list(r) for r in rows], cls))

    def plot(self, key: str, heading: str, svg: Optional[bytes], missing: str | None = None) -> None:
        """A plot (SVG bytes) under its own heading; without data, ``missing`` is said instead (or nothing)."""
        if svg is None and missing is None:
            return
        self.heading(heading)
        self.blocks.append(("plot", key, heading, svg, missing))

    def markdown(self, plot_dir: Path | None = None) -> str:
        line = lambda text: md_text(text).replace("\n", " ")  # noqa: E731
        md = [f"# {line(self.title)}", ""]
        for kind, *b in self.blocks:
            if kind == "heading":
                md += [f"{'#' * b[1]} {line(b[0])}", ""]
            elif kind == "para":
                md += [f"_{line(b[0])}_" if b[1] == "published" else line(b[0]), ""]
            elif kind == "verdict":
                md += [f"**{line(x)}**" + ("  " if i < len(b[0]) - 1 else "") for i, x in enumerate(b[0])] + [""]
            elif kind == "warnings":
                md += [f"> **{line(b[0])}**", ">"] + [f"> - {line(x)}" for x in b[1]] + [""]
            elif kind == "table":
                md += [md_table(b[0], b[1]), ""]
            elif kind == "plot":
                key, heading, svg, missing = b
                if svg is None:
                    md += [f"_({missing})_", ""]
                    continue
                if plot_dir is not None:
                    if plot_dir.is_symlink():       # written in the folder, never through a link
                        plot_dir.unlink()
                    plot_dir.mkdir(parents=True, exist_ok=True)
                    write_atomic(plot_dir / f"{key}.svg", svg)
                md += [f"![{heading}](plots/{key}.svg)", ""]
        return "\n".join(md)

    def html(self) -> str:
        e = html.escape
        body = [f"<h1>{e(self.title)}</h1>"]
        for kind, *b in self.blocks:
            if kind == "heading":
                body.append(f"<h{b[1]}>{e(b[0])}</h{b[1]}>")
            elif kind == "para":
                body.append(f'<p class="{e(b[1])}">{_inline_html(b[0])}</p>' if b[1] else f"<p>{_inline_html(b[0])}</p>")
            elif kind == "verdict":
                body.append('<div class="verdict">' + "".join(f"<p>{e(x)}</p>" for x in b[0]) + "</div>")
            elif kind == "warnings":
                items = "".join(f"<li>{e(x)}</li>" for x in b[1])
                body.append(f'<div class="warn"><h3>{e(b[0])}</h3><ul>{items}</ul></div>')
            elif kind == "table":
                body.append(html_table(b[0], b[1], b[2]))
            elif kind == "plot":
                key, heading, svg, missing = b
                if svg is None:
                    body.append(f'<p class="note">({e(missing)})</p>')
                else:
                    data = base64.b64encode(svg).decode("ascii")
                    body.append(f'<img class="plot" alt="{e(heading)}" src="data:image/svg+xml;base64,{data}">')
        return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
                f"<title>{e(self.title)}</title><style>{CSS}</style></head>\n<body>\n"
                + "\n".join(body) + "\n</body></html>\n")

    def write(self, out_dir: Path, stem: str) -> tuple[Path, Path]:
        """``out_dir/STEM.md`` (plots as ``out_dir/plots/KEY.svg``) and ``out_dir/STEM.html``, each
        replaced whole (a link in their place is replaced, not written through)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        md_path, html_path = out_dir / f"{stem}.md", out_dir / f"{stem}.html"
        write_atomic(md_path, self.markdown(out_dir / "plots"))
        write_atomic(html_path, self.html())
        return md_path, html_path
