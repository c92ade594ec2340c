"""The fenced code blocks of a Markdown page, for tests that run a page's commands and code as written."""

import textwrap
from pathlib import Path


def code_blocks(page: Path) -> list[tuple[str, str]]:
    """``(language, code)`` of each fenced block of ``page``, in order, dedented (a block may sit in a list item)."""
    blocks, language, lines = [], None, []
    for line in page.read_text().splitlines():
        fence = line.strip()
        if fence.startswith("```"):
            if language is None:
                language, lines = fence[3:].strip(), []
            else:
                blocks.append((language, textwrap.dedent("\n".join(lines))))
                language = None
        elif language is not None:
            lines.append(line)
    return blocks


def command_overrides(page: Path, start: str) -> list[str]:
    """The arguments after ``train.py`` of the first command on ``page`` that begins with ``start``."""
    block = next(code for _, code in code_blocks(page) if code.lstrip().startswith(start))
    words = " ".join(line.split(" #")[0] for line in block.replace("\\\n", " ").splitlines()).split()
    return words[words.index("train.py") + 1 :]
