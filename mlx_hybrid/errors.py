"""The one exception type users see: the CLI prints its message on a single line and exits non-zero."""


class HybridError(Exception):
    """A problem with the user's input (paths, files, flags), not a bug in mlx-hybrid."""
