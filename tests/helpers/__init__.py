"""Shared test helpers: small model builders, PyTorch references and the kernel emulators."""
