"""Codec registry: one codec per file, registered by name.

``get_codec("birdplus", density=0.01)`` returns a configured codec. Modules are imported lazily
(they import Numba), so importing ``birdnet.codecs`` itself is cheap.

How to add a codec: write ``birdnet/codecs/NAME.py`` with a :class:`~birdnet.codecs.base.Codec`
subclass whose ``name`` is NAME, add ``"NAME": "birdnet.codecs.NAME:ClassName"`` to ``_MODULES``,
add its kernels' reference tests under ``tests/``, and list it in docs/codecs.md.
"""
from __future__ import annotations

import importlib
from typing import Any

from birdnet.codecs.base import Codec, Pattern, Payload, RoundContext
from birdnet.errors import CodecError

_MODULES: dict[str, str] = {
    "none": "birdnet.codecs.none:NoneCodec",
    "fp16": "birdnet.codecs.fp16:Fp16Codec",
    "lowbit": "birdnet.codecs.lowbit:LowbitCodec",
    "ternary": "birdnet.codecs.ternary:TernaryCodec",
    "sparseloco": "birdnet.codecs.sparseloco:SparseLoCoCodec",
    "topk": "birdnet.codecs.topk:TopKCodec",
    "randomk": "birdnet.codecs.randomk:RandomKCodec",
    "dgc": "birdnet.codecs.dgc:DGCCodec",
    "qsgd": "birdnet.codecs.qsgd:QSGDCodec",
    "efsign": "birdnet.codecs.efsign:EFSignCodec",
    "bird": "birdnet.codecs.bird:BirdCodec",
    "birdplus": "birdnet.codecs.birdplus:BirdPlusCodec",
    "marsit": "birdnet.codecs.marsit:MarsitCodec",
    "signcascade": "birdnet.codecs.signcascade:SignCascadeCodec",
}

#: Codec payload formats that changed since the first release, by "codec.mode": version. They go
#: into the cluster fingerprint (birdnet.config.Settings.cluster_wide), so daemons that would put
#: different things on the wire for the same codec refuse each other at the handshake, naming this
#: key, instead of failing every such round. Bump a version when a codec's payload changes.
WIRE_FORMATS: dict[str, int] = {
    # 2: shared mode carries the next round's proposed block ids after the values (docs/codecs.md)
    "bird.shared": 2, "birdplus.shared": 2,
}


def names() -> list[str]:
    """All registered codec names."""
    return sorted(_MODULES)


#: codec classes loaded so far: the daemon looks one up for every submitted call, and importlib's
#: way to a module already imported costs more than the rest of the lookup
_loaded: dict[str, type[Codec]] = {}


def codec_class(name: str) -> type[Codec]:
    cls = _loaded.get(name)
    if cls is not None:
        return cls
    target = _MODULES.get(name)
    if target is None:
        raise CodecError(f"unknown codec {name!r}; choose one of: {', '.join(names())}")
    module, attr = target.split(":")
    try:
        cls = _loaded[name] = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:  # a codec not built yet is an error, not a crash
        raise CodecError(f"codec {name!r} is registered but cannot be loaded: {exc}") from exc
    return cls


def get_codec(name: str, **params: Any) -> Codec:
    """A configured codec; :class:`CodecError` names an unknown codec or parameter."""
    return codec_class(name)(**params)


def validate(name: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check a codec name and its parameters exactly as the daemons do (the same
    :class:`CodecError` and message) and return the parameters completed with the codec's defaults.

    It compiles and loads no kernel and imports no Numba (codec modules import their kernels at
    first use), so training processes call it when they are configured: the PyTorch adapter's
    ``DistributedOptimizer`` and ``HookState`` at construction, ``Client.allreduce`` before its first
    round with a codec, instead of failing at the first compressed step on every rank."""
    if not isinstance(name, str):
        raise CodecError(f"codec must be a name (one of: {', '.join(names())}), not {name!r}")
    if params is None:
        params = {}
    if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
        raise CodecError(f"codec {name!r}: its parameters must be a dict of names to values, not {params!r}")
    return dict(get_codec(name, **params).params)


__all__ = ["Codec", "Pattern", "Payload", "RoundContext", "WIRE_FORMATS", "get_codec", "names", "codec_class", "validate"]
