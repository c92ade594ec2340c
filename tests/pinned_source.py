"""The check of code the package reads from a dependency beyond its public API: each piece's
source, hashed, against the hash it was written against."""

import hashlib
import inspect


def assert_unchanged(library: str, name: str, piece: object, pinned: str, where: str) -> None:
    """``library``'s ``name`` (``piece``) still has the source of hash ``pinned`` (its sha256's first 16
    hex digits); else the message says to read it again against ``where``, the package's code."""
    found = hashlib.sha256(inspect.getsource(piece).encode()).hexdigest()[:16]
    assert found == pinned, (
        f"{library}'s {name} changed (source hash {found}, pinned {pinned}): read it again against {where}, "
        "carry the change over, then pin the new hash"
    )
