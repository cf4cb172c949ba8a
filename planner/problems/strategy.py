"""A Strategy: one ParallelConfig per op, and its JSON file.

The file records the configs by op name, the config space they were searched in ("space":
kind, caps, hierarchy; see docs/space.md) when known, plus the graph and the device graph it
was made for:
their fingerprints always, and the graphs themselves embedded (so `planner evaluate` and the
runtime need nothing else), with the zoo model name and arguments when there is one. Loading
it against another graph or machine, a degree that does not divide, or a device out of range
raises `StrategyError`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.costs.config import ParallelConfig, check_config
from planner.errors import ConfigError, LayerwiseError, StrategyError
from planner.files import read_json_checked
from planner.graph.opgraph import OpGraph
from planner.hardware.devices import DeviceGraph

STRATEGY_FORMAT = "layerwise.strategy"
STRATEGY_VERSION = 1


@dataclass(frozen=True)
class Strategy:
    """A parallelization strategy: one ParallelConfig (degrees per output dimension and the
    devices that run the parts) per op of `graph` on `devices`; validated on creation, saved
    and loaded as the plan file format (docs/strategy.md)."""

    graph: OpGraph
    devices: DeviceGraph
    configs: tuple[ParallelConfig, ...]
    # The config space the strategy was searched in (`ConfigSpace.describe()`), recorded in
    # plan files; not part of the strategy's identity.
    space: Mapping[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if len(self.configs) != len(self.graph.ops):
            raise StrategyError(
                f"{len(self.configs)} configs for {len(self.graph.ops)} ops of {self.graph.name!r}"
            )
        checked: set[int] = set()  # device tuples the configs share, checked once
        for op, cfg in zip(self.graph.ops, self.configs, strict=True):
            try:
                check_config(op, cfg, self.devices.num_devices, checked)
            except ConfigError as exc:
                raise StrategyError(str(exc)) from None

    def config(self, name: str) -> ParallelConfig:
        return self.configs[self.graph.index(name)]

    def describe(self) -> list[tuple[str, str, str]]:
        """(op name, kind, config) rows."""
        return [
            (op.name, op.kind, c.describe(op))
            for op, c in zip(self.graph.ops, self.configs, strict=True)
        ]

    def to_json(
        self, model: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        graph_meta: dict[str, Any] = {
            "name": self.graph.name,
            "fingerprint": self.graph.fingerprint(),
        }
        if model is not None:
            graph_meta["model"] = dict(model)
        graph_meta["json"] = self.graph.to_json()
        data: dict[str, Any] = {
            "format": STRATEGY_FORMAT,
            "version": STRATEGY_VERSION,
            **(dict(extra) if extra else {}),
            "graph": graph_meta,
            "devices": {
                "name": self.devices.name,
                "fingerprint": self.devices.fingerprint(),
                "json": self.devices.to_json(),
            },
            "configs": {
                op.name: c.to_json(op) for op, c in zip(self.graph.ops, self.configs, strict=True)
            },
        }
        if self.space is not None:
            data["space"] = dict(self.space)
        return data

    def save(self, path: str | Path, **kwargs: Any) -> None:
        Path(path).write_text(json.dumps(self.to_json(**kwargs), indent=1))


def strategy_from_json(
    data: Mapping[str, Any], graph: OpGraph | None = None, devices: DeviceGraph | None = None
) -> Strategy:
    """Read a strategy; `graph`/`devices` default to the ones embedded in the file."""
    if not isinstance(data, Mapping) or data.get("format") != STRATEGY_FORMAT:
        raise StrategyError(
            f'not a layerwise strategy file: expected "format": "{STRATEGY_FORMAT}"'
        )
    if data.get("version") != STRATEGY_VERSION:
        raise StrategyError(f"strategy version {data.get('version')!r} is not supported")
    gmeta, dmeta = data.get("graph", {}), data.get("devices", {})
    if not isinstance(gmeta, Mapping) or not isinstance(dmeta, Mapping):
        raise StrategyError('the strategy file\'s "graph" and "devices" must be objects')
    try:
        graph = graph or OpGraph.from_json(gmeta["json"])
        devices = devices or DeviceGraph.from_json(dmeta["json"])
    except KeyError:
        raise StrategyError("the strategy file embeds no graph or devices: pass them") from None
    except LayerwiseError as exc:
        raise StrategyError(
            f"the strategy file's embedded graph/devices are invalid: {exc}"
        ) from None
    _check_fingerprint("graph", gmeta, graph.name, graph.fingerprint())
    _check_fingerprint("device graph", dmeta, devices.name, devices.fingerprint())
    configs = data.get("configs")
    if not isinstance(configs, Mapping):
        raise StrategyError("the strategy file has no 'configs' object")
    names = {op.name for op in graph.ops}
    unknown = sorted(set(configs) - names)
    if unknown:
        raise StrategyError(f"configs name ops that {graph.name!r} does not have: {unknown[:5]}")
    missing = [op.name for op in graph.ops if op.name not in configs]
    if missing:
        raise StrategyError(f"no config for op(s) {missing[:5]} of {graph.name!r}")
    out = []
    for op in graph.ops:
        try:
            out.append(ParallelConfig.from_json(op, configs[op.name], devices.num_devices))
        except (ConfigError, TypeError, ValueError, AttributeError) as exc:
            raise StrategyError(f"bad config for op {op.name!r}: {exc}") from None
    space = data.get("space")
    if space is not None and not isinstance(space, Mapping):
        raise StrategyError(f'the strategy file\'s "space" must be an object, got {space!r}')
    return Strategy(graph, devices, tuple(out), space=space)


def _check_fingerprint(what: str, meta: Mapping[str, Any], name: str, actual: str) -> None:
    recorded = meta.get("fingerprint")
    if recorded is not None and recorded != actual:
        raise StrategyError(
            f"the strategy was made for {what} {meta.get('name')!r} (fingerprint {recorded}), "
            f"not for {name!r} (fingerprint {actual})"
        )


def load_strategy(
    path: str | Path, graph: OpGraph | None = None, devices: DeviceGraph | None = None
) -> tuple[Strategy, dict[str, Any]]:
    """Strategy and the raw file contents (status, objective, model, ... of a plan)."""
    data = read_json_checked(path, "strategy", StrategyError)
    return strategy_from_json(data, graph, devices), data
