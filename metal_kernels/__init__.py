"""Kernel sources (Metal and CUDA twins), installed as package data and read by mlx_hybrid.scan."""
