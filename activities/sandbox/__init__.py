"""The process that runs model-written code (child.py) and the template that forks it
(forkserver.py); standard library only."""

from pathlib import Path

CHILD_PATH = Path(__file__).with_name("child.py")
FORKSERVER_PATH = Path(__file__).with_name("forkserver.py")
