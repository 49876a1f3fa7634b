"""mlx-hybrid command line."""
