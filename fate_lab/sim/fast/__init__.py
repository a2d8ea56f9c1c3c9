"""The compiled fast replay (numba): the one cache's steps with the token loop (`driver.py`), one file per policy
(`dispatch.py`).

Its cached compiled code holds copies of the policy functions it calls, so `fate_lab/policy/kernels/__init__.py`
(imported first, through the registry) clears this package's numba cache too when any of those sources changed.
"""
