"""The optimizer recipes of birdnet.client.torch.DistributedOptimizer (momentum in the codec for SGD,
uncompressed warm-up then frozen second moment for Adam/AdamW).

The update logic is tested in-process against torch's own optimizers with a *lossless* stand-in for
the codec (``u = beta * u + g``, what a momentum-correction codec returns when it drops nothing):
then the recipe must reproduce torch's SGD exactly, and Adam/AdamW with the second moment frozen
after the warm-up. The real-daemon test trains AdamW through 2 daemons with marsit and checks that
both processes end bit-identical, including across a state_dict() round trip."""
from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch) for the PyTorch adapter")

import birdnet.client._torch_recipes as rec  # noqa: E402 - the recipes' constants live there
import birdnet.client.torch as bnt  # noqa: E402
from cluster import LocalCluster  # noqa: E402

from birdnet.errors import InputError  # noqa: E402


def bare(opt_cls, params, recipe, **kw):
    """A DistributedOptimizer's update logic without buckets or a daemon: step() is told the
    reduction already happened (as after a user's synchronize())."""
    cls = type(f"Distributed{opt_cls.__name__}", (bnt._DistributedOptimizer, opt_cls), {})
    opt = cls(params, **kw)
    opt._bn_recipe, opt._bn_denom, opt._bn_synced = {0: recipe}, {}, True
    opt._bn_warmup, opt._bn_vsnap, opt._bn_codec = 0, {}, "marsit"  # the tests say which steps are compressed
    opt._bn_adapter_m = set()
    return opt


def grads(steps, shape=(5, 3)):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=g) for _ in range(steps)]


def reduce_then_step(opt, p, g, coded, u):
    """What synchronize() does for one parameter, with a lossless momentum codec."""
    if coded:
        u.mul_(opt._bn_recipe[0][1]).add_(g)
        p.grad = u.clone()
    else:
        p.grad = g.clone()
    opt._apply_recipe(p, opt._bn_recipe[0], coded)
    opt._bn_synced = True
    opt.step()


@pytest.mark.parametrize("damp", [0.0, 0.3])
def test_sgd_momentum_in_a_lossless_codec_is_torch_sgd(damp):
    steps, warm, mu, lr = 12, 4, 0.9, 0.1
    ref_p = torch.nn.Parameter(torch.ones(5, 3))
    ref = torch.optim.SGD([ref_p], lr=lr, momentum=mu, dampening=damp)
    p = torch.nn.Parameter(torch.ones(5, 3))
    opt = bare(torch.optim.SGD, [p], ("sgd", mu, damp), lr=lr, momentum=0.0)
    u = torch.zeros(5, 3)
    for s, g in enumerate(grads(steps)):
        ref_p.grad = g.clone()
        ref.step()
        reduce_then_step(opt, p, g, s >= warm, u)
        torch.testing.assert_close(p.detach(), ref_p.detach(), rtol=1e-5, atol=1e-6, msg=f"step {s}")
    # the momentum estimate a checkpoint restarts from is SGD's own buffer
    torch.testing.assert_close(opt.state[p]["birdnet_momentum_buffer"], ref.state[ref_p]["momentum_buffer"])


def frozen_adam_reference(opt_cls, steps, warm, lr, wd, betas=(0.9, 0.999), eps=1e-8, amsgrad=False):
    """torch's optimizer for the warm-up, then m_t = b1 m + (1 - b1) g with v (and its bias
    correction) frozen at the last warm-up step."""
    p = torch.nn.Parameter(torch.ones(5, 3))
    ref = opt_cls([p], lr=lr, betas=betas, eps=eps, weight_decay=wd, amsgrad=amsgrad)
    out = []
    m = v = None
    for s, g in enumerate(grads(steps)):
        if s < warm:
            p.grad = g.clone()
            ref.step()
            if s == warm - 1:
                st = ref.state[p]
                m = st["exp_avg"] / (1 - betas[0] ** warm)
                v = (st["max_exp_avg_sq"] if amsgrad else st["exp_avg_sq"]) / (1 - betas[1] ** warm)
        else:
            with torch.no_grad():
                if opt_cls is torch.optim.AdamW:
                    m = betas[0] * m + (1 - betas[0]) * g
                    p.mul_(1 - lr * wd)
                    p.sub_(lr * m / (v.sqrt() + eps))
                else:
                    m = betas[0] * m + (1 - betas[0]) * g
                    p.sub_(lr * (m + wd * p) / (v.sqrt() + eps))
        out.append(p.detach().clone())
    return out


@pytest.mark.parametrize("opt_cls,wd,amsgrad", [(torch.optim.AdamW, 0.01, False), (torch.optim.Adam, 0.0, False),
                                                (torch.optim.Adam, 0.05, False), (torch.optim.AdamW, 0.1, True)])
def test_adam_recipe_is_adam_with_the_variance_frozen_after_the_warm_up(opt_cls, wd, amsgrad):
    steps, warm, lr = 14, 5, 0.01
    ref = frozen_adam_reference(opt_cls, steps, warm, lr, wd, amsgrad=amsgrad)
    p = torch.nn.Parameter(torch.ones(5, 3))
    opt = bare(opt_cls, [p], ("adam", 0.9, 0.0), lr=lr, weight_decay=wd, amsgrad=amsgrad)
    u = torch.zeros(5, 3)
    for s, g in enumerate(grads(steps)):
        reduce_then_step(opt, p, g, s >= warm, u)
        torch.testing.assert_close(p.detach(), ref[s], rtol=1e-5, atol=1e-6, msg=f"step {s}")
    st = opt.state[p]
    assert float(st["step"]) == warm  # Adam's own step stopped: the variance froze there
    assert st["birdnet_coded"] is True


@pytest.mark.parametrize("opt_cls,wd", [(torch.optim.AdamW, 0.01), (torch.optim.Adam, 0.05)])
def test_adam_with_a_selecting_codec_keeps_its_first_moment_in_the_adapter(opt_cls, wd):
    """A selecting codec carries error feedback only (its result is the gradient when it drops
    nothing) and the adapter runs Adam's first moment on it: Adam with the variance frozen, exactly.
    (With the momentum in the codec instead, a block sent every step would step (1 - beta1) of it.)"""
    steps, warm, lr = 14, 5, 0.01
    ref = frozen_adam_reference(opt_cls, steps, warm, lr, wd)
    p = torch.nn.Parameter(torch.ones(5, 3))
    opt = bare(opt_cls, [p], ("adam", 0.9, 0.0), lr=lr, weight_decay=wd)
    opt._bn_adapter_m = {0}
    for s, g in enumerate(grads(steps)):
        p.grad = g.clone()
        opt._apply_recipe(p, opt._bn_recipe[0], s >= warm, adapter_m=True)
        opt._bn_synced = True
        opt.step()
        torch.testing.assert_close(p.detach(), ref[s], rtol=1e-5, atol=1e-6, msg=f"step {s}")
    st = opt.state[p]
    assert float(st["step"]) == warm and st["birdnet_coded"] is True and "birdnet_carry" not in st


def test_a_refresh_moves_the_frozen_variance_as_adam_would_over_the_steps_it_stands_for():
    """After the warm-up, refreshes at chosen steps: v = b2**k v + (1 - b2**k) g**2 over the k steps
    since the last sample, Adam's step count (bias correction) moved to the refresh's step; between
    refreshes v stays frozen. A refresh every step is then Adam's own second moment."""
    steps, warm, lr, wd, (b1, b2), eps = 16, 3, 0.01, 0.01, (0.9, 0.999), 1e-8
    refresh = {5, 6, 7, 11}  # steps (0-based) whose averaged gradient is sampled
    p = torch.nn.Parameter(torch.ones(5, 3))
    opt = bare(torch.optim.AdamW, [p], ("adam", b1, 0.0), lr=lr, weight_decay=wd)
    q = torch.nn.Parameter(torch.ones(5, 3))
    ref = torch.optim.AdamW([q], lr=lr, weight_decay=wd)
    u = torch.zeros(5, 3)
    m = v = None
    last = warm
    for s, g in enumerate(grads(steps)):
        coded = s >= warm
        if coded:
            u.mul_(b1).add_(g)
            p.grad = u.clone()
        else:
            p.grad = g.clone()
        opt._apply_recipe(p, opt._bn_recipe[0], coded)
        if s in refresh:
            opt._refresh_variance(opt.param_groups[0], p, g.clone())
        opt._bn_synced = True
        opt.step()
        # the reference, written out
        if s < warm:
            q.grad = g.clone()
            ref.step()
            if s == warm - 1:
                m = ref.state[q]["exp_avg"] / (1 - b1 ** warm)
                v = ref.state[q]["exp_avg_sq"].clone()
        else:
            with torch.no_grad():
                m = b1 * m + (1 - b1) * g
                if s in refresh:
                    a = b2 ** (s + 1 - last)
                    v = a * v + (1 - a) * g * g
                    last = s + 1
                q.mul_(1 - lr * wd)
                q.sub_(lr * m / ((v / (1 - b2 ** last)).sqrt() + eps))
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=f"step {s}")
    st = opt.state[p]
    assert float(st["step"]) == 12  # the last refresh's step
    torch.testing.assert_close(st["exp_avg_sq"], v)


def test_refreshes_come_at_doubling_intervals_after_the_warm_up(monkeypatch):
    monkeypatch.setattr(rec, "ADAM_REFRESH_STEPS", 4)
    p = torch.nn.Parameter(torch.ones(5, 3))
    opt = bare(torch.optim.AdamW, [p], ("adam", 0.9, 0.0), lr=0.01)
    opt._bn_warmup = 10
    b = bnt._Bucket(0, 0, np.dtype(np.float32), torch.device("cpu"))
    b.coded = True  # compressed last step (not a bucket under the daemons' dense threshold)
    g = opt.param_groups[0]
    got = []
    for s in range(60):
        g["birdnet_step"] = s
        if opt._refreshing(b):
            got.append(s)
    assert got == [14, 22, 38]  # 10 + 4, + 3 * 4, + 7 * 4 (+ 15 * 4 = 70 is beyond)
    b.coded = False
    g["birdnet_step"] = 14
    assert not opt._refreshing(b)  # a bucket the daemons sent dense keeps Adam's own variance
    monkeypatch.setattr(rec, "ADAM_REFRESH_STEPS", 0)
    b.coded = True
    assert not opt._refreshing(b)


def fp16_round_trip(x: np.ndarray) -> np.ndarray:
    """What the fp16 codec does to one process's values on the wire (a 1-node mean)."""
    return x.astype(np.float16).astype(np.float32)


def test_float16_travel_is_scaled_by_a_power_of_two_from_the_second_moment():
    """Refreshes and an Adam group's small tensors travel in float16, scaled so the tensor's largest
    RMS gradient (sqrt(max v / bc2)) is about 2**8: gradients a million times smaller than that
    keep float16's relative precision (2**-11) instead of underflowing, and the scale is exact."""
    b2 = 0.999
    p = torch.nn.Parameter(torch.zeros(1000))
    opt = bare(torch.optim.AdamW, [p], ("adam", 0.9, 0.0), lr=0.01)
    g = opt.param_groups[0]
    rms = torch.logspace(-9, -3, 1000)  # a tensor whose coordinates' gradients span 6 decades
    opt.state[p].update(step=torch.tensor(20.0), exp_avg=torch.zeros(1000),
                        exp_avg_sq=rms * rms * (1 - b2 ** 20))
    sc = opt._half_scale(g, p)
    assert sc == 2.0 ** (rec.HALF_HEADROOM_LOG2 + 9)  # largest RMS 1e-3 = 2**-9.97: ceil -9, scaled into (2**7, 2**8]
    assert np.log2(sc) == int(np.log2(sc))
    grad = (rms * torch.linspace(-3, 3, 1000)).numpy()  # up to 3 sigma
    scaled = fp16_round_trip(grad * np.float32(sc)) / np.float32(sc)
    big = np.abs(grad) > 1e-3 * 1e-6  # everything above a millionth of the largest RMS
    rel = np.abs(scaled[big] - grad[big]) / np.abs(grad[big])
    assert rel.max() <= 2.0 ** -11
    unscaled = fp16_round_trip(grad)  # without the scale: float16 loses these below 6e-8 (subnormal) to 0
    assert (np.abs(unscaled[big] - grad[big]) / np.abs(grad[big])).max() > 0.01
    # no variance yet (or all zero): no scale
    opt.state[p]["exp_avg_sq"] = torch.zeros(1000)
    assert opt._half_scale(g, p) == 1.0


def test_a_refresh_in_float16_matches_float32_and_an_overflow_is_dropped():
    p = torch.nn.Parameter(torch.zeros(200))
    opt = bare(torch.optim.AdamW, [p], ("adam", 0.9, 0.0), lr=0.01)
    g = opt.param_groups[0]
    gen = torch.Generator().manual_seed(4)
    v0 = torch.rand(200, generator=gen) * 1e-6
    mean = torch.randn(200, generator=gen) * 1e-3
    g["birdnet_step"] = 29  # this refresh is Adam's step 30; the variance froze at step 10

    def fresh():
        opt.state[p].update(step=torch.tensor(10.0), exp_avg=torch.zeros(200), exp_avg_sq=v0.clone())

    fresh()
    opt._refresh_variance(g, p, mean.clone())
    want = opt.state[p]["exp_avg_sq"].clone()
    assert float(opt.state[p]["step"]) == 30
    fresh()
    sc = opt._half_scale(g, p)
    half = torch.from_numpy(fp16_round_trip((mean * sc).numpy()))
    opt._refresh_variance(g, p, half, sc)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"], want, rtol=2.0 ** -10, atol=0.0)
    fresh()
    half[7] = float("inf")  # float16 overflowed: the same Inf on every process
    opt._refresh_variance(g, p, half, sc)
    assert torch.equal(opt.state[p]["exp_avg_sq"], v0) and float(opt.state[p]["step"]) == 10


@pytest.mark.parametrize("growth,expected", [(1.0, None), (1.5, 12)])
def test_the_automatic_warm_up_ends_when_the_second_moment_settles(monkeypatch, growth, expected):
    """Gradients of a fixed distribution: the bias-corrected second moment settles and the warm-up
    ends at a test step before the cap; gradients growing 1.5x a step never settle: the cap ends it."""
    monkeypatch.setattr(rec, "ADAM_WARMUP_STEPS", 12)
    monkeypatch.setattr(rec, "ADAM_WARMUP_WINDOW", 2)
    monkeypatch.setattr(rec, "ADAM_WARMUP_CHANGE", 0.3)
    p = torch.nn.Parameter(torch.ones(40, 30))
    opt = bare(torch.optim.AdamW, [p], ("adam", 0.9, 0.0), lr=0.001)
    opt._bn_warmup = None
    gen = torch.Generator().manual_seed(3)
    g = opt.param_groups[0]
    for s in range(20):
        p.grad = torch.randn(40, 30, generator=gen) * growth ** s
        opt._bn_synced = True
        opt.step()
        if g.get("birdnet_warmup_end") is not None:
            break
    end = g["birdnet_warmup_end"]
    if expected is None:
        assert 4 <= end < 12 and end % 2 == 0
    else:
        assert end == expected
    assert opt.birdnet_warmup_steps == end and not opt._warming_up({**g, "birdnet_codec": "marsit"})


def test_adam_recipe_follows_the_lr_schedule_and_maximize():
    p = torch.nn.Parameter(torch.ones(5, 3))
    opt = bare(torch.optim.AdamW, [p], ("adam", 0.9, 0.0), lr=0.01, weight_decay=0.0, maximize=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    u = torch.zeros(5, 3)
    gs = grads(4)
    for s in range(2):
        reduce_then_step(opt, p, gs[s], False, u)
        sched.step()
    before = p.detach().clone()
    reduce_then_step(opt, p, gs[2], True, u)
    st = opt.state[p]
    denom = (st["exp_avg_sq"] / (1 - 0.999 ** 2)).sqrt() + 1e-8
    # maximize: the step goes up the direction; lr is the schedule's 0.01 * 0.5**2
    torch.testing.assert_close(p.detach(), before + 0.0025 * st["exp_avg"] / denom)


@pytest.fixture
def one_node(tmp_path):
    from birdnet.client import Client
    with LocalCluster(1, tmp_path) as cl, Client(cl.sockets[0], job="t") as client:
        yield client


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))


def test_automatic_mode_arranges_each_optimizer(one_node):
    model = mlp()
    named = list(model.named_parameters())
    sgd = bnt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.1),
                                   named_parameters=named, client=one_node, codec="birdplus")
    g = sgd.param_groups[0]
    assert g["momentum"] == 0.0 and g["birdnet_codec_params"] == {"momentum": 0.9}
    assert sgd.birdnet_warmup_steps == 0
    sgd.remove_hooks()
    adam = bnt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), named_parameters=named,
                                    client=one_node, codec="marsit", codec_params={"compensation": "local"})
    assert adam.param_groups[0]["birdnet_codec_params"] == {"compensation": "local", "momentum": 0.9}
    # automatic warm-up: dense until the second moment settles (none done yet)
    assert adam.birdnet_warmup_steps == 0 and adam._warming_up(adam.param_groups[0])
    adam.remove_hooks()
    rk = bnt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), named_parameters=named,
                                  client=one_node, codec="randomk", warmup_steps=3)
    # a selecting codec keeps error feedback only; Adam's first moment stays in the adapter
    assert rk.param_groups[0]["birdnet_codec_params"] == {"error_feedback": True}
    assert rk._bn_adapter_m == {0} and rk.birdnet_warmup_steps == 3
    rk.remove_hooks()
    # a block-selecting codec under Adam: its scale cap raised, unless the group sets one
    for given, want in (({}, {"cap": rec.ADAM_BLOCK_CAP}), ({"cap": 4.0}, {"cap": 4.0})):
        bp = bnt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), named_parameters=named,
                                      client=one_node, codec="birdplus", codec_params=given)
        assert bp.param_groups[0]["birdnet_codec_params"] == want and bp._bn_adapter_m == {0}
        bp.remove_hooks()
    # dense and fp16 need nothing; False keeps the optimizer exactly as given
    for kw in ({"codec": None}, {"codec": "fp16"}, {"codec": "topk", "momentum_in_codec": False}):
        o = bnt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     named_parameters=named, client=one_node, **kw)
        assert o.param_groups[0]["momentum"] == 0.9 and "birdnet_codec_params" not in o.param_groups[0]
        assert o.birdnet_warmup_steps == 0
        o.remove_hooks()


def test_the_codec_after_the_warm_up_is_loaded_at_construction(one_node):
    """The wrapper names its groups' codecs to the daemon when it is built, so their kernels are
    loaded during the dense warm-up: loaded at the first compressed step, they stalled it ~1.6 s."""
    import time
    model = mlp()
    label = 'marsit {"compensation": "local", "momentum": 0.9}'
    assert label not in one_node.status()["kernels"]["loaded"]
    adam = bnt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                    named_parameters=list(model.named_parameters()), client=one_node,
                                    codec="marsit", codec_params={"compensation": "local"})
    deadline = time.monotonic() + 150  # ~1 s from the on-disk cache; a cold cache compiles first
    while label not in (k := one_node.status()["kernels"])["loaded"] and time.monotonic() < deadline:
        time.sleep(0.1)
    adam.remove_hooks()
    assert label in k["loaded"], k


def test_adam_with_a_sign_codec_gives_each_big_tensor_its_own_bucket(one_node):
    """One sign scale per bucket: with Adam, a bucket of several tensors would step the ones with
    small gradients many times Adam's step, so each tensor of >= 1024 elements travels alone and
    the small ones share one dense bucket. SGD, and Adam with a selecting codec, keep big buckets."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 40))
    named = list(model.named_parameters())

    def layout(opt):
        out = [([n for n, _p, _o, _k in b.entries], b.dense) for b in opt._bn_buckets]
        opt.remove_hooks()
        return out

    adam = bnt.DistributedOptimizer(torch.optim.AdamW(model.parameters()), named_parameters=named,
                                    client=one_node, codec="marsit")
    assert layout(adam) == [(["2.weight"], False), (["0.weight"], False), (["2.bias", "0.bias"], True)]
    for opt in (torch.optim.AdamW(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)):
        codec = "birdplus" if isinstance(opt, torch.optim.AdamW) else "marsit"
        wrapped = bnt.DistributedOptimizer(opt, named_parameters=named, client=one_node, codec=codec)
        assert layout(wrapped) == [(["2.bias", "2.weight", "0.bias", "0.weight"], False)]
    # SGD with a block-selecting codec: the small tensors travel apart, dense, the big ones share a bucket
    sgd = bnt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), named_parameters=named,
                                   client=one_node, codec="birdplus")
    # not padded (the 40 + 32 biases): the daemons honour fp16 under their dense_threshold
    assert sgd._bn_buckets[1].array.shape == (72,)
    assert layout(sgd) == [(["2.weight", "0.weight"], False), (["2.bias", "0.bias"], True)]


def test_small_tensors_travel_in_float16_once_their_statistic_exists():
    """A dense bucket of small tensors goes fp16 once the statistic its scale comes from exists
    on every process (SGD's momentum buffer after the first step; Adam's second moment after
    the warm-up); before, float32."""
    p = torch.nn.Parameter(torch.ones(5, 3))
    opt = bare(torch.optim.SGD, [p], ("sgd", 0.9, 0.0), lr=0.1)
    b = bnt._Bucket(0, 0, np.dtype(np.float32), torch.device("cpu"))
    b.add("p", p)
    assert opt._small_codec(b) == "none"  # not a dense bucket
    b.dense = True
    assert opt._small_codec(b) == "none"  # the first step: no momentum buffer yet
    opt.state[p]["birdnet_momentum_buffer"] = torch.full((5, 3), -0.01)
    assert opt._small_codec(b) == "fp16"
    assert opt._half_scale(opt.param_groups[0], p) == 2.0 ** (rec.HALF_HEADROOM_LOG2 + 6)  # 0.01 = 2**-6.6
    q = torch.nn.Parameter(torch.ones(5, 3))
    adam = bare(torch.optim.AdamW, [q], ("adam", 0.9, 0.0), lr=0.1)
    adam._bn_warmup = 3
    a = bnt._Bucket(0, 0, np.dtype(np.float32), torch.device("cpu"))
    a.add("q", q)
    a.dense = True
    adam.state[q].update(step=torch.tensor(3.0), exp_avg=torch.zeros(5, 3), exp_avg_sq=torch.ones(5, 3))
    adam.param_groups[0]["birdnet_step"] = 2
    assert adam._small_codec(a) == "none"  # the warm-up: float32
    adam.param_groups[0]["birdnet_step"] = 3
    assert adam._small_codec(a) == "fp16"


def test_automatic_mode_refuses_or_warns_clearly(one_node):
    model = mlp()
    with pytest.raises(InputError, match="nesterov=True cannot move into a compressing codec"):
        bnt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True),
                                 client=one_node, codec="topk")
    with pytest.raises(InputError, match="warmup_steps must be at least 1"):
        bnt.DistributedOptimizer(torch.optim.Adam(model.parameters()), client=one_node, codec="topk", warmup_steps=0)
    with pytest.raises(InputError, match="warmup_steps must be None"):
        bnt.DistributedOptimizer(torch.optim.Adam(model.parameters()), client=one_node, codec="topk", warmup_steps=-1)
    with pytest.warns(UserWarning, match="birdnet does not know RMSprop.*steps on the decompressed average"):
        bnt.DistributedOptimizer(torch.optim.RMSprop(model.parameters()), client=one_node, codec="topk").remove_hooks()
    with pytest.warns(UserWarning, match="codec 'qsgd' has no momentum parameter"):
        bnt.DistributedOptimizer(torch.optim.AdamW(model.parameters()), client=one_node, codec="qsgd").remove_hooks()
    with pytest.raises(InputError, match="momentum_in_codec=True needs torch.optim.SGD, Adam or AdamW"):
        bnt.DistributedOptimizer(torch.optim.RMSprop(model.parameters()), client=one_node, codec="topk",
                                 momentum_in_codec=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # SGD without momentum: nothing to arrange, nothing to say
        bnt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), client=one_node,
                                 codec="topk").remove_hooks()


# -- real daemons -------------------------------------------------------------------------------
STEPS, WARM, SAVE = 6, 2, 4


def digest(model) -> str:
    return b"".join(v.detach().numpy().tobytes() for v in model.state_dict().values()).hex()


def lr_lambda(s):
    return 1.0 / (1 + 0.1 * s)


def make_adamw(client, codec):
    torch.manual_seed(0)
    # two tensors of >= 1024 elements (3072, 1536) and the biases (48, 32)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 32))
    # birdplus: the automatic warm-up (its cap set to WARM by the worker); marsit: a fixed one
    opt = bnt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01),
                                   named_parameters=model.named_parameters(), client=client, codec=codec,
                                   warmup_steps=None if codec == "birdplus" else WARM, timeout=60)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)


def one_step(model, opt, sched, x, y):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()  # clip the averaged gradients, as a user would
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()


def flat(model) -> np.ndarray:
    return torch.cat([q.detach().reshape(-1) for q in model.parameters()]).numpy().copy()


def _mean_rms(opt, p) -> float:
    st = opt.state[p]
    bc2 = 1.0 - 0.999 ** float(st["step"])
    return float((st["exp_avg_sq"].double() / bc2).sqrt().mean())


def adamw_worker(sock, node, local, codec):
    torch.set_num_threads(1)
    from birdnet.client import Client
    rec.ADAM_WARMUP_STEPS = WARM
    rec.ADAM_REFRESH_STEPS = 1  # variance refreshes at WARM + 1, WARM + 3
    with Client(sock, job=f"recipe-{codec}") as client:
        model, opt, sched = make_adamw(client, codec)
        g = torch.Generator().manual_seed(10 + client.rank)
        data = [(torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(STEPS)]
        codecs, digests, refreshes, refresh_codecs, merged = [], [], [], [], []
        saved = None
        units, got_units = [], []
        for s, (x, y) in enumerate(data):
            if s == WARM:  # the first compressed step sets each big tensor's travel unit (_sign_unit)
                units = [_mean_rms(opt, p) for p in model.parameters() if p.numel() >= 1024]
            if s == SAVE:
                saved = (flat(model), opt.state_dict(), sched.state_dict())
            one_step(model, opt, sched, x, y)
            if s == WARM:
                got_units = [opt.state[p].get("birdnet_unit") for p in model.parameters() if p.numel() >= 1024]
            codecs.append(sorted({st["codec"] for st in opt.last_stats}))
            refreshes.append([st["name"] for st in opt.last_stats if st["name"].startswith("var/")])
            refresh_codecs.append([st["codec"] for st in opt.last_stats if st["name"].startswith("var/")])
            merged.append(sorted({st["merged_into"] for st in opt.last_stats if "merged_into" in st}))
            digests.append(digest(model))
        state = opt.state_dict()
        opt.remove_hooks()
        # restore the step-SAVE checkpoint into a fresh model and optimizer, run the same steps again
        model2, opt2, sched2 = make_adamw(client, codec)
        with torch.no_grad():
            off = 0
            for q in model2.parameters():
                q.copy_(torch.from_numpy(saved[0][off:off + q.numel()]).view_as(q))
                off += q.numel()
        opt2.load_state_dict(saved[1])
        sched2.load_state_dict(saved[2])
        coded = [st for st in opt2.state.values() if st.get("birdnet_coded")]
        # a sign codec's momentum restarts from the saved estimate (the carry); with a selecting
        # codec Adam's first moment is the adapter's own, restored as it was (no carry)
        carry_restarted = bool(coded) and all(
            ("birdnet_carry" not in st) if opt2._bn_adapter_m else torch.equal(st["birdnet_carry"], st["exp_avg"])
            for st in coded)
        reset_pending = opt2._bn_reset_pending
        replay = []
        for x, y in data[SAVE:]:
            one_step(model2, opt2, sched2, x, y)
            replay.append(digest(model2))
        return {"rank": client.rank, "codecs": codecs, "units": units, "got_units": got_units,
                "digests": digests, "replay": replay, "refreshes": refreshes,
                "merged": merged,
                "refresh_codecs": refresh_codecs,
                "warmup": opt.birdnet_warmup_steps, "warmup_after_restore": opt2.birdnet_warmup_steps,
                "final": flat(model), "final_after_restore": flat(model2), "saved": saved[0],
                "carry_restarted": carry_restarted, "reset_pending": reset_pending,
                "reset_done": not opt2._bn_reset_pending,
                "round_trip": state["param_groups"][0]["birdnet_step"],
                "coded": sorted({k for st in state["state"].values() for k in st if k.startswith("birdnet_")})}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("codec", ["marsit", "birdplus"])
def test_adamw_compressed_on_real_daemons_is_bit_identical(tmp_path, codec):
    # the small tensors' bucket (538 elements, under the daemons' dense threshold of 1024, not
    # padded) travels fp16 after the warm-up: the daemons honour a call's fp16 at any size
    with LocalCluster(2, tmp_path) as cl:
        res = sorted(cl.run(adamw_worker, codec, timeout=250), key=lambda r: r["rank"])
    a, b = res
    # dense warm-up, then the big tensor compressed (marsit: the 10x48 and the biases in a dense bucket)
    assert a["codecs"][:WARM] == [["none"]] * WARM
    assert all(codec in c for c in a["codecs"][WARM:])
    if codec == "marsit":  # the dense bucket of small tensors travels fp16 after the warm-up
        assert all(c == ["fp16", "marsit"] for c in a["codecs"][WARM:])
        # during the warm-up the per-tensor buckets and the small tensors' travel as one dense
        # round (the ring's bytes, one round trip); after it the big tensors travel in one marsit
        # round, each in its own unit (the mean RMS gradient of its frozen second moment)
        assert a["merged"][:WARM] == [["warm/0/2.weight"]] * WARM
        # (the refreshes of both in one float16 round too, at WARM + 1 and WARM + 3)
        sign, var = ["sign/0/2.weight"], ["sign/0/2.weight", "var-sign/0/2.weight"]
        assert a["merged"][WARM:] == [sign, var, sign, var]
        assert a["units"] and np.allclose(a["got_units"], a["units"], rtol=1e-12) and a["units"] == b["units"]
        assert len(set(a["units"])) == 2
    else:
        assert a["merged"] == [[]] * STEPS
    assert all(set(c) == {"fp16"} for c in a["refresh_codecs"] if c)  # refreshes travel in float16
    assert a["warmup"] == a["warmup_after_restore"] == WARM
    # the compressed buckets' variance refreshes (a dense round beside the codec's) at WARM + 1, + 3
    per = 2 if codec == "marsit" else 1  # marsit: a bucket per big tensor; birdplus: one bucket
    assert [len(r) for r in a["refreshes"]] == [0] * (WARM + 1) + [per, 0, per]
    assert a["digests"] == b["digests"], "the processes' parameters differ"
    assert a["replay"] == b["replay"], "after the restore the processes' parameters differ"
    assert a["round_trip"] == STEPS
    # (marsit's travel units are not in the final state: the refresh of the last step dropped them,
    # to be recomputed from the refreshed second moment at the next compressed step)
    assert a["coded"] == (["birdnet_carry", "birdnet_carry_weight", "birdnet_coded"] if codec == "marsit"
                          else ["birdnet_coded"])
    # the model trained (parameters changed every step)
    assert len(set(a["digests"])) == STEPS
    # a restore resets the daemons' codec state before the first submission and restarts the
    # momentum (the carry) from the saved estimate; the daemon's unsent residual is lost, so the
    # replay is not the uninterrupted run (its cost is measured in docs/adapters.md)
    assert a["carry_restarted"] and a["reset_pending"] and a["reset_done"]
    assert a["replay"][-1] != a["digests"][-1]
    assert np.linalg.norm(a["final_after_restore"] - a["saved"]) > 0


def test_the_cnn_example_leaves_the_recipe_automatic_unless_told(monkeypatch):
    """examples/train_torch_cnn.py must not switch the adapter's recipe off by default (it trains
    marsit to about 70% instead of about 95% without it)."""
    import pathlib
    import sys
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
    monkeypatch.delitem(sys.modules, "train_torch_cnn", raising=False)
    import train_torch_cnn
    assert train_torch_cnn.parse(["--codec", "marsit"])[1]["momentum_in_codec"] is None
    assert train_torch_cnn.parse(["--codec", "marsit", "--momentum-in-codec"])[1]["momentum_in_codec"] is True
    assert train_torch_cnn.parse(["--codec", "marsit", "--no-momentum-in-codec"])[1]["momentum_in_codec"] is False


@pytest.mark.parametrize("codec,params,says", [("birdplus", {"density": 2}, "density must be a number in (0, 1]"),
                                               ("birdpluss", {}, "unknown codec 'birdpluss'")])
def test_bad_codec_parameters_fail_at_construction_without_a_warning_first(codec, params, says):
    """Before any connection, warm-up step or recipe warning: the daemons' own message."""
    from birdnet.client.torch_dist import HookState

    from birdnet.errors import CodecError
    model = torch.nn.Linear(4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "has no momentum parameter, so nothing is arranged" would raise
        with pytest.raises(CodecError, match=re.escape(says)):
            bnt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     named_parameters=model.named_parameters(), codec=codec, codec_params=params,
                                     socket="/nonexistent/birdnetd.sock")
        opt = torch.optim.SGD([{"params": model.parameters(), "birdnet_codec": codec,
                                "birdnet_codec_params": params}], lr=0.1)
        with pytest.raises(CodecError, match=re.escape(says)):
            bnt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                     socket="/nonexistent/birdnetd.sock")
        with pytest.raises(CodecError, match=re.escape(says)):
            HookState(codec=codec, codec_params=params, socket="/nonexistent/birdnetd.sock")


def test_the_client_refuses_bad_codec_parameters_and_dtypes_before_a_round(one_node):
    from birdnet.errors import CodecError, InputError
    x = np.ones(5000, np.float32)
    with pytest.raises(CodecError, match=re.escape("density must be a number in (0, 1]")):
        one_node.allreduce(x, name="w", codec="birdplus", density=2)
    with pytest.raises(InputError, match=re.escape("cast it: array.astype(np.float32)")):
        one_node.allreduce(np.ones(8, np.int8), name="i8", op="sum")
    with pytest.raises(InputError, match=re.escape("pass op='sum'")):
        one_node.allreduce(np.ones(8, np.int32), name="i32")
    np.testing.assert_array_equal(one_node.allreduce(np.ones(8, np.int32), name="i32", op="sum"), np.ones(8))
    np.testing.assert_array_equal(one_node.allreduce(x, name="w", codec="birdplus", density=0.5).shape, x.shape)
