"""Triton kernels over the strata (GPU, or CPU under ``TRITON_INTERPRET=1``): attention that decodes
cold pages in registers (`attend`). The torch code in `kvstrata.radix.attention` is their reference."""
