"""Every link of the docs to a file of the repository (README.md, router/, bench/ and k8s/'s READMEs,
docs/, bench/results/latest/'s reports) points at a file that exists, and its #anchor, in a Markdown
file, at one of that file's headings."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *(ROOT / d / "README.md" for d in ("router", "bench", "k8s"))]
DOCS += [*ROOT.glob("docs/*.md"), *ROOT.glob("bench/results/latest/*.md")]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation but - and _ dropped,
    spaces as -, a name met again suffixed -1, -2, ..."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", FENCE.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_anchors_are_githubs() -> None:
    text = "# shardlb\n## For operators\n### Upgrading an install (the changes of 2026-12-05)\n"
    text += "```sh\n# a comment, no heading\n```\n## For operators\n"
    assert anchors(text) == {
        "shardlb",
        "for-operators",
        "upgrading-an-install-the-changes-of-2026-12-05",
        "for-operators-1",
    }


def test_every_link_to_a_file_reaches_it() -> None:
    broken = []
    for doc in DOCS:
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(ROOT)}: {target}"
            if not file.is_relative_to(ROOT) and not file.parent.exists():
                continue  # the shared docs beside the checkout (../shared/api.md), where it has none
            if not file.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
                broken.append(f"{where} (no such heading)")
    assert broken == []
