"""Triton kernels for one-token decode steps, shared by the engines' GPU paths: matrix-vector products
that read each weight once (`decode_linear`) and attention over a cache with its write (`decode_attention`).
Each module keeps its torch arithmetic (`reference*`) beside the kernels: the CPU path, and what the tests
compare against."""
