"""Training-process stand-ins run by tests in spawned processes (module-level so spawn can import them)."""
from __future__ import annotations

import numpy as np
from birdnet.client import Client


def fill_sum(sock, node, local, sizes, job="default"):
    """allreduce(sum) of np.full(n, global rank + 1) for each n; returns results."""
    with Client(sock, job=job) as c:
        return [c.allreduce(np.full(n, c.rank + 1, np.float32), op="sum", name=f"t{n}") for n in sizes]


def random_mean(sock, node, local, n, seed, dtype="float32", rounds=1, codec=None, params=None):
    with Client(sock) as c:
        rng = np.random.default_rng(seed + 1000 * c.rank)
        outs, inputs, stats = [], [], []
        for _i in range(rounds):
            x = rng.standard_normal(n).astype(dtype)
            h = c.allreduce_async(x, name="w", codec=codec, **(params or {}))
            outs.append(h.wait(60))
            inputs.append(x)
            stats.append(h.stats)
        return {"rank": c.rank, "size": c.size, "inputs": inputs, "outs": outs, "stats": stats}


def expect_error(sock, node, local, shape_by_node=None, dtype_by_node=None, name="x"):
    """Submit a tensor whose shape/dtype may differ by node; return (error class name, message) or None."""
    with Client(sock) as c:
        shape = shape_by_node[node] if shape_by_node else (10,)
        dtype = dtype_by_node[node] if dtype_by_node else "float32"
        try:
            c.allreduce(np.ones(shape, dtype), name=name, timeout=30)
        except Exception as exc:  # noqa: BLE001
            err = (type(exc).__name__, str(exc))
        else:
            err = None
        # the daemon keeps serving: the next round works
        ok = c.allreduce(np.ones(5, np.float32), op="sum", name="after", timeout=30)
        return err, ok.tolist()


def collectives(sock, node, local):
    with Client(sock) as c:
        b = c.broadcast(np.full(6, float(c.rank), np.float64), root=c.size - 1)
        c.barrier(timeout=30)
        f16 = c.allreduce(np.full(4, 1.5, np.float16), op="mean")
        f64 = c.allreduce(np.full(3, c.rank, np.float64), op="sum")
        i64 = c.allreduce(np.arange(4, dtype=np.int64), op="sum")
        buf = c.buffer((7,), np.float32)
        buf[:] = c.rank
        r = c.allreduce(buf, op="sum")
        handles = [c.allreduce_async(np.full(100, i, np.float32), op="sum", name=f"a{i}") for i in range(3)]
        asyncs = [h.wait(30) for h in handles]
        c.reset_state()
        return {"rank": c.rank, "size": c.size, "b": b, "f16": f16, "f64": f64, "i64": i64, "buf": r,
                "buf_same_memory": bool(np.shares_memory(r, buf)), "asyncs": asyncs,
                "status": c.status()}


def nan_round(sock, node, local):
    with Client(sock) as c:
        x = np.ones(2000, np.float32)
        if c.rank == 0:
            x[3] = np.nan
        try:
            out = c.allreduce(x, name="grad.nan", timeout=30)
            return ("ok", bool(np.isnan(out[3])), float(out[4]))
        except Exception as exc:  # noqa: BLE001
            return ("error", type(exc).__name__, str(exc))


def codec_rounds(sock, node, local, specs, n, rounds):
    """For each (codec, params): ``rounds`` all-reduces (sum) of seeded data; returns inputs,
    outputs and stats so the test can check bounds and bit-identity."""
    out = {}
    with Client(sock, job="codecs") as c:
        for name, params in specs:
            rng = np.random.default_rng(100 + c.rank)
            res = []
            for _r in range(rounds):
                x = (rng.standard_normal(n) * np.linspace(0.01, 3, n)).astype(np.float32)
                h = c.allreduce_async(x, op="sum", name=f"{name}/t", codec=name, **params)
                res.append((x, h.wait(60), h.stats))
            c.reset_state()
            out[name + repr(sorted(params.items()))] = res
    return out


def nan_then_clean_rounds(sock, node, local, specs, n, rounds):
    """For each (codec, params): one clean call, one with a NaN on rank 0, ``rounds`` clean calls;
    returns the results (the daemons' default nan_policy, "propagate")."""
    out = {}
    with Client(sock, job="nan") as c:
        for name, params in specs:
            rng = np.random.default_rng(7 + c.rank)
            res = []
            for r in range(rounds + 2):
                x = rng.standard_normal(n).astype(np.float32)
                if r == 1 and c.rank == 0:
                    x[n // 3] = np.nan
                res.append(c.allreduce(x, name=f"{name}/t", codec=name, timeout=60, **params))
            c.reset_state()
            out[name + repr(sorted(params.items()))] = res
    return out


def batch_of_async_rounds(sock, node, local, count, bad_index):
    """``count`` all-reduces in flight at once; on node 2 the one at ``bad_index`` has another
    shape. Returns per-round (ok, value-or-error) and the daemon's status."""
    with Client(sock) as c:
        c.barrier()
        hs = []
        for i in range(count):
            n = 1001 + i if not (i == bad_index and node == 2) else 999
            hs.append(c.allreduce_async(np.full(n, float(i), np.float32), op="sum", name=f"b{i}"))
        out = []
        for h in hs:
            try:
                out.append(("ok", float(h.wait(60)[0])))
            except Exception as exc:  # noqa: BLE001
                out.append((type(exc).__name__, str(exc)))
        return out, c.status()


#: lane_rounds' compressed plan entries: codec and parameters
LANE_CODECS = {"marsit": ("marsit", {}), "marsit_flush": ("marsit", {"flush": 2}),
               "birdplus": ("birdplus", {"density": 0.01}),
               "birdplus_shared": ("birdplus", {"density": 0.01, "mode": "shared"})}


def lane_rounds(sock, node, local, plan, n=1000, job="default", delay_before=None, bad=None, bad_codec=None):
    """Calls one after another, as a training loop makes them: ``plan`` is a list of "dense",
    "barrier" or a compressed entry of LANE_CODECS; each all-reduce is the mean of seeded random
    data (the same seeds on every node, so the caller can recompute it). ``delay_before`` = (node,
    call index, seconds): that node sleeps before that call. ``bad`` = (node, call index): that node
    submits another shape there; ``bad_codec`` likewise another density.
    Returns [(kind, result or (error class, message))], and the daemon's status."""
    import time
    with Client(sock, job=job) as c:
        out = []
        for i, what in enumerate(plan):
            if delay_before is not None and delay_before[0] == node and delay_before[1] == i:
                time.sleep(delay_before[2])
            try:
                if what == "barrier":
                    c.barrier()
                    out.append(("ok", None))
                    continue
                size = n - 1 if bad is not None and bad == (node, i) else n
                x = np.random.default_rng([i, c.rank]).standard_normal(size).astype(np.float32)
                codec, params = LANE_CODECS.get(what, (None, {}))
                if bad_codec is not None and bad_codec == (node, i):
                    params = {**params, "density": 0.02}
                name = f"{job}-w" if codec is None else f"{job}-{what}"  # its own codec state
                out.append(("ok", c.allreduce(x, name=name, codec=codec, timeout=60, **params)))
            except Exception as exc:  # noqa: BLE001 - the test looks at the class and message
                out.append((type(exc).__name__, str(exc)))
        return out, c.status()


def mixed_paths(sock, node, local, count, long_every=3):
    """``count`` sum all-reduces in flight at once, every ``long_every``-th with a name too long for
    one atomic write into the submit FIFO, so that call goes over the socket while its neighbours
    go through the FIFO (the two can reach the daemon in either order). Returns the first element
    of each result and how many calls took each path."""
    with Client(sock) as c:
        c.barrier()
        paths = {"fifo": 0, "socket": 0}
        if c._conn.bell is not None:
            orig = c._conn.bell.send

            def counting(h):
                ok = orig(h)
                paths["fifo" if ok else "socket"] += h.get("t") == "submit"
                return ok
            c._conn.bell.send = counting
        hs = []
        for i in range(count):
            name = ("long-" * 1000 + str(i)) if i % long_every == 0 else f"m{i}"
            hs.append(c.allreduce_async(np.full(257, float(i), np.float32), op="sum", name=name))
        return [float(h.wait(60)[0]) for h in hs], paths


def steady_calls(sock, node, local, calls, n):
    """``calls`` sum all-reduces of ``n`` ones, one after another as a training loop makes them;
    per call (outcome, first element or error message, seconds). A failed call does not stop it."""
    import time
    out = []
    with Client(sock) as c:
        c.barrier(timeout=30)
        x = np.ones(n, np.float32)
        for _ in range(calls):
            t = time.monotonic()
            try:
                r = c.allreduce(x, op="sum", name="g", timeout=60)
                ok = bool(np.all(r == r[0]))
                out.append(("ok" if ok else "uneven", float(r[0]), time.monotonic() - t))
            except Exception as exc:  # noqa: BLE001 - the outcome is what the test looks at
                out.append((type(exc).__name__, str(exc), time.monotonic() - t))
    return out


def held_results(sock, node, local, n, kept):
    """Results of ``allreduce`` with the process's own arrays, ``kept`` of them held at once (each
    through a view), then a loop that drops each result at the next call; the sums are exact, so
    a result overwritten by a later call shows. Returns what the test checks."""
    from birdnet.client import RESULT_SLOTS
    with Client(sock) as c:
        held, views, in_slot = [], [], []
        for i in range(kept):
            x = np.full(n, c.rank + 1 + 10 * i, np.float32)
            r = c.allreduce(x, op="sum", name=f"held{i}", timeout=60)
            held.append(r)
            views.append(r[1:])  # a view alone must keep the slot too
            in_slot.append(any(np.shares_memory(r, s.memory) for s in c._pool.slots.values()))
        del held[:2]  # only views left of the first two
        slots_after_held = len(c._pool.slots)
        prev = None
        for i in range(6):
            x = np.full(n, c.rank + 1 + 10 * (kept + i), np.float32)
            out = c.allreduce(x, op="sum", name="loop", timeout=60)
            if prev is not None:
                assert prev is not out
            prev = out
        loop_value = float(prev[0])
        return {"size": c.size, "views": [v.copy() for v in views], "in_slot": in_slot,
                "slots_after_held": slots_after_held, "slots_after_loop": len(c._pool.slots),
                "loop_value": loop_value, "result_slots": RESULT_SLOTS}


def first_compressed_rounds(sock, node, local, specs, n, rounds, timeout):
    """The job's first calls with each (codec, params), ``rounds`` each; returns the results, or
    the first error as (class name, message), and each call's seconds."""
    import time
    out = []
    with Client(sock, job="first") as c:
        rng = np.random.default_rng(7 + c.rank)
        for name, params in specs:
            for r in range(rounds):
                x = rng.standard_normal(n).astype(np.float32)
                t0 = time.monotonic()
                try:
                    y = c.allreduce(x, name=f"{name}/w", codec=name, timeout=timeout, **params)
                except Exception as exc:  # noqa: BLE001 - reported to the test
                    return {"error": (type(exc).__name__, str(exc)), "out": out}
                out.append((name, r, y, time.monotonic() - t0))
    return {"error": None, "out": out}


def small_tensor_rounds(sock, node, local, sizes):
    """Sums of tensors under the daemons' dense_threshold, naming codec fp16, topk, or none (the
    daemons' default): returns per (size, codec) the result and the round's stats."""
    out = {}
    with Client(sock, job="small") as c:
        for n in sizes:
            x = (np.arange(n, dtype=np.float32) + 1) / np.float32(3) + c.rank  # thirds: not float16 values
            for codec, params in (("fp16", {}), ("topk", {"density": 0.1}), (None, {})):
                h = c.allreduce_async(x, op="sum", name=f"small/{n}/{codec}", codec=codec, **params)
                out[(n, codec)] = (x, h.wait(60), h.stats)
    return out
