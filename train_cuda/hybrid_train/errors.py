"""The one exception type users see: the command line prints its message on one line and exits non-zero."""


class TrainError(Exception):
    """A problem with the user's input (configs, paths, data), not a bug in hybrid_train."""
