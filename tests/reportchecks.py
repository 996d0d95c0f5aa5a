"""Checks the report and compare tests share: the HTML page is self-contained
(``check_self_contained_html``), the Markdown table's values (``md_table_values``), and the numbers
recomputed independently, straight from results.jsonl rows (``recompute``)."""
from __future__ import annotations

import base64
import re
from html.parser import HTMLParser
from pathlib import Path


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.attrs, self.imgs, self.stack, self.errors = [], [], [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += [(tag, k, v or "") for k, v in attrs]
        if tag == "img":
            self.imgs.append(dict(attrs))
        if tag not in ("img", "meta", "br", "hr", "link", "input"):
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"unbalanced </{tag}> (open: {self.stack[-3:]})")
        else:
            self.stack.pop()


def check_self_contained_html(path: Path) -> list[dict]:
    """Well-formed, no external URL in any attribute, all images embedded SVGs (well-formed, sized,
    with something drawn); returns the imgs."""
    import xml.etree.ElementTree as ET

    text = path.read_text(encoding="utf-8")
    p = _Collect()
    p.feed(text)
    p.close()
    assert not p.errors, p.errors
    assert not p.stack, f"unclosed tags: {p.stack}"
    assert p.tags[:1] == ["html"] and "head" in p.tags and "body" in p.tags
    for tag, k, v in p.attrs:
        assert not re.match(r"\s*(https?:)?//", v), f"external URL in <{tag} {k}>: {v[:80]}"
        if k in ("src", "href"):
            assert v.startswith("data:") or v.startswith("#"), f"<{tag} {k}={v[:60]}> is not embedded"
    assert "<script" not in text.lower() and "@import" not in text and "url(" not in text
    assert p.imgs
    for img in p.imgs:
        src = img["src"]
        assert src.startswith("data:image/svg+xml;base64,")
        svg = ET.fromstring(base64.b64decode(src.split(",", 1)[1], validate=True))
        assert svg.tag == "{http://www.w3.org/2000/svg}svg"
        assert int(svg.get("width")) > 100 and int(svg.get("height")) > 100
        assert not any("script" in e.tag or any(a.startswith("on") for a in e.attrib) for e in svg.iter())
        drawn = [e for e in svg.iter() if e.tag.split("}")[1] in ("polyline", "rect", "circle", "path")]
        assert len(drawn) > 3, f"nothing drawn in {img.get('alt')}"
    return p.imgs


def md_table_values(md: str) -> dict:
    out = {}
    for line in md.splitlines():
        m = re.match(r"^\| ([^|]+?) \| ([^|]+?) \|$", line)
        if m:
            out.setdefault(m.group(1), m.group(2))
    return out


def recompute(rows: list[dict]) -> dict:
    """An independent recomputation, straight from results.jsonl rows."""
    taus = [sum(r["acceptance_lengths"]) / len(r["acceptance_lengths"]) for r in rows]
    tokens = sum(sum(r["acceptance_lengths"]) for r in rows)
    cycles = sum(len(r["acceptance_lengths"]) for r in rows)
    out = {"prompts": len(rows), "tokens": tokens, "cycles": cycles,
           "tau_macro": sum(taus) / len(taus), "tau_pooled": tokens / cycles}
    for b in rows[0].get("ddtree", {}):
        ls = [r["ddtree"][b]["acceptance_lengths"] for r in rows]
        out[f"DDTree-{b} tau_macro"] = sum(sum(x) / len(x) for x in ls) / len(ls)
        out[f"DDTree-{b} tau_pooled"] = sum(map(sum, ls)) / sum(map(len, ls))
    return out
