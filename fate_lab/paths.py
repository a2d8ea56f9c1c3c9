"""Where fate_lab finds its shipped data (``data/`` at the repository root, or $FATE_LAB_DATA)."""
from __future__ import annotations

import os
from pathlib import Path

DATA_DIR = Path(os.environ.get("FATE_LAB_DATA", Path(__file__).resolve().parent.parent / "data"))
TINY_MOE_DIR = DATA_DIR / "tiny_moe"
