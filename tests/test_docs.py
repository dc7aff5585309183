"""The README stays short and true: its quick-start commands verbatim, its links to docs/ live; and the sources
name design ideas by what they are, not by a seed's number."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SOURCES = ROOT / "src" / "slotserve"

MAX_README_LINES = 200
QUICK_START = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[cpu]' && "
    'slotserve generate --chat "What is the capital of France?"',
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[cpu,test]' && python -m pytest",
)
# Markdown links and images: [text](target) or ![alt](target), an optional "title" after the target.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SEED_NUMBER = re.compile(r"\bseeds? ?0\d\d\b", re.IGNORECASE)


def readme() -> str:
    return README.read_text(encoding="utf-8")


def test_readme_is_at_most_200_lines():
    lines = readme().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move reference material to docs/"


def test_readme_has_both_quick_start_commands_verbatim():
    text = readme()
    for command in QUICK_START:
        assert command in text, f"quick-start command missing from README.md: {command}"


def test_readme_links_to_docs_point_to_files_that_exist():
    targets = [t for t in LINK.findall(readme()) if not re.match(r"[a-z][a-z0-9+.-]*:|#", t, re.IGNORECASE)]
    docs = [t for t in targets if t.split("#", 1)[0].removeprefix("./").startswith("docs/")]
    assert docs, "README.md links to no page under docs/"
    missing = [t for t in docs if not (ROOT / t.split("#", 1)[0]).is_file()]
    assert not missing, f"README.md links to docs that do not exist: {missing}"


def test_sources_name_no_seed_by_number():
    hits = []
    for path in sorted(SOURCES.rglob("*")):
        if not path.is_file() or path.suffix in (".pyc", ".so"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if SEED_NUMBER.search(line) or "seeds/" in line.lower():
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "name the idea, not the seed's number:\n" + "\n".join(hits)
