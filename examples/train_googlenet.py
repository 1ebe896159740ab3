"""Train googlenet data-parallel; run under examples/launch.py (see README, Examples)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import train  # noqa: E402

if __name__ == "__main__":
    train("googlenet")
