"""Codec specs on the command line, shared by every ``birdnet bench`` command:
``name:key=value:key=value``, several separated by commas, e.g.
``none,topk:density=0.01,birdplus:density=0.01:mode=shared``. Values are JSON where they parse
(numbers, true/false), else strings."""
from __future__ import annotations

import json
from typing import Any


def parse_spec(item: str) -> tuple[str, dict[str, Any]]:
    name, *kvs = item.strip().split(":")
    params: dict[str, Any] = {}
    for kv in kvs:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise SystemExit(f"bad codec parameter {kv!r} in {item!r}; write name:key=value:key=value")
        try:
            params[k] = json.loads(v)
        except json.JSONDecodeError:
            params[k] = v
    return name, params


def parse_codecs(text: str) -> list[tuple[str, dict[str, Any]]]:
    return [parse_spec(item) for item in text.split(",") if item.strip()]


def label(name: str, params: dict[str, Any]) -> str:
    return name + "".join(f":{k}={v}" for k, v in params.items())
