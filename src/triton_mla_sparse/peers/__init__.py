"""Other kernels the bench can check and time beside ``sparse_mla`` on the same inputs.

A peer is never a dependency of the package: each module imports its library lazily, from
``load()``, and nothing here is imported by ``triton_mla_sparse`` itself.
"""
