"""Data the tests read from ../shared/data, the folder CI lays beside the project root.

One rule for all of it: a missing file fails the test, naming the file and why it is expected.
A skip would pass a clone laid out differently without ever running these tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = PROJECT_ROOT.parent / "shared" / "data"


def shared_file(relative: str, what: str) -> Path:
    """SHARED_DATA / relative, or the test fails, e.g. shared_file("gsm8k/test.jsonl", "GSM8K") fails with
    "tests need ../shared/data/gsm8k/test.jsonl (GSM8K, laid beside the project root as in CI); missing: /abs/path"."""
    path = SHARED_DATA / relative
    if not path.is_file():
        pytest.fail(
            f"tests need {os.path.relpath(path, PROJECT_ROOT)} ({what}, laid beside the project root "
            f"as in CI); missing: {path}",
            pytrace=False,
        )
    return path
