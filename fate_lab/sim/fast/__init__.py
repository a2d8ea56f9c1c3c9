"""The compiled fast replay (numba): the policy calls by number (`dispatch.py`) and the token loop (`driver.py`).

Its cached compiled code inlines the policy files, so `fate_lab/policy/kernels/__init__.py` (imported first, through
the registry) clears this package's numba cache too when any of those sources changed.
"""
