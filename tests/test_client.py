"""birdnet.client's parts: a lost session is seen by its error class, slots on birdnet.shm.Segment."""
from __future__ import annotations

import os

import numpy as np
import pytest
from birdnet.client import Client
from birdnet.client._slots import Slot
from cluster import LocalCluster

from birdnet.errors import DaemonUnavailableError, ProtocolError, SessionLostError, from_wire, to_wire
from birdnet.shm import Segment, new_name


def test_session_lost_travels_as_its_own_class():
    err = from_wire(to_wire(SessionLostError("no session: send hello first")))
    assert type(err) is SessionLostError and isinstance(err, ProtocolError)
    # the text alone is not what the client goes by: another class with the same words is not it
    assert not isinstance(from_wire({"error": "ProtocolError", "message": "no session: x"}), SessionLostError)


@pytest.mark.timeout(120)
def test_a_session_the_daemon_ended_is_lost_then_the_next_call_reconnects(tmp_path):
    """A second hello of the same job from the same process ends the first one's session (the
    daemon takes it for a restarted process); the first client's next request is refused with
    SessionLostError, which it reports as the daemon not knowing it any more, and the call after
    that connects again."""
    with LocalCluster(1, tmp_path) as cl:
        a = Client(cl.sockets[0], job="forgot")
        try:
            assert a.allreduce(np.ones(4, np.float32), timeout=30).tolist() == [1.0] * 4
            b = Client(cl.sockets[0], job="forgot")
            b.close()
            with pytest.raises(DaemonUnavailableError, match="no longer knows this process"):
                a.allreduce(np.ones(1 << 16, np.float32), timeout=30)  # a bigger slot: an alloc the daemon refuses
            assert not a.connected
            assert a.allreduce(np.full(3, 2.0, np.float32), timeout=30).tolist() == [2.0] * 3
            assert a.connected
        finally:
            a.close()


def test_slot_maps_a_segment_and_knows_when_a_result_is_held():
    seg = Segment(new_name("bntestslot-"), 4096, create=True, mode=0o600)
    try:
        s = Slot(0, seg.name, 4096)
        try:
            assert not s.held()
            r = s.view((4, 8), np.dtype(np.float32))
            r[:] = 3.0
            assert np.frombuffer(seg.buf, np.float32, 32).tolist() == [3.0] * 32  # the same memory
            assert s.held()
            v = r[1:]  # a view alone keeps the slot held
            del r
            assert s.held()
            del v
            assert not s.held()
            x = s.view((10,), np.dtype(np.float64))
            assert s.starts(x) and not s.starts(x[1:])
            del x
            s.close()
        finally:
            s.close()
        # a file put in the segment's place (another inode) is refused
        with pytest.raises(DaemonUnavailableError, match="not the segment"):
            Slot(0, seg.name, 4096, inode=os.stat(seg.path).st_ino + 1)
        with pytest.raises(DaemonUnavailableError, match="not the segment"):
            Slot(0, seg.name, 8192)  # larger than the file
    finally:
        seg.unlink()
        seg.close()
