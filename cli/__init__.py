"""mlx-hybrid command line."""


def run():
    """The `hybrid` console script: a Ctrl-C while the libraries import (seconds on a cold start)
    exits quietly with status 130; `main` then turns Ctrl-C back into KeyboardInterrupt."""
    import signal
    import sys

    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))
    from mlx_hybrid.cli.main import main

    main()
