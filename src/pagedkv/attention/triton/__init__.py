"""The Triton kernels of the CUDA attention backend (importing this imports triton)."""
