"""Settlement of a round whose commit cannot finish (daemon/settle.py): the rule over every case,
the book's frozen answers, bad answers, and real daemons with one killed inside the commit window."""
from __future__ import annotations

import itertools
import time

import pytest
import zmq
from birdnet.daemon.settle import (
    ABORTED,
    FAULT_ENV,
    FAULT_EXIT_STATUS,
    HOLDS,
    MAX_ASKED_KEPT,
    MAX_ROUNDS_KEPT,
    PENDING,
    RELEASED,
    Report,
    SettleBook,
    chain,
    decide,
    final,
)
from cluster import LocalCluster, wait_ring_ok
from test_faults import PEER_TIMEOUT, drivers, together  # noqa: F401 - the fixture

from birdnet import wire
from birdnet.errors import ProtocolError

pytestmark = pytest.mark.heavy  # CI runs it on the default Python only (.ci/run)


# -- the rule ----------------------------------------------------------------------------------------
def _all_reports(world: int):
    """Every combination of answers a settler can hold for a ``world``-node ring: each rank absent
    (no answer), released, aborted, or holding / pending with each commit count its left could have
    sent (0 .. world - 1)."""
    options: list[list[Report | None]] = []
    for r in range(world):
        opts: list[Report | None] = [None, Report(RELEASED), Report(ABORTED)]
        for c in range(world):
            opts.append(Report(HOLDS, chain(r, world, c) | {r}))
            opts.append(Report(PENDING, chain(r, world, c)))
        options.append(opts)
    for combo in itertools.product(*options):
        yield {r: p for r, p in enumerate(combo) if p is not None}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_rule_over_every_combination_of_answers(world):
    n = 0
    for reports in _all_reports(world):
        if not reports:
            continue
        n += 1
        commit, why = decide(reports, world)
        states = {p.state for p in reports.values()}
        known = set().union(*(p.known for p in reports.values()))
        # a release anywhere is never contradicted: it proves every node held the result
        if RELEASED in states:
            assert commit, (reports, why)
        elif ABORTED in states:
            assert not commit, (reports, why)  # a node that failed it never held it (or settled it failed)
        else:
            # commit only with the proof that every node held the result (nobody can have released otherwise)
            assert commit == (known == set(range(world))), (reports, why)
        # the order the answers came in does not matter
        assert decide(dict(reversed(list(reports.items()))), world) == (commit, why)
        # stopping early at a release or an abort: the answers still missing (holding, pending)
        # cannot change the decision
        if final(reports):
            for r in set(range(world)) - set(reports):
                for extra in (Report(HOLDS, frozenset(range(world))), Report(PENDING)):
                    assert decide({**reports, r: extra}, world)[0] == commit
    assert n > 10


def test_a_decided_settler_carries_its_decision_to_a_later_one():
    """Two survivors that heard the same nodes decide the same, also when the second hears the
    first's decision instead of its frozen answer."""
    world = 4
    for reports in _all_reports(world):
        if 0 not in reports or 1 not in reports or reports[0].state in (RELEASED, ABORTED):
            continue
        commit, _ = decide(reports, world)
        decided = Report(RELEASED if commit else ABORTED)
        assert decide({**reports, 0: decided}, world)[0] == commit


def test_chain_is_the_consecutive_nodes_before():
    assert chain(0, 4, 0) == frozenset()
    assert chain(0, 4, 1) == {3}
    assert chain(0, 4, 3) == {3, 2, 1}
    assert chain(2, 4, 9) == {1, 0, 3}  # at most world - 1


# -- the book ----------------------------------------------------------------------------------------
def test_the_book_freezes_the_first_answer_and_keeps_decisions():
    counts = {"j/1": 1}
    b = SettleBook(rank=1, world=3, count=lambda k: counts.get(k, 0))
    b.holding("j/1")
    assert not b.frozen("j/1")
    first = b.report("j/1")
    assert first == Report(HOLDS, frozenset({1, 0}))
    counts["j/1"] = 2  # a count that comes after the question changes nothing
    assert b.report("j/1") == first and b.frozen("j/1")
    b.released("j/1")
    assert b.report("j/1") == Report(RELEASED) and not b.frozen("j/1")
    b.aborted("j/1")  # never overrides a release
    assert b.report("j/1") == Report(RELEASED)
    # asked about a round before running it: pending, frozen; holding it later keeps that answer
    assert b.report("j/2") == Report(PENDING)
    b.holding("j/2")
    assert b.frozen("j/2") and b.report("j/2") == Report(PENDING)
    b.aborted("j/3")
    assert b.report("j/3") == Report(ABORTED)
    # a new run of the job (its processes restarted) numbers its calls from 0 again: the same key
    # starting again here forgets the earlier run's decision
    b.started("j/1")
    assert b.report("j/1").state == PENDING
    b.started("j/2")  # a question of this run before the round started here stays frozen
    assert b.frozen("j/2")


def test_the_book_is_bounded_and_questions_cannot_push_out_the_rounds_it_ran():
    b = SettleBook(rank=0, world=2, count=lambda k: 0)
    b.released("j/0")
    for i in range(10 * MAX_ASKED_KEPT):
        b.report(f"x/{i}")
    assert b.report("j/0") == Report(RELEASED)
    assert len(b._asked) == MAX_ASKED_KEPT
    for i in range(2 * MAX_ROUNDS_KEPT):
        b.released(f"j/{i}")
    assert len(b._ran) == MAX_ROUNDS_KEPT


@pytest.mark.parametrize("header", [
    {"st": "won"}, {"st": RELEASED, "kn": "all"}, {"st": HOLDS, "kn": [0, 9]}, {"st": HOLDS, "kn": [True]},
    {"st": HOLDS, "kn": list(range(100))}, {"st": None, "kn": []}, {"kn": [0]},
])
def test_a_malformed_answer_is_a_protocol_error(header):
    with pytest.raises(ProtocolError):
        Report.from_header(header, 3)


# -- real daemons --------------------------------------------------------------------------------------
@pytest.mark.timeout(150)
@pytest.mark.parametrize("restart", [True, False], ids=["restarted", "stays-dead"])
def test_a_daemon_dying_inside_the_commit_splits_no_call(tmp_path, drivers, monkeypatch, restart):  # noqa: F811
    """Daemon 1 of 3 exits inside call 1's commit, after it passed count 1 on and before it passes
    count 2 (the one that releases daemon 2): daemon 0 has released the call, daemon 2 waits for a
    count that will never come. Before settlement daemon 2 failed the call (at once when daemon 1
    restarted, else at round_timeout) while daemon 0's process had its result: a split. Now daemon 2
    asks the others, learns daemon 0 released, and releases too: at once when daemon 1 is back, and
    when it stays dead as soon as it is counted lost (peer_timeout; it waited round_timeout, 20 s
    here, before)."""
    monkeypatch.setenv(FAULT_ENV, "exit-in-commit:1:default/1")
    with LocalCluster(3, tmp_path, extra=["--round-timeout", "20"]) as cl:
        monkeypatch.delenv(FAULT_ENV)  # a restarted daemon 1 does not exit again
        d = [drivers(s) for s in cl.sockets]
        assert [r.get("ok") for r in together(d, "round 1000")] == [6.0] * 3
        t = time.monotonic()
        for x in d:
            x.send("round 1000")
        assert cl.procs[1].wait(30) == FAULT_EXIT_STATUS, cl.log(1)[-3000:]
        if restart:
            cl.start_node(1)
        res = [x.read(40) for x in d]
        took = time.monotonic() - t
        assert res[1].get("error") == "DaemonUnavailableError", res
        # the survivors agree, and on the result: daemon 0 had released it
        assert res[0].get("ok") == 6.0 and res[2].get("ok") == 6.0, (res, cl.log(2)[-3000:])
        assert "settled among the surviving nodes: commit" in cl.log(2), cl.log(2)[-3000:]
        # without a restart daemon 2 settles once daemon 1 is counted lost (peer_timeout), not at
        # the commit's deadline (round_timeout, 20 s)
        assert took < PEER_TIMEOUT + 8, (took, res)
        if not restart:
            cl.start_node(1)
            wait_ring_ok(cl, timeout=30)  # it was counted lost: every node sees it back first
        # the lane granted before the fault is closed: at most the next call fails, on every node
        # alike and at once (no node runs a lane round the others abandoned, waiting round_timeout)
        after = []
        for _ in range(3):
            res = together(d, "round 1000")
            assert len({"ok" if r.get("ok") == 6.0 else "failed" for r in res}) == 1, res
            assert all(r.get("error") != "RoundTimeoutError" and r["seconds"] < 10 for r in res), res
            after.append(res)
        assert [r[0].get("ok") for r in after[1:]] == [6.0, 6.0], after


@pytest.mark.timeout(120)
def test_a_start_lost_with_a_restarted_daemon_fails_the_call_at_once(tmp_path, drivers, monkeypatch):  # noqa: F811
    """Daemon 1 of 3 exits as the leader's start of call 0 reaches it, before passing it on, and is
    restarted at once (within peer_timeout: nobody counts it lost). The leader waits for its start to
    come back: it saw only its left neighbour's restarts, so it waited round_timeout (20 s here),
    holding every node's call. Now it sees its right neighbour's new incarnation in a pong: the call
    fails at once on every surviving node (not with RoundTimeoutError), and the next one succeeds."""
    monkeypatch.setenv(FAULT_ENV, "exit-on-start:1:default/0")
    with LocalCluster(3, tmp_path, extra=["--round-timeout", "20"]) as cl:
        monkeypatch.delenv(FAULT_ENV)  # a restarted daemon 1 does not exit again
        d = [drivers(s) for s in cl.sockets]
        t = time.monotonic()
        for x in d:
            x.send("round 1000")
        assert cl.procs[1].wait(30) == FAULT_EXIT_STATUS, cl.log(1)[-3000:]
        cl.start_node(1)
        res = [x.read(40) for x in d]
        took = time.monotonic() - t
        assert res[1].get("error") == "DaemonUnavailableError", res
        for r in (res[0], res[2]):
            assert r.get("error") in ("PeerLostError", "RoundAborted"), (res, cl.log(0)[-3000:])
        assert took < PEER_TIMEOUT + 6, (took, res)  # round_timeout is 20 s
        assert [r.get("ok") for r in together(d, "round 1000")] == [6.0] * 3


@pytest.mark.timeout(120)
def test_a_daemon_stopped_inside_the_commit_is_waited_for_and_agrees_when_it_continues(
        tmp_path, drivers, monkeypatch):  # noqa: F811
    """Daemon 1 of 3 stops (SIGSTOP) as call 1's commit begins there, before it passes a count on;
    the count that would release it (2, from daemon 0) is queued for it. Daemon 2 counts it lost
    after peer_timeout and settles with daemon 0, but cannot fail the call: daemon 0 sent daemon 1
    the releasing count, so daemon 1 may have returned the result (settle.abort_safe). Both wait
    for it. When it continues it stalled, so it does not release on the queued count alone but
    settles too, and all three return the same (no split)."""
    import signal
    monkeypatch.setenv(FAULT_ENV, "stop-in-commit:1:default/1")
    with LocalCluster(3, tmp_path, extra=["--round-timeout", "20"]) as cl:
        monkeypatch.delenv(FAULT_ENV)
        d = [drivers(s) for s in cl.sockets]
        assert [r.get("ok") for r in together(d, "round 1000")] == [6.0] * 3
        for x in d:
            x.send("round 1000")
        time.sleep(PEER_TIMEOUT + 3)
        assert "fault point stop-in-commit" in cl.log(1), cl.log(1)[-2000:]
        assert "not settled yet" in cl.log(2), cl.log(2)[-3000:]
        t = time.monotonic()
        cl.send_signal(1, signal.SIGCONT)
        res = [x.read(40) for x in d]
        assert time.monotonic() - t < 8, res  # round_timeout is 20 s
        assert len({"ok" if r.get("ok") == 6.0 else r.get("error") for r in res}) == 1, (res, cl.log(1)[-3000:])
        wait_ring_ok(cl, timeout=30)
        for _ in range(3):
            res = together(d, "round 1000")
            assert len({"ok" if r.get("ok") == 6.0 else "failed" for r in res}) == 1, res
        assert [r.get("ok") for r in res] == [6.0] * 3, res


def _answers(s: zmq.Socket, most: int, wait: float = 3.0) -> list[dict]:
    """The 'settled' answers that come on ``s`` (up to ``most``; the malformed questions get a 'refuse')."""
    out: list[dict] = []
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and len(out) < most:
        if s.poll(100):
            h, _ = wire.decode(s.recv_multipart(), max_bytes=wire.MAX_HEADER_BYTES)
            if h["t"] == "settled":
                out.append(h)
    return out


@pytest.mark.timeout(90)
def test_bad_settle_questions_do_not_hurt_the_daemon(tmp_path, drivers):  # noqa: F811
    """Questions from no rank, malformed keys and ranks, floods of made-up rounds: each is dropped or
    answered 'pending'; the daemons stay up and the next call gives the exact sum."""
    with LocalCluster(2, tmp_path) as cl:
        d = [drivers(s) for s in cl.sockets]
        assert [r.get("ok") for r in together(d, "round 1000")] == [3.0] * 2
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        port = int(cl.hosts.read_text().splitlines()[1].rsplit(":", 1)[1])
        s.connect(f"tcp://127.0.0.1:{port}")
        try:
            bad = [{"t": "settle", "k": "default/0", "rank": 0, "inc": "x"},  # its own rank
                   {"t": "settle", "k": "default/0", "rank": 7, "inc": "x"},
                   {"t": "settle", "k": "nokey", "rank": 1, "inc": "x"},
                   {"t": "settle", "k": "default/0", "rank": "1", "inc": "x"},
                   {"t": "settle", "rank": 1},
                   {"t": "settled", "k": "default/0", "rank": 1, "st": RELEASED, "kn": []}]
            for h in bad:
                s.send_multipart(wire.encode(h))
            for i in range(3 * MAX_ASKED_KEPT):
                s.send_multipart(wire.encode({"t": "settle", "k": f"made-up/{i}", "rank": 1, "inc": "x"}))
            flood = _answers(s, 3 * MAX_ASKED_KEPT)
            # answered 'pending' (replies beyond the connection's queue are dropped, not kept)
            assert flood and {a["st"] for a in flood} == {PENDING}, flood[:3]
            # the rounds it ran are still known: call 0 was released there
            s.send_multipart(wire.encode({"t": "settle", "k": "default/0", "rank": 1, "inc": "x"}))
            (last,) = _answers(s, 1)
            assert last["st"] == RELEASED and last["k"] == "default/0", last
        finally:
            s.close(0)
        for p in cl.procs:
            assert p.poll() is None
        assert [r.get("ok") for r in together(d, "round 1000")] == [3.0] * 2


def test_a_settler_drops_bad_answers_and_takes_the_good_one():
    """Garbage, wrong protocol, another round's or another rank's answer, a malformed report: dropped
    (logged), never raised; the well-formed answer after them is read."""
    from birdnet.daemon.settle import _read_answer
    ctx = zmq.Context.instance()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        for s in (server, client):
            s.setsockopt(zmq.LINGER, 0)
        server.bind("inproc://settle-answers")
        client.connect("inproc://settle-answers")
        client.send(b"hello")
        ident, _ = server.recv_multipart()
        good = {"t": "settled", "k": "j/4", "rank": 2, "st": HOLDS, "kn": [2, 1]}
        for frames in ([b"\x00garbage"], [b"birdnet/0", b"\x80"], wire.encode({**good, "k": "j/5"}),
                       wire.encode({**good, "rank": 1}), wire.encode({**good, "kn": [7]}),
                       wire.encode({**good, "t": "pong"}), wire.encode({**good, "st": "maybe"})):
            server.send_multipart([ident, *frames])
        time.sleep(0.1)
        assert _read_answer(client, 3, "j/4", 2) is None
        server.send_multipart([ident, *wire.encode(good)])
        time.sleep(0.1)
        assert _read_answer(client, 3, "j/4", 2) == Report(HOLDS, frozenset({1, 2}))
    finally:
        server.close(0)
        client.close(0)
