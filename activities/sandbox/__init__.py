"""The child process that runs model-written code (child.py: standard library only)."""

from pathlib import Path

CHILD_PATH = Path(__file__).with_name("child.py")
