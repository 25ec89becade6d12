"""Block kernels for BIRD / BIRD+ (docs/codecs.md; BIRD+: IEEE TPDS 2024).

A tensor of n elements is m = ceil(n/b) contiguous blocks of b elements (the last one padded
virtually with zeros). Compression is one pass over memory (block L1 norms, fused with the error
feedback / momentum accumulation when enabled), then O(m) work on the norms only (weights,
probabilities, sampling), then a gather of the kept blocks.

This module is the block codecs' kernel API: the block norms, the gather and scatter of kept
blocks, the shared mode's ids; the O(m) work is in ``birdnet.kernels.weights`` (weights,
probabilities, systematic and Bernoulli sampling) and ``birdnet.kernels.select`` (the BIRD+
selection without full passes over float64 weights), whose public functions are imported here.

Determinism: everything here uses no fast-math and a fixed evaluation order. A block's L1 norm is
computed by one thread with eight partial sums combined in a fixed tree, so it is the same for any
thread count and on any IEEE machine; the O(m) probability and sampling kernels are sequential and
use float64. This is what the ``shared`` selection mode relies on.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from birdnet.kernels._arrays import check as _check
from birdnet.kernels._paths import threshold as _threshold
from birdnet.kernels.select import CANDIDATES_FROM, birdplus_select, probabilities, solve_scale  # noqa: F401
from birdnet.kernels.weights import (  # noqa: F401 - the block codecs' API
    _INF_BITS,
    _finite_max_any,
    bernoulli,
    gamma_quarters,
    gamma_weights,
    probabilities_for,
    sample_norms,
    systematic,
    systematic_natural,
    walk,
)


@njit(cache=True, inline="always")
def _block_l1(x, lo, hi):
    # fixed order: 8 lanes over full groups of 8, tree combine, then the tail sequentially
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
    i = lo
    while i + 8 <= hi:
        s0 += abs(x[i])
        s1 += abs(x[i + 1])
        s2 += abs(x[i + 2])
        s3 += abs(x[i + 3])
        s4 += abs(x[i + 4])
        s5 += abs(x[i + 5])
        s6 += abs(x[i + 6])
        s7 += abs(x[i + 7])
        i += 8
    s = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    while i < hi:
        s += abs(x[i])
        i += 1
    return s


@njit(cache=True, inline="always")
def _block_l1_8(x, lo):
    # _block_l1 for a full block of 8 (bit-identical: 0 + |x| = |x|), unrolled so LLVM vectorises it
    s0 = abs(x[lo])
    s1 = abs(x[lo + 1])
    s2 = abs(x[lo + 2])
    s3 = abs(x[lo + 3])
    s4 = abs(x[lo + 4])
    s5 = abs(x[lo + 5])
    s6 = abs(x[lo + 6])
    s7 = abs(x[lo + 7])
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


# Kernels below loop from 0 over slices: with a loop index that LLVM can prove non-negative,
# Numba's negative-index wraparound disappears and the loops vectorise (2-10x faster).


@njit(cache=True)
def _norms_chunk(xs, u0s, us, v0s, vs, momentum, b, mode, out):
    """Block norms of one chunk (xs, u0s/us, v0s/vs: its elements; out: its blocks). The
    accumulators are read from u0s/v0s and written to us/vs (the same arrays to update in place; a
    round's scratch otherwise, so its committed state needs no copy first). mode 0: out = L1(x);
    1: v = v0 + x, out = L1(v); 2: u = momentum*u0 + x, v = v0 + u, out = L1(v); 3: u = momentum*u0
    + x, out = L1(u) (the block-age accumulator, which keeps no v). Returns the largest finite
    norm as int32 bits (for non-negative floats the bit order is the value order; NaN/Inf excluded).
    Full blocks of 8 take an unrolled path with the same arithmetic as _block_l1."""
    n = xs.shape[0]
    nb = out.shape[0]
    j0 = 0
    if b == 8:
        jf = min(nb, n // 8)
        if mode == 0:
            for j in range(jf):
                out[j] = _block_l1_8(xs, 8 * j)
        elif mode == 1:
            for j in range(jf):
                lo = 8 * j
                for i in range(8):
                    vs[lo + i] = v0s[lo + i] + xs[lo + i]
                out[j] = _block_l1_8(vs, lo)
        elif mode == 2:
            for j in range(jf):
                lo = 8 * j
                for i in range(8):
                    us[lo + i] = momentum * u0s[lo + i] + xs[lo + i]
                    vs[lo + i] = v0s[lo + i] + us[lo + i]
                out[j] = _block_l1_8(vs, lo)
        else:
            for j in range(jf):
                lo = 8 * j
                for i in range(8):
                    us[lo + i] = momentum * u0s[lo + i] + xs[lo + i]
                out[j] = _block_l1_8(us, lo)
        j0 = jf
    for j in range(j0, nb):
        lo = j * b
        hi = min(n, lo + b)
        if mode == 0:
            out[j] = _block_l1(xs, lo, hi)
        elif mode == 3:
            for i in range(lo, hi):
                us[i] = momentum * u0s[i] + xs[i]
            out[j] = _block_l1(us, lo, hi)
        else:
            if mode == 1:
                for i in range(lo, hi):
                    vs[i] = v0s[i] + xs[i]
            else:
                for i in range(lo, hi):
                    us[i] = momentum * u0s[i] + xs[i]
                    vs[i] = v0s[i] + us[i]
            out[j] = _block_l1(vs, lo, hi)
    bits = out.view(np.int32)
    mx = np.int32(0)
    for j in range(nb):
        t = bits[j]
        t = np.int32(0) if t >= _INF_BITS else t
        mx = max(mx, t)
    return mx


#: blocks per parallel chunk of the norm pass
_NORM_CHUNK = 8192


@njit(cache=True, inline="always")
def _norms_one_chunk(x, u0, u, v0, v, momentum, b, mode, out, c):
    n = x.shape[0]
    j0 = c * _NORM_CHUNK
    j1 = min(out.shape[0], j0 + _NORM_CHUNK)
    lo = j0 * b
    hi = min(n, j1 * b)
    hu = mode >= 2
    hv = mode in (1, 2)
    return _norms_chunk(x[lo:hi], u0[lo:hi] if hu else u0, u[lo:hi] if hu else u,
                        v0[lo:hi] if hv else v0, v[lo:hi] if hv else v, momentum, b, mode, out[j0:j1])


_NORMS_SIG = ("int32(float32[::1], float32[::1], float32[::1], float32[::1], float32[::1], float32, int64, "
              "int64, float32[::1])")


@njit(_NORMS_SIG, cache=True, parallel=True)
def _norms_pass(x, u0, u, v0, v, momentum, b, mode, out):
    # chunks of blocks in parallel; the per-block arithmetic does not depend on the thread count
    nch = -(-out.shape[0] // _NORM_CHUNK)
    cmax = np.zeros(nch, np.int32)
    for c in prange(nch):
        cmax[c] = _norms_one_chunk(x, u0, u, v0, v, momentum, b, mode, out, c)
    mx = np.int32(0)
    for c in range(nch):
        mx = max(mx, cmax[c])
    return mx


@njit(_NORMS_SIG, cache=True)
def _norms_pass_serial(x, u0, u, v0, v, momentum, b, mode, out):
    # same arithmetic as _norms_pass without a thread launch (small tensors)
    mx = np.int32(0)
    for c in range(-(-out.shape[0] // _NORM_CHUNK)):
        mx = max(mx, _norms_one_chunk(x, u0, u, v0, v, momentum, b, mode, out, c))
    return mx


def _block_norms(x, b, out):
    e = np.empty(0, np.float32)
    _norms_pass(x, e, e, e, e, np.float32(0.0), b, np.int64(0), out)


def _block_norms_serial(x, b, out):
    e = np.empty(0, np.float32)
    _norms_pass_serial(x, e, e, e, e, np.float32(0.0), b, np.int64(0), out)


#: below this many elements the serial kernels win (a parallel launch costs ~0.1-0.3 ms)
SERIAL_BELOW = 1 << 16


def _parallel(n: int) -> bool:
    """Whether ``n`` elements take the parallel kernel (SERIAL_BELOW, unless this thread lowered it)."""
    return n >= _threshold("SERIAL_BELOW", SERIAL_BELOW)


def block_norms(x: np.ndarray, b: int, out: np.ndarray | None = None) -> np.ndarray:
    """L1 norm of every block of ``b`` elements of float32 ``x`` (float32, length ceil(n/b))."""
    _check(x, np.float32, "block_norms x")
    m = -(-x.shape[0] // b)
    if out is None:
        out = np.empty(m, np.float32)
    _check(out, np.float32, "block_norms out", m)
    (_block_norms if _parallel(x.shape[0]) else _block_norms_serial)(x, np.int64(b), out)
    return out


def norms_max(x: np.ndarray, u: np.ndarray | None, v: np.ndarray | None, momentum: float, b: int,
              out: np.ndarray, error_feedback: bool, u_in: np.ndarray | None = None,
              v_in: np.ndarray | None = None) -> float:
    """One pass over memory: block L1 norms into ``out`` (of ``x``, or of ``v`` after the error
    feedback update ``u = momentum*u + x; v += u`` / ``v += x`` when ``error_feedback``); returns
    the largest finite norm (0.0 when there is none). Norms are bit-identical to :func:`block_norms`.
    With ``u_in``/``v_in`` the update reads the accumulators from them and writes ``u``/``v`` whole
    (a round's scratch filled without copying the committed state into it first)."""
    n = x.shape[0]
    _check(x, np.float32, "norms x")
    _check(out, np.float32, "norms out", -(-n // b))
    e = np.empty(0, np.float32)
    mode = 0
    if error_feedback:
        _check(v, np.float32, "accumulate v", n)
        v_in = v if v_in is None else v_in
        _check(v_in, np.float32, "accumulate v_in", n)
        mode = 1
        if u is not None:
            _check(u, np.float32, "accumulate u", n)
            u_in = u if u_in is None else u_in
            _check(u_in, np.float32, "accumulate u_in", n)
            mode = 2
    kern = _norms_pass if _parallel(n) else _norms_pass_serial
    uu = e if mode != 2 else u
    vv = e if mode == 0 else v
    bits = kern(x, e if mode != 2 else u_in, uu, e if mode == 0 else v_in, vv, np.float32(momentum),
                np.int64(b), np.int64(mode), out)
    return float(np.array([bits], np.int32).view(np.float32)[0])


def momentum_norms(x: np.ndarray, u: np.ndarray, momentum: float, b: int, out: np.ndarray,
                   u_in: np.ndarray | None = None) -> None:
    """One pass: ``u = momentum*u + x`` and the block L1 norms of u into ``out`` (the block-age
    accumulator of docs/codecs.md keeps the momentum only; the same per-block arithmetic as
    :func:`norms_max`, so the same for any thread count). With ``u_in`` the momentum is read from
    it and ``u`` written whole."""
    n = x.shape[0]
    _check(x, np.float32, "momentum_norms x")
    _check(u, np.float32, "momentum_norms u", n)
    u_in = u if u_in is None else u_in
    _check(u_in, np.float32, "momentum_norms u_in", n)
    _check(out, np.float32, "momentum_norms out", -(-n // b))
    kern = _norms_pass if _parallel(n) else _norms_pass_serial
    e = np.empty(0, np.float32)
    kern(x, u_in, u, e, e, np.float32(momentum), np.int64(b), np.int64(3), out)


# -- gather / scatter / clear (O(kept blocks)) ----------------------------------------------------

# Loops index 0-based slices (see _norms_chunk): Numba then drops the negative-index checks and a
# block's loads are independent, so the cache misses of the (scattered) kept blocks overlap.

@njit(cache=True, inline="always")
def _gather_one(x, b, ids, scale, out, j):
    n = x.shape[0]
    lo = ids[j] * b
    s = np.float32(scale[j])
    o = out[j * b:(j + 1) * b]
    if lo + b <= n:
        src = x[lo:lo + b]
        for i in range(b):
            o[i] = src[i] * s
    else:
        src = x[lo:n]
        for i in range(src.shape[0]):
            o[i] = src[i] * s
        for i in range(src.shape[0], b):
            o[i] = 0.0


@njit(cache=True, parallel=True)
def _gather_blocks(x, b, ids, scale, out):
    for j in prange(ids.shape[0]):
        _gather_one(x, b, ids, scale, out, j)


@njit(cache=True)
def _gather_blocks_serial(x, b, ids, scale, out):
    for j in range(ids.shape[0]):
        _gather_one(x, b, ids, scale, out, j)


@njit(cache=True, inline="always")
def _scatter_one(vals, b, ids, out, add, j):
    n = out.shape[0]
    lo = np.int64(ids[j]) * b
    hi = min(n, lo + b)
    src = vals[j * b:j * b + (hi - lo)]
    dst = out[lo:hi]
    if add:
        for i in range(dst.shape[0]):
            dst[i] += np.float32(src[i])
    else:
        for i in range(dst.shape[0]):
            dst[i] = np.float32(src[i])


@njit(cache=True, parallel=True)
def _scatter_blocks(vals, b, ids, out, add):
    # ids are distinct (validated) so parallel writes never collide
    for j in prange(ids.shape[0]):
        _scatter_one(vals, b, ids, out, add, j)


@njit(cache=True)
def _scatter_blocks_serial(vals, b, ids, out, add):
    for j in range(ids.shape[0]):
        _scatter_one(vals, b, ids, out, add, j)


@njit(cache=True, parallel=True)
def _subtract_sent(v, u, b, ids, sent):
    # error feedback: v keeps what was not sent (v - sent); momentum u is cleared on sent blocks
    n = v.shape[0]
    use_u = u.shape[0] == n
    for j in prange(ids.shape[0]):
        lo = ids[j] * b
        hi = min(n, lo + b)
        src = sent[j * b:j * b + (hi - lo)]
        dst = v[lo:hi]
        for i in range(dst.shape[0]):
            dst[i] = dst[i] - np.float32(src[i])
        if use_u:
            uu = u[lo:hi]
            for i in range(uu.shape[0]):
                uu[i] = 0.0


@njit(cache=True, inline="always")
def _gather_sub_one(v, u, use_u, b, ids, scale, out, j):
    # _gather_one then _subtract_sent of the same block with what was just gathered (the same
    # float32 operations as the two kernels), touching the scattered block once
    n = v.shape[0]
    lo = ids[j] * b
    hi = min(n, lo + b)
    s = np.float32(scale[j])
    o = out[j * b:(j + 1) * b]
    src = v[lo:hi]
    for i in range(src.shape[0]):
        t = src[i] * s
        o[i] = t
        src[i] = src[i] - t
    for i in range(src.shape[0], b):
        o[i] = 0.0
    if use_u:
        uu = u[lo:hi]
        for i in range(uu.shape[0]):
            uu[i] = 0.0


@njit(cache=True, parallel=True)
def _gather_subtract(v, u, b, ids, scale, out):
    use_u = u.shape[0] == v.shape[0]
    for j in prange(ids.shape[0]):
        _gather_sub_one(v, u, use_u, b, ids, scale, out, j)


@njit(cache=True)
def _gather_subtract_serial(v, u, b, ids, scale, out):
    use_u = u.shape[0] == v.shape[0]
    for j in range(ids.shape[0]):
        _gather_sub_one(v, u, use_u, b, ids, scale, out, j)


@njit(cache=True)
def _distinct_ascending(ids, m):
    last = -1
    for j in range(ids.shape[0]):
        v = np.int64(ids[j])
        if v <= last or v >= m:
            return False
        last = v
    return True


def gather_blocks(x: np.ndarray, b: int, ids: np.ndarray, scale: np.ndarray,
                  out: np.ndarray) -> np.ndarray:
    """out[j*b:(j+1)*b] = x[block ids[j]] * scale[j], zero-padded past n."""
    _check(x, np.float32, "gather_blocks x")
    _check(out, np.float32, "gather_blocks out", ids.shape[0] * b)
    if ids.shape[0]:
        kern = _gather_blocks if _parallel(out.shape[0]) else _gather_blocks_serial
        kern(x, np.int64(b), ids, scale, out)
    return out


def scatter_blocks(vals: np.ndarray, b: int, ids: np.ndarray, out: np.ndarray, add: bool) -> None:
    """out[block ids[j]] (+)= vals[j*b:...]; ids must be distinct and < m (validate payloads first)."""
    _check(out, np.float32, "scatter_blocks out")
    if vals.shape[0] != ids.shape[0] * b:
        raise ValueError(f"scatter_blocks: {vals.shape[0]} values for {ids.shape[0]} blocks of {b}")
    if ids.shape[0]:
        if vals.dtype != np.float32:  # Numba has no float16 arrays: widen the (small) payload
            vals = vals.astype(np.float32)
        kern = _scatter_blocks if _parallel(vals.shape[0]) else _scatter_blocks_serial
        kern(np.ascontiguousarray(vals), np.int64(b), np.ascontiguousarray(ids), out, add)


@njit("void(float32[::1], int64, int64[::1], int64[::1], float32[::1], float32)", cache=True)
def _sum_blocks(out, b, ids, off, vals, d):
    # One ascending sweep over ``out``: the gaps between kept blocks are zeroed, each kept block is
    # 0.0 + rank 0's values + rank 1's ... (the ranks that kept it, in rank order: the additions a
    # fill(0) and one scatter-add per rank make), then divided by d (d = 0: not divided). Each
    # rank's ids are distinct and ascending (validated payloads), so a cursor per rank merges them.
    n = out.shape[0]
    world = off.shape[0] - 1
    pos = off[:world].copy()
    acc = np.empty(b, np.float32)
    done = 0  # out[:done] is final
    while True:
        j = np.int64(-1)
        for r in range(world):
            if pos[r] < off[r + 1]:
                c = ids[pos[r]]
                if j < 0 or c < j:
                    j = c
        if j < 0:
            break
        lo = j * b
        hi = min(n, lo + b)
        # loops from 0 over views (see above: they vectorise; the gap's zeroing becomes a memset)
        gap = out[done:lo]
        for i in range(gap.shape[0]):
            gap[i] = 0.0
        # the block is summed in ``acc`` and stored once: reading out back right after writing it
        # waited for its cache line from memory at every block (3x slower at 4 nodes, 11.7M)
        w = hi - lo
        for i in range(w):
            acc[i] = 0.0
        for r in range(world):
            p = pos[r]
            if p < off[r + 1] and ids[p] == j:
                src = vals[p * b:p * b + w]
                for i in range(w):
                    acc[i] = acc[i] + src[i]
                pos[r] = p + 1
        blk = out[lo:hi]
        if d != 0.0:
            for i in range(w):
                blk[i] = acc[i] / d
        else:
            for i in range(w):
                blk[i] = acc[i]
        done = hi
    rest = out[done:]
    for i in range(rest.shape[0]):
        rest[i] = 0.0


def sum_blocks(out: np.ndarray, b: int, ids: list[np.ndarray], vals: list[np.ndarray], divide_by: float = 0.0) -> None:
    """``out`` = the sum of every rank's kept blocks (``ids[r]``: distinct, ascending, < m;
    ``vals[r]``: their values, b per id, float32 or float16) in rank order, zero elsewhere, divided
    by ``divide_by`` unless it is 0, in one pass over ``out``. Bit-identical to ``out.fill(0)``,
    :func:`scatter_blocks` with ``add=True`` per rank in rank order, then ``np.divide(out,
    float32(divide_by))`` (0 / d is +0.0), without the two further passes over the whole array and
    the random visits of each rank's blocks (11.7M float32, 4 nodes: the fill, four scatters and
    the division were 29% of a BIRD+ round's ring thread)."""
    _check(out, np.float32, "sum_blocks out")
    if len(ids) != len(vals):
        raise ValueError(f"sum_blocks: {len(ids)} id arrays for {len(vals)} value arrays")
    m = -(-out.shape[0] // b)
    for i, v in zip(ids, vals):
        if v.shape[0] != i.shape[0] * b:
            raise ValueError(f"sum_blocks: {v.shape[0]} values for {i.shape[0]} blocks of {b}")
        if i.shape[0] and (int(i[-1]) >= m):
            raise ValueError(f"sum_blocks: block id {int(i[-1])} outside [0, {m})")
    off = np.zeros(len(ids) + 1, np.int64)
    off[1:] = np.cumsum([i.shape[0] for i in ids])
    all_ids = np.concatenate([np.asarray(i).astype(np.int64, copy=False) for i in ids]) if ids else np.zeros(0, np.int64)
    all_vals = (np.concatenate([np.asarray(v).astype(np.float32, copy=False) for v in vals]) if vals
                else np.zeros(0, np.float32))
    _sum_blocks(out, np.int64(b), all_ids, off, all_vals, np.float32(divide_by))


def gather_subtract(v: np.ndarray, u: np.ndarray | None, b: int, ids: np.ndarray, scale: np.ndarray,
                    out: np.ndarray) -> np.ndarray:
    """:func:`gather_blocks` from the error-feedback accumulator ``v`` followed by
    :func:`subtract_sent` of the float32 values gathered (v keeps v - sent, u is cleared on the
    sent blocks), in one visit of each kept block; bit-identical to the two calls."""
    _check(v, np.float32, "gather_subtract v")
    _check(out, np.float32, "gather_subtract out", ids.shape[0] * b)
    if u is None:
        u = np.empty(0, np.float32)
    if ids.shape[0]:
        kern = _gather_subtract if _parallel(out.shape[0]) else _gather_subtract_serial
        kern(v, u, np.int64(b), ids, scale, out)
    return out


def subtract_sent(v: np.ndarray, u: np.ndarray | None, b: int, ids: np.ndarray, sent: np.ndarray) -> None:
    if u is None:
        u = np.empty(0, np.float32)
    if ids.shape[0]:
        _subtract_sent(v, u, np.int64(b), ids, np.ascontiguousarray(sent))


def distinct_ascending(ids: np.ndarray, m: int) -> bool:
    return bool(_distinct_ascending(np.ascontiguousarray(ids), np.int64(m)))


@njit("void(float32[::1], float32[::1])", cache=True)
def _importance(imp, out):
    # shared mode: blocks never observed (imp < 0) count as the mean of the observed ones
    # (1 when none is observed yet: uniform). Sequential float64 sum: identical on every node.
    s = 0.0
    c = 0
    for i in range(imp.shape[0]):
        if imp[i] >= 0.0:
            s += np.float64(imp[i])
            c += 1
    fill = np.float32(s / c) if c > 0 else np.float32(1.0)
    if c > 0 and not (fill > 0.0):
        fill = np.float32(1.0)
    for i in range(imp.shape[0]):
        out[i] = imp[i] if imp[i] >= 0.0 else fill


def importance(imp: np.ndarray) -> np.ndarray:
    _check(imp, np.float32, "importance imp")
    out = np.empty(imp.shape[0], np.float32)
    _importance(imp, out)
    return out


# -- shared mode: the proposal of the next round's blocks (docs/codecs.md, "shared mode") -----------
# These run on K (about 1% of m) values or once over the m norms, on the proposing node only
# (top_blocks) or on every node with identical inputs (decode_ids, uniform_blocks): NumPy and the
# radix select of birdnet.kernels.sparse, no new Numba kernels.

def top_blocks(a: np.ndarray, k: int) -> np.ndarray:
    """Ascending ids of the ``k`` largest block norms of float32 ``a`` (ties by lower id; NaN ranks
    above +Inf above every finite norm, as in the local selection), zero norms never."""
    from birdnet.kernels import sparse

    _check(a, np.float32, "top_blocks a")
    ids, vals = sparse.topk(a, int(k))
    return ids[vals != 0.0]


def residual_norms(norms: np.ndarray, ids: np.ndarray, scale: np.ndarray) -> None:
    """In place: the norms of the kept blocks after ``v -= scale * v`` (|1 - scale| times theirs),
    i.e. what is left on this node after the send (NaN/Inf stay non-finite)."""
    _check(norms, np.float32, "residual_norms norms")
    if ids.shape[0]:
        norms[ids] = norms[ids] * np.abs(np.float32(1.0) - scale.astype(np.float32))


def encode_ids(ids: np.ndarray, base: int, digits: int, out: np.ndarray) -> None:
    """out[j*digits + i] = digit i (least significant first, base ``base``) of ids[j] + 1 as float32;
    slots after len(ids) are 0 (empty). Every digit is an integer below ``base``, exact in the wire
    dtype, so adding the zeros of the other nodes keeps it."""
    _check(out, np.float32, "encode_ids out")
    nslot = out.shape[0] // digits
    if ids.shape[0] > nslot:
        raise ValueError(f"encode_ids: {ids.shape[0]} ids for {nslot} slots")
    out[:] = 0.0
    v = ids.astype(np.int64) + 1
    o = out.reshape(nslot, digits)
    for i in range(digits):
        o[:v.shape[0], i] = (v % base).astype(np.float32)
        v //= base


def decode_ids(tail: np.ndarray, base: int, digits: int, m: int) -> np.ndarray | None:
    """The distinct ascending ids encoded by :func:`encode_ids` in the summed ``tail`` (empty slots
    skipped), or None when it holds anything but whole digits below ``base`` or ids beyond ``m``
    (the bytes come from the network)."""
    if tail.shape[0] % digits:
        return None
    d = tail.reshape(-1, digits).astype(np.float64)
    if not np.all(np.isfinite(d)) or np.any(d < 0) or np.any(d >= base) or np.any(d != np.floor(d)):
        return None
    v = np.zeros(d.shape[0], np.int64)
    for i in reversed(range(digits)):
        v = v * base + d[:, i].astype(np.int64)
    v = v[v != 0]
    if v.shape[0] and int(v.max()) > m:
        return None
    return np.unique(v - 1)


def uniform_blocks(seed: int, m: int, k: int) -> np.ndarray:
    """``k`` ascending block ids, one drawn uniformly in each of k equal strata of [0, m), from the
    cluster seed: the shared selection of a tensor's first round, identical on every node."""
    from birdnet.kernels import sparse

    return sparse.randomk_indexes(seed, m, k)[0]


def finite_max(a: np.ndarray) -> float:
    """The largest finite value of non-negative float32 ``a`` (0.0 when there is none)."""
    _check(a, np.float32, "finite_max a")
    return float(_finite_max_any(a))
