"""birdnet.client.torch on real daemons: 2 nodes x 1 training process (CPU tensors; the CUDA
staging path is not exercised: no GPU here)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch) for the PyTorch adapter")

from cluster import LocalCluster  # noqa: E402

STEPS = 5
BATCH = 16  # per process
LR, MOMENTUM, WD = 0.1, 0.9, 1e-3


def cnn():
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 6 * 6, 10))


def mlp():
    # every bucket below the daemon's dense_threshold (1024 elements): travels dense
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 8), torch.nn.Tanh(), torch.nn.Linear(8, 10))


def data(steps: int, world: int):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(steps, world * BATCH, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (steps, world * BATCH), generator=g)
    return x, y


def snapshot(model) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def reference(make, momentum: float, steps: int = STEPS, world: int = 2, scale: float = 1.0) -> list[dict[str, np.ndarray]]:
    """Single-process training on the concatenated batch of all processes (loss times ``scale``)."""
    torch.manual_seed(100)  # rank 0's initialisation, which broadcast_parameters hands to everyone
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum, weight_decay=WD)
    x, y = data(steps, world)
    out = []
    for s in range(steps):
        opt.zero_grad()
        (scale * torch.nn.functional.cross_entropy(model(x[s]), y[s])).backward()
        opt.step()
        out.append(snapshot(model))
    return out


def train(client, bnt, make, *, momentum_in_codec=False, codec=None, codec_params=None, passes=1):
    torch.manual_seed(100 + client.rank)  # different on purpose: broadcast_parameters must fix it
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    opt = bnt.DistributedOptimizer(opt, named_parameters=model.named_parameters(), client=client,
                                   bucket_bytes=1024, codec=codec, codec_params=codec_params,
                                   momentum_in_codec=momentum_in_codec, timeout=60,
                                   backward_passes_per_step=passes)
    bnt.broadcast_parameters(model.state_dict(), root_rank=0, client=client)
    x, y = data(STEPS, client.size)
    lo, _hi = client.rank * BATCH, (client.rank + 1) * BATCH
    snaps, stats, grad_in_shm = [], [], []
    for s in range(STEPS):
        opt.zero_grad(set_to_none=(s % 2 == 0))  # both: fresh .grad tensors, and in-place into the buckets
        for k in range(passes):  # gradient accumulation: the halves' gradients add up locally
            part = slice(lo + k * BATCH // passes, lo + (k + 1) * BATCH // passes)
            torch.nn.functional.cross_entropy(model(x[s, part]), y[s, part]).backward()
        opt.step()
        snaps.append(snapshot(model))
        stats.append(opt.last_stats)
    grad_in_shm = [any(p.grad.data_ptr() == v.data_ptr() for b in opt._bn_buckets for v in b.views.values())
                   for p in model.parameters()]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    opt.remove_hooks()
    return {"snaps": snaps, "stats": stats, "grad_in_shm": grad_in_shm, "groups": groups,
            "buckets": [b.name for b in opt._bn_buckets]}


def optimizer_state(client, bnt):
    """Root restores a 'checkpoint' (state after a local step, its own lr); the others start fresh."""
    torch.manual_seed(3)
    model = cnn()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    if client.rank == 0:
        x, y = data(1, 1)
        torch.nn.functional.cross_entropy(model(x[0]), y[0]).backward()
        opt.step()
        opt.param_groups[0]["lr"] = 0.123
    bnt.broadcast_optimizer_state(opt, root_rank=0, client=client)
    sd = opt.state_dict()
    return {"groups": [{k: v for k, v in g.items()} for g in sd["param_groups"]],
            "state": {i: {k: v.numpy().copy() for k, v in st.items()} for i, st in sd["state"].items()}}


def worker(sock, node, local):
    torch.set_num_threads(1)
    import birdnet.client.torch as bnt
    from birdnet.client import Client
    with Client(sock, job="torch-test") as client:
        dense = train(client, bnt, cnn)
        tiny = train(client, bnt, mlp, momentum_in_codec=True, codec="topk", codec_params={"density": 0.1})
        coded = train(client, bnt, cnn, momentum_in_codec=True, codec="topk", codec_params={"density": 0.1})
        state = optimizer_state(client, bnt)
        accumulated = train(client, bnt, cnn, passes=2)
        return {"rank": client.rank, "dense": dense, "accumulated": accumulated, "tiny": tiny, "coded": coded, "state": state}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    with LocalCluster(2, tmp_path_factory.mktemp("torch")) as cl:
        res = cl.run(worker, timeout=170)
    return sorted(res, key=lambda r: r["rank"])


def assert_identical(runs):
    for s in range(STEPS):
        for k, v in runs[0]["snaps"][s].items():
            for r in runs[1:]:
                assert r["snaps"][s][k].tobytes() == v.tobytes(), f"step {s}: {k} differs between processes"


def assert_close(run, ref, tol=2e-5):
    for s in range(STEPS):
        for k, v in ref[s].items():
            err = np.max(np.abs(run["snaps"][s][k] - v))
            assert err < tol, f"step {s}: {k} differs from single-process training by {err}"


@pytest.mark.timeout(200)
def test_dense_matches_single_process_and_is_bit_identical(results):
    runs = [r["dense"] for r in results]
    assert_identical(runs)
    assert_close(runs[0], reference(cnn, MOMENTUM))
    # three buckets (fc.bias | fc.weight | conv), submitted in backward order, named after a parameter
    assert runs[0]["buckets"] == ["grad/0/3.bias", "grad/1/3.weight", "grad/2/0.bias"]
    assert all(st["codec"] == "none" for st in runs[0]["stats"][0])
    # after a step with zero_grad(set_to_none=False), .grad lives in the shared-memory buckets
    assert all(runs[0]["grad_in_shm"])


@pytest.mark.timeout(200)
def test_backward_passes_per_step(results):
    runs = [r["accumulated"] for r in results]
    assert_identical(runs)
    # two half-batch means summed = twice the mean over the whole batch
    assert_close(runs[0], reference(cnn, MOMENTUM, scale=2.0))


@pytest.mark.timeout(200)
def test_momentum_in_codec_dense_buckets_keep_sgd_momentum(results):
    runs = [r["tiny"] for r in results]
    assert_identical(runs)
    for g in runs[0]["groups"]:
        assert g["momentum"] == 0.0 and g["birdnet_codec"] == "topk"
        assert g["birdnet_codec_params"] == {"density": 0.1, "momentum": MOMENTUM}
    # every bucket is under dense_threshold, so the daemon sent it dense and the adapter applied
    # the momentum itself, to the averaged gradient; weight decay stays in SGD, outside the momentum
    assert all(st["codec"] == "none" for step in runs[0]["stats"] for st in step)
    ref = reference_outside_wd(mlp)
    assert_close(runs[0], ref)


def reference_outside_wd(make):
    """SGD where momentum accumulates the averaged gradient and weight decay is added afterwards
    (what momentum_in_codec computes)."""
    torch.manual_seed(100)
    model = make()
    x, y = data(STEPS, 2)
    bufs: dict[str, torch.Tensor] = {}
    out = []
    for s in range(STEPS):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[s]), y[s]).backward()
        with torch.no_grad():
            for n, p in model.named_parameters():
                b = bufs.get(n)
                bufs[n] = p.grad.clone() if b is None else b.mul_(MOMENTUM).add_(p.grad)
                p.sub_(LR * (bufs[n] + WD * p))
        out.append(snapshot(model))
    return out


@pytest.mark.timeout(200)
def test_momentum_in_codec_compressed_bucket(results):
    runs = [r["coded"] for r in results]
    assert_identical(runs)
    codecs = [st["codec"] for st in runs[0]["stats"][-1]]
    assert codecs == ["none", "topk", "none"]  # fc.weight (1440 elements) is compressed
    fc = next(st for st in runs[0]["stats"][-1] if st["codec"] == "topk")
    assert fc["ratio"] > 2


@pytest.mark.timeout(200)
def test_broadcast_optimizer_state(results):
    root = results[0]["state"]
    assert root["groups"][0]["lr"] == 0.123 and tuple(root["groups"][0]["betas"]) == (0.8, 0.95)
    assert len(root["state"]) == 4
    for r in results[1:]:
        assert r["state"]["groups"] == root["groups"]
        assert sorted(r["state"]["state"]) == sorted(root["state"])
        for i, st in root["state"].items():
            for k, v in st.items():
                assert r["state"]["state"][i][k].tobytes() == v.tobytes(), (i, k)


def test_wrapper_is_the_optimizer_class_and_rejects_bad_settings(tmp_path):
    import birdnet.client.torch as bnt
    from birdnet.client import Client

    from birdnet.errors import InputError
    with LocalCluster(1, tmp_path) as cl, Client(cl.sockets[0], job="t") as client:
        model = mlp()
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = bnt.DistributedOptimizer(base, named_parameters=model.named_parameters(), client=client)
        assert isinstance(opt, torch.optim.SGD) and opt.param_groups is base.param_groups
        torch.optim.lr_scheduler.StepLR(opt, 1)  # schedulers accept it
        x, y = data(1, 1)
        torch.nn.functional.cross_entropy(model(x[0]), y[0]).backward()
        with pytest.raises(InputError, match="more than backward_passes_per_step=1 times"):
            torch.nn.functional.cross_entropy(model(x[0]), y[0]).backward()
        opt.step()  # the rounds already in flight complete; the optimizer stays usable
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[0]), y[0]).backward()
        opt.step()
        opt.remove_hooks()
        with pytest.raises(InputError, match="momentum-correction codec"):
            bnt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     client=client, momentum_in_codec=True)
        with pytest.raises(InputError, match="nesterov"):
            bnt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True),
                                     client=client, momentum_in_codec=True, codec="topk")
        with pytest.raises(InputError, match="not in named_parameters"):
            bnt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), client=client,
                                     named_parameters=list(model.named_parameters())[:1])


def recover_worker(sock, node, local):
    """Replicas made to differ after a step (as after a failed one), then bnt.recover."""
    import birdnet.client.torch as bnt
    import torch
    from birdnet.client import Client
    torch.manual_seed(0)
    with Client(sock, job="torch-recover") as client:
        model = mlp()
        opt = bnt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), client=client)
        x, y = data(1, 2)
        torch.nn.functional.cross_entropy(model(x[0, client.rank::2]), y[0, client.rank::2]).backward()
        opt.step()
        before = snapshot(model)
        if client.rank == 1:  # what a process did alone after a failed call
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
                    opt.state[p]["momentum_buffer"].mul_(3.0)
        attempts = bnt.recover(model, opt, client=client, timeout=60)
        momentum = {str(i): opt.state[p]["momentum_buffer"].numpy().copy() for i, p in enumerate(model.parameters())}
        return {"rank": client.rank, "before": before, "after": snapshot(model), "momentum": momentum,
                "attempts": attempts}


@pytest.mark.timeout(120)
def test_recover_gives_every_process_rank_0s_parameters_and_optimizer_state(tmp_path):
    with LocalCluster(2, tmp_path) as cl:
        res = sorted(cl.run(recover_worker, timeout=100), key=lambda r: r["rank"])
    assert [r["attempts"] for r in res] == [1, 1]
    for k, v in res[0]["before"].items():
        assert res[0]["after"][k].tobytes() == v.tobytes()  # rank 0's own values stay
        assert res[1]["after"][k].tobytes() == v.tobytes(), k  # rank 1's are rank 0's again
    for k, v in res[0]["momentum"].items():
        assert res[1]["momentum"][k].tobytes() == v.tobytes(), k
