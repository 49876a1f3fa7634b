"""mlx-hybrid command line."""

import os
import signal
import sys
import threading


def on_interrupt(action):
    """A SIGINT handler that runs `action` (raise or exit), except inside a finalizer: an exception
    raised in a `__del__` (one runs whenever the garbage collector does) is printed and dropped
    ("Exception ignored in ..."), and that Ctrl-C would be lost. There the signal is sent again
    a moment later, once the finalizer has returned."""

    def handler(signum, frame):
        f = frame
        while f is not None:
            if f.f_code.co_name == "__del__":
                again = threading.Timer(0.05, os.kill, (os.getpid(), signum))
                again.daemon = True  # never keeps a process that is exiting anyway
                again.start()
                return
            f = f.f_back
        action()

    return handler


def _exit_quietly():
    sys.exit(130)


def run():
    """The `hybrid` console script: a Ctrl-C while the libraries import (seconds on a cold start)
    exits quietly with status 130; `main` then turns Ctrl-C back into KeyboardInterrupt."""
    signal.signal(signal.SIGINT, on_interrupt(_exit_quietly))
    from mlx_hybrid.cli.main import main

    main()
