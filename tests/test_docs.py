"""Every file a docstring or document points at exists, and every cited section of
docs/algorithms.md is one of its headings."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for folder in ("gc_strategy", "recipes", "benchmarks", "tests") for p in (ROOT / folder).rglob("*.py")]


def test_docstring_references_resolve():
    sections = set(re.findall(r"^## (§\d+)", (ROOT / "docs" / "algorithms.md").read_text(), flags=re.M))
    missing = []
    for source in SOURCES + [ROOT / "train.py"]:
        text = source.read_text()
        for path in set(re.findall(r"\b((?:docs|benchmarks|tests)/[\w/.-]+\.(?:md|py))", text)):
            if not (ROOT / path).is_file():
                missing.append(f"{source.relative_to(ROOT)}: {path}")
        for section in re.findall(r"docs/algorithms\.md (§\d+)", text):
            if section not in sections:
                missing.append(f"{source.relative_to(ROOT)}: docs/algorithms.md {section}")
        for name in re.findall(r"\b[A-Z]{4,}\.md\b", text):  # notes kept outside the repository
            if name != "README.md" and not (ROOT / name).is_file():
                missing.append(f"{source.relative_to(ROOT)}: {name}")
    assert not missing, missing


def test_markdown_links_resolve():
    missing = []
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing, missing


def test_the_readme_is_a_guide_of_at_most_300_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
