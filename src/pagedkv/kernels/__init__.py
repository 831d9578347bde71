"""CPU kernels in C, compiled once per machine and loaded with ctypes (see native.py)."""
