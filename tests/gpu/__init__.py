"""Checks that need a CUDA device (``make gpu-check``): skipped, but collected, without one."""
