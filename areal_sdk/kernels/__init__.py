"""Optional GPU kernels, each with a pure-torch equivalent elsewhere in the package.

Modules here import ``triton`` at import time; import them only after checking that triton
is installed and the tensors are on CUDA (``areal_sdk.logprobs`` does).
"""
