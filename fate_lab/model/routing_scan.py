"""One compiled pass over a routing array: which (token, layer) rows name an expert twice.

What this file is: `duplicate_rows`, numba-compiled (why our own: a row's ids are checked in registers in one read
of the array, where torch needs a transposed copy and k(k-1)/2 passes -- 0.16 s of the public replay's 0.2 s of
checks on a 180k x 26 x top-6 array). A row whose ids are all below 64 is one 64-bit mask (a repeated id finds its
bit set: 19 ms on that array against 63 ms for pairwise compares); any other row compares its k ids pairwise.
What it is not: the checks' messages (`trace.from_routing_array` words them).
"""
from __future__ import annotations

from numba import njit, uint64


@njit(cache=True)
def duplicate_rows(a):
    """(rows of a [N, L, k] that repeat an id, the first one's token, its layer), (0, -1, -1) if none."""
    N, L, k = a.shape
    count, first_n, first_l = 0, -1, -1
    one = uint64(1)
    for n in range(N):
        for l in range(L):
            seen = uint64(0)
            again = uint64(0)
            small = True
            for j in range(k):
                e = a[n, l, j]
                if e < 0 or e >= 64:
                    small = False
                    break
                b = one << uint64(e)
                again |= seen & b
                seen |= b
            dup = again != 0
            if not small:
                for i in range(k - 1):
                    x = a[n, l, i]
                    for j in range(i + 1, k):
                        if a[n, l, j] == x:
                            dup = True
            if dup:
                if count == 0:
                    first_n, first_l = n, l
                count += 1
    return count, first_n, first_l
