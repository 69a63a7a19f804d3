"""Where the tests find the project: its root (``conf/``, ``train.py``, ``docs/``) and the test fixtures."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
