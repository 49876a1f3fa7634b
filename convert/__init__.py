"""Checkpoint conversion to MLX model directories."""
