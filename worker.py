"""`python worker.py`: run episode workflows and activities (durable_rlm/worker/main.py).

The repository keeps this file at its root, where an operator looks for it; the code is in
the package, so an installed wheel runs the same worker as `drlm worker`."""

from durable_rlm.worker.main import main

if __name__ == "__main__":
    main()
