"""Where the repository's parts are, for the tests in any folder of ``tests/`` (which mirrors the
package: ``tests/sync/fault_tolerance/`` tests ``gc_strategy/sync/fault_tolerance/``)."""

from pathlib import Path

#: this folder: the helpers and workers the tests share
TESTS = Path(__file__).resolve().parent
#: the repository
ROOT = TESTS.parent
