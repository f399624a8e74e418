"""Every relative link in the Markdown docs points at a file or folder that exists (anchors and web links
are not checked)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "benchmarks").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def relative_targets(text: str) -> list[str]:
    """The relative link targets of a Markdown text, code blocks and inline code left out."""
    text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))
    targets = [match.group(1) for match in LINK.finditer(text)]
    return [t for t in targets if not re.match(r"^([a-z][a-z0-9+.-]*:|#)", t)]


def broken_links(page: Path) -> list[str]:
    """The links of page whose file does not exist, as 'page: target'."""
    broken = []
    for target in relative_targets(page.read_text(encoding="utf-8")):
        path = unquote(target.split("#", 1)[0])
        if not (page.parent / path).exists():
            broken.append(f"{page.relative_to(REPO)}: {target}")
    return broken


def test_relative_targets_skips_web_links_anchors_and_code():
    text = "[a](x.md) [b](https://e.org) [c](#top) `[d](no.md)` ![e](img/p.png#x)\n```\n[f](no.md)\n```\n"
    assert relative_targets(text) == ["x.md", "img/p.png#x"]


def test_every_relative_link_in_the_docs_resolves():
    broken = [link for page in PAGES for link in broken_links(page)]
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)
