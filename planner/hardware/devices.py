"""DeviceGraph: devices, links and switches, with derived routes (DLPlacer's hardware graph)."""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from planner.errors import DeviceGraphError
from planner.files import read_json_checked, write_text_atomic
from planner.hardware.hierarchy import Hierarchy, route_levels
from planner.hardware.pairs import Levels, PairCosts
from planner.hardware.routing import ROUTE_PROBE_BYTES, RouteGraph, core_nodes

__all__ = [
    "EFFICIENCY_CLASSES",
    "FORMAT",
    "ROUTE_PROBE_BYTES",
    "VERSION",
    "Device",
    "DeviceGraph",
    "Hierarchy",
    "Link",
]

FORMAT = "layerwise.devicegraph"
VERSION = 1
DEVICE_KINDS = ("gpu", "cpu")
# The op classes a device may carry a calibrated achievable fraction of peak for
# (`Device.efficiency`; the cost model maps op kinds to them: planner.costs.costmodel).
EFFICIENCY_CLASSES = ("matmul", "attention")
_PICOSECONDS = 1e12  # route weights are integers in ps, so equal-cost ties are exact
ROUTE_CACHE = 1 << 16  # routes kept after `route` derived them
DENSE_MATRIX_DEVICES = 2048  # the largest graph whose D x D cost tables are handed out
SUMMARY_PAIRS_DEVICES = 1024  # `summary` reads every pair up to here
# The slowest link modelled: 1 MiB in 1e4 s (100 bytes/s). Slower is a units mistake, and
# a route of up to ~900 such links still sums to an int64 number of picoseconds.
MAX_LINK_SECONDS = 1e4


@dataclass(frozen=True)
class Device:
    """One compute device: peak FP32 FLOP/s, memory bandwidth (bytes/s), memory (bytes).

    `message_overhead` (seconds) is the processor time the device spends on each message it
    sends or receives when its own processor drives the transport (CPU workers with gloo: the
    send runs on the worker's thread and every arrival wakes it); 0 for devices whose copy
    engines move the data (GPUs).

    Peaks by precision (FLOP/s, dense, no sparsity), each optional: `flops16` for 16-bit
    floats (bf16/fp16 matrix products on tensor cores; default `flops`), `flops8` for FP8
    matrix products (E4M3/E5M2 tensor cores, Hopper on; default the 16-bit peak: a device
    without FP8 tensor cores runs them in 16 bits), `flops_tf32` for float32 matrix products
    in TF32 (default `flops`), `flops64` for float64 (default `flops / 2`). `efficiency` holds calibrated achievable fractions of peak per op class
    (`EFFICIENCY_CLASSES`): given as pairs or a mapping, kept as (class, fraction) pairs
    sorted by class; a class it leaves out takes the cost options' fraction
    (docs/cost_model.md, "Analytic mode")."""

    name: str
    kind: str
    flops: float
    mem_bandwidth: float
    memory: int
    host: str
    message_overhead: float = 0.0
    flops16: float | None = None
    flops_tf32: float | None = None
    flops64: float | None = None
    efficiency: tuple[tuple[str, float], ...] = ()
    flops8: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise DeviceGraphError("a device has an empty name")
        if self.kind not in DEVICE_KINDS:
            raise DeviceGraphError(
                f"device {self.name}: kind must be one of {DEVICE_KINDS}, got {self.kind!r}"
            )
        for field in ("flops", "mem_bandwidth", "memory"):
            value = getattr(self, field)
            if not (math.isfinite(value) and value > 0):
                raise DeviceGraphError(f"device {self.name}: {field} must be > 0, got {value}")
        if not (math.isfinite(self.message_overhead) and self.message_overhead >= 0):
            raise DeviceGraphError(
                f"device {self.name}: message_overhead must be finite and >= 0, "
                f"got {self.message_overhead}"
            )
        for field in _PEAKS:
            value = getattr(self, field)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise DeviceGraphError(
                    f"device {self.name}: {field} must be finite and > 0 (or left out: "
                    f"{_PEAK_DEFAULTS[field]}), got {value}"
                )
        self._check_efficiency()

    def _check_efficiency(self) -> None:
        """Normalize `efficiency` (pairs or a mapping) to sorted (class, float) pairs."""
        given: Any = self.efficiency
        try:
            items = given.items() if isinstance(given, Mapping) else given
            pairs = tuple(sorted((str(c), float(f)) for c, f in items))
        except (TypeError, ValueError):
            raise DeviceGraphError(
                f"device {self.name}: efficiency must map op classes {EFFICIENCY_CLASSES} to "
                f"fractions of peak, got {given!r}"
            ) from None
        object.__setattr__(self, "efficiency", pairs)
        classes = [c for c, _ in pairs]
        unknown = [c for c in classes if c not in EFFICIENCY_CLASSES]
        if unknown or len(set(classes)) < len(classes):
            raise DeviceGraphError(
                f"device {self.name}: efficiency names op classes {classes}; each must be one "
                f"of {EFFICIENCY_CLASSES}, at most once"
            )
        for op_class, fraction in self.efficiency:
            if not 0 < fraction <= 1:
                raise DeviceGraphError(
                    f"device {self.name}: efficiency of {op_class!r} must be a fraction of "
                    f"peak in (0, 1], got {fraction}"
                )

    @property
    def peak16(self) -> float:
        """FLOP/s of 16-bit float matrix products (bf16/fp16 tensor cores)."""
        return self.flops16 if self.flops16 is not None else self.flops

    @property
    def peak8(self) -> float:
        """FLOP/s of FP8 matrix products (the 16-bit peak on a device without FP8 ones)."""
        return self.flops8 if self.flops8 is not None else self.peak16

    @property
    def peak_tf32(self) -> float:
        """FLOP/s of float32 matrix products run in TF32."""
        return self.flops_tf32 if self.flops_tf32 is not None else self.flops

    @property
    def peak64(self) -> float:
        """FLOP/s of float64 arithmetic."""
        return self.flops64 if self.flops64 is not None else self.flops / 2

    def efficiency_of(self, op_class: str) -> float | None:
        """The calibrated fraction of peak this device reaches on `op_class`, or None."""
        return dict(self.efficiency).get(op_class)


@dataclass(frozen=True)
class Link:
    """A full-duplex link between two endpoints (devices or switches)."""

    a: str
    b: str
    bandwidth: float  # bytes/s in each direction
    latency: float  # seconds
    kind: str = ""

    def __post_init__(self) -> None:
        if self.a == self.b:
            raise DeviceGraphError(f"link {self.a}-{self.b} connects {self.a!r} to itself")
        if not (math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise DeviceGraphError(
                f"link {self.a}-{self.b}: bandwidth must be finite and > 0, got {self.bandwidth}"
            )
        if not (math.isfinite(self.latency) and self.latency >= 0):
            raise DeviceGraphError(
                f"link {self.a}-{self.b}: latency must be finite and >= 0, got {self.latency}"
            )
        seconds = self.latency + ROUTE_PROBE_BYTES / self.bandwidth
        if not seconds <= MAX_LINK_SECONDS:  # route weights are int64 picoseconds, summed
            raise DeviceGraphError(
                f"link {self.a}-{self.b}: a 1 MiB message would take {seconds:.3g} s (latency "
                f"{self.latency:g} s, bandwidth {self.bandwidth:g} bytes/s); at most "
                f"{MAX_LINK_SECONDS:g} s is modelled: check the units (bytes/s, seconds)"
            )

    @property
    def route_weight(self) -> int:
        """Routing cost of this link in integer picoseconds (at least 1)."""
        seconds = self.latency + ROUTE_PROBE_BYTES / self.bandwidth
        return max(1, round(seconds * _PICOSECONDS))


class DeviceGraph:
    """Devices and switches joined by links; routes and their costs are derived on demand.

    Immutable; equality and hash are on (name, devices, switches, links). Construction
    checks that every device reaches every other and derives no route: a pair's costs come
    from its level (`hierarchy`), from D x D tables on a small graph, or from the
    shortest-path tree of its lower device (`planner.hardware.pairs`), so building a graph
    takes time and memory linear in its devices and links (docs/devices.md, "Routes at
    scale").
    """

    __slots__ = (
        "_devices",
        "_ends",
        "_levels",
        "_links",
        "_name",
        "_pairs",
        "_route_cache",
        "_switches",
    )

    def __init__(
        self,
        name: str,
        devices: Sequence[Device],
        links: Sequence[Link],
        switches: Sequence[str] = (),
    ) -> None:
        self._name = name
        self._devices = tuple(devices)
        self._switches = tuple(switches)
        self._links = tuple(links)
        self._validate()
        names = [d.name for d in self._devices] + list(self._switches)
        index = {name: k for k, name in enumerate(names)}
        ends = np.array(
            [(index[link.a], index[link.b]) for link in self._links], dtype=np.int64
        ).reshape(-1, 2)
        weight = np.array([link.route_weight for link in self._links], dtype=np.int64)
        bandwidth = np.array([link.bandwidth for link in self._links], dtype=np.float64)
        latency = np.array([link.latency for link in self._links], dtype=np.float64)
        self._connect(names, ends, weight, bandwidth, latency)

    def _connect(
        self,
        names: list[str],
        ends: np.ndarray,
        weight: np.ndarray,
        bandwidth: np.ndarray,
        latency: np.ndarray,
    ) -> None:
        """The routing graph (`planner.hardware.routing.RouteGraph`) and the reachability
        check: one DeviceGraphError naming a pair with no route."""
        self._ends = ends
        graph = RouteGraph(names, len(self._devices), ends, weight, bandwidth, latency)
        if graph.unreachable is not None:
            raise DeviceGraphError(
                f"device graph {self._name!r}: no route from {names[0]} to "
                f"{names[graph.unreachable]}"
            )
        self._pairs = PairCosts(graph)
        self._levels: tuple[Hierarchy, Levels] | None | bool = False  # False: not looked for
        self._route_cache: dict[tuple[int, int], tuple[int, ...]] = {}

    # -- construction -------------------------------------------------------------------------

    def _validate(self) -> None:
        if not self._devices:
            raise DeviceGraphError(f"device graph {self._name!r} has no devices")
        names = [d.name for d in self._devices] + list(self._switches)
        duplicates = sorted(n for n, c in Counter(names).items() if c > 1)
        if duplicates:
            raise DeviceGraphError(
                f"device graph {self._name!r}: duplicate device/switch name(s) {duplicates}"
            )
        known = set(names)
        for link in self._links:
            for end in (link.a, link.b):
                if end not in known:
                    raise DeviceGraphError(
                        f"link {link.a}-{link.b}: endpoint {end!r} is neither a device nor a switch"
                    )

    # -- read-only attributes -----------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def devices(self) -> tuple[Device, ...]:
        return self._devices

    @property
    def switches(self) -> tuple[str, ...]:
        return self._switches

    @property
    def links(self) -> tuple[Link, ...]:
        return self._links

    @property
    def num_devices(self) -> int:
        return len(self._devices)

    @property
    def inv_bandwidth(self) -> np.ndarray:
        """(D, D) seconds per byte from i to j: 1 / bottleneck bandwidth of the route (up to
        `DENSE_MATRIX_DEVICES` devices; larger graphs: `inv_bandwidth_of`)."""
        return self._matrix(0, "inv_bandwidth_of")

    @property
    def latency(self) -> np.ndarray:
        """(D, D) seconds: sum of link latencies along the route from i to j (up to
        `DENSE_MATRIX_DEVICES` devices; larger graphs: `latency_of`)."""
        return self._matrix(1, "latency_of")

    def _matrix(self, which: int, instead: str) -> np.ndarray:
        n = self.num_devices
        if self._pairs.small:
            tables = self._pairs.tables()
            return tables.inv_bandwidth if which == 0 else tables.latency
        if n > DENSE_MATRIX_DEVICES:
            raise DeviceGraphError(
                f"device graph {self._name!r}: a {n:,} x {n:,} table of route costs would need "
                f"{n * n * 8 / 2**30:.3g} GiB; ask for the pairs you need with "
                f"DeviceGraph.{instead}(i, j) (index arrays)"
            )
        idx = np.arange(n)
        out = self.pair_costs(idx[:, None], idx[None, :])[which]
        out.setflags(write=False)
        return out

    # -- queries ------------------------------------------------------------------------------

    def pair_costs(self, i: Any, j: Any) -> tuple[np.ndarray, np.ndarray]:
        """(seconds per byte, latency) of the routes from devices i to devices j: index
        arrays (or ints) broadcast against each other; 0 where i == j."""
        return self._costs().costs(i, j)

    def inv_bandwidth_of(self, i: Any, j: Any) -> np.ndarray:
        """Seconds per byte from devices i to devices j (index arrays, broadcast): 1 / the
        bottleneck bandwidth of each route, 0 where i == j."""
        return self.pair_costs(i, j)[0]

    def latency_of(self, i: Any, j: Any) -> np.ndarray:
        """Seconds of latency from devices i to devices j (index arrays, broadcast): the sum
        of each route's link latencies, 0 where i == j."""
        return self.pair_costs(i, j)[1]

    def hops_of(self, i: Any, j: Any) -> np.ndarray:
        """Links on the routes from devices i to devices j (index arrays, broadcast)."""
        return self._costs().hops(i, j)

    def _costs(self) -> PairCosts:
        """The pair costs, with their levels looked for first on a graph too large for D x D
        tables (the costs of a proven hierarchy need no route)."""
        if not self._pairs.small:
            self._route_levels()
        return self._pairs

    def _route_levels(self) -> tuple[Hierarchy, Levels] | None:
        """The proven levels of the route costs, whatever the devices (looked for once)."""
        if self._levels is False:
            found = route_levels(self._pairs, self._name)
            self._levels = found
            if found is not None and not self._pairs.small:
                self._pairs.levels = found[1]
        assert self._levels is not True
        return self._levels

    def hierarchy(self) -> Hierarchy | None:
        """The cluster's nested groups when it is homogeneous (see `Hierarchy`), else None.

        Levels come from the distinct route costs: device 0's cheapest peers must be the
        devices right after it, the next cheapest the block after those, and so on, and every
        other pair of devices must cost what the level of its first differing digit says
        (compared pair by pair on a small graph, proven by symmetry on a larger one:
        `planner.hardware.hierarchy`)."""
        spec = _figures(self._devices[0])
        if any(_figures(d) != spec for d in self._devices):
            return None
        found = self._route_levels()
        return None if found is None else found[0]

    def device_index(self, name: str) -> int:
        """Index of the device called `name`."""
        for index, device in enumerate(self._devices):
            if device.name == name:
                return index
        raise DeviceGraphError(f"device graph {self._name!r} has no device {name!r}")

    def route(self, i: int, j: int) -> tuple[int, ...]:
        """Indices into `links`, in path order from device i to device j; () when i == j.

        Derived on demand from device min(i, j)'s shortest-path tree (and reversed when
        i > j); the last routes asked for are cached."""
        n = self.num_devices
        if not (0 <= i < n and 0 <= j < n):
            raise DeviceGraphError(f"device index out of range 0..{n - 1}: ({i}, {j})")
        if i == j:
            return ()
        a, b = min(i, j), max(i, j)
        route = self._route_cache.get((a, b))
        if route is None:
            if len(self._route_cache) >= ROUTE_CACHE:
                self._route_cache.clear()
            route = tuple(self._pairs.route(a, b))
            self._route_cache[(a, b)] = route
        return route if i < j else route[::-1]

    def subset(self, indices: Sequence[int], name: str | None = None) -> DeviceGraph:
        """The devices `indices` (in that order) with the switches and links among them that
        can carry a route: a pipeline stage's group. A switch left with links to one node
        only (e.g. the NIC of a GPU left out) carries no route and is left out, again and
        again, so a group's graph grows with the group, not with the cluster. Routes through
        a device left out are lost (none in the switched presets: their devices forward
        nothing)."""
        keep = np.asarray(list(indices), dtype=np.int64)
        n = self.num_devices
        if (
            len(keep) == 0
            or keep.min() < 0
            or keep.max() >= n
            or len(set(keep.tolist())) < len(keep)
        ):
            raise DeviceGraphError(
                f"device graph {self._name!r}: a subset takes distinct device indices in "
                f"0..{n - 1}, got {list(indices)[:8]}"
            )
        V = n + len(self._switches)
        node = np.full(V, -1, dtype=np.int64)  # the subset's index of each node kept
        node[keep] = np.arange(len(keep))
        node[n:] = 0  # every switch, for now
        inside = (node[self._ends[:, 0]] >= 0) & (node[self._ends[:, 1]] >= 0)
        alive = core_nodes(self._ends[inside], V, n) & (node >= 0)
        switches = np.flatnonzero(alive[n:]) + n
        node[n:] = -1
        node[switches] = len(keep) + np.arange(len(switches))
        chosen = np.flatnonzero(inside & alive[self._ends[:, 0]] & alive[self._ends[:, 1]])
        out = DeviceGraph.__new__(DeviceGraph)
        out._name = name or f"{self._name}[{len(keep)}]"
        out._devices = tuple(self._devices[i] for i in keep.tolist())
        out._switches = tuple(self._switches[s - n] for s in switches.tolist())
        out._links = tuple(self._links[k] for k in chosen.tolist())
        names = [d.name for d in out._devices] + list(out._switches)
        g = self._pairs.graph
        out._connect(
            names,
            node[self._ends[chosen]],
            g.link_weight[chosen],
            g.bandwidth[chosen],
            g.latency[chosen],
        )
        return out

    def hops(self, i: int, j: int) -> int:
        """Links on the route from device i to device j."""
        return int(self.hops_of(i, j))

    def transfer_time(self, i: int, j: int, nbytes: float) -> float:
        """Seconds to move nbytes from device i to device j (latency + nbytes / bottleneck)."""
        if i == j or nbytes == 0:
            return 0.0
        inv_bw, lat = self._costs().pair(i, j)
        return float(lat + nbytes * inv_bw)

    # -- identity and JSON --------------------------------------------------------------------

    def _key(self) -> tuple[Any, ...]:
        return (self._name, self._devices, self._switches, self._links)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DeviceGraph):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its parts and built again (the routes' cache is per process)."""
        return (DeviceGraph, (self._name, self._devices, self._links, self._switches))

    def __repr__(self) -> str:
        return (
            f"DeviceGraph({self._name!r}, {self.num_devices} devices, "
            f"{len(self._switches)} switches, {len(self._links)} links)"
        )

    def fingerprint(self) -> str:
        """First 16 hex chars of the sha256 of the canonical JSON, without the name.

        Renaming a machine keeps its fingerprint; any change of device, link or switch changes it.
        """
        content = {k: v for k, v in self.to_json().items() if k != "name"}
        canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        """A versioned, JSON-serialisable dict."""
        devices = [_device_json(d) for d in self._devices]
        links = [
            asdict(link) | {"bandwidth": float(link.bandwidth), "latency": float(link.latency)}
            for link in self._links
        ]
        return {
            "format": FORMAT,
            "version": VERSION,
            "name": self._name,
            "devices": devices,
            "switches": list(self._switches),
            "links": links,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DeviceGraph:
        """Inverse of `to_json`; raises DeviceGraphError on a wrong format, version or field
        (one line naming the field, the device or link index, and what to give)."""
        if not isinstance(data, dict):
            raise DeviceGraphError(
                f"not a device graph: expected a JSON object with 'format': {FORMAT!r}, "
                f"not {_json_kind(data)}"
            )
        if data.get("format") != FORMAT:
            raise DeviceGraphError(f"not a device graph: expected 'format': {FORMAT!r}")
        if data.get("version") != VERSION:
            raise DeviceGraphError(
                f"unsupported device graph version {data.get('version')!r} (expected {VERSION})"
            )
        name = _json_field(data, "name", str, "the device graph", 'a name, e.g. "my-cluster"')
        devices = _json_list(data, "devices", "device objects")
        if not devices:
            raise DeviceGraphError(
                'malformed device graph: "devices" is empty: give at least one device '
                '(docs/devices.md, "Your own machines")'
            )
        links = _json_list(data, "links", "link objects (empty for one device)")
        switches = data.get("switches", [])
        if not isinstance(switches, list) or not all(isinstance(s, str) for s in switches):
            raise DeviceGraphError(
                f'malformed device graph: "switches" must be a list of names, not {switches!r}'
            )
        try:
            return cls(
                name,
                [_device_from_json(d, i) for i, d in enumerate(devices)],
                [_link_from_json(e, k) for k, e in enumerate(links)],
                switches,
            )
        except DeviceGraphError:
            raise
        except (KeyError, TypeError, ValueError) as exc:  # a case the checks above miss
            raise DeviceGraphError(
                f"malformed device graph JSON: {type(exc).__name__}: {exc}"
            ) from None

    def save(self, path: str | Path) -> None:
        """Write the JSON form to `path` (atomically: `planner.files.write_text_atomic`)."""
        write_text_atomic(path, json.dumps(self.to_json(), indent=2) + "\n", "device graph")

    @classmethod
    def load(cls, path: str | Path) -> DeviceGraph:
        """Read a graph written by `save`; every defect is one DeviceGraphError naming the
        file (a FIFO, socket, device or directory is refused without being read)."""
        data = read_json_checked(path, "device graph", DeviceGraphError)
        try:
            return cls.from_json(data)
        except DeviceGraphError as exc:
            raise DeviceGraphError(f"device file {path}: {exc}") from None

    def summary(self) -> str:
        """A few human-readable lines: devices, link kinds, route statistics."""
        hosts = {d.host for d in self._devices}
        lines = [
            f"{self._name}: {self.num_devices} devices on {len(hosts)} host(s), "
            f"{len(self._switches)} switches, {len(self._links)} links"
        ]
        for (kind, flops, flops16, flops8, mem_bw, memory, efficiency), count in Counter(
            (d.kind, d.flops, d.peak16, d.flops8, d.mem_bandwidth, d.memory, d.efficiency)
            for d in self._devices
        ).items():
            reach = "".join(f", {c} {f:.3g}" for c, f in efficiency)
            fp8 = f", {flops8 / 1e12:.4g} TFLOP/s FP8" if flops8 is not None else ""
            lines.append(
                f"  {count} x {kind}: {flops / 1e12:.3g} TFLOP/s FP32, {flops16 / 1e12:.3g} "
                f"TFLOP/s 16-bit{fp8}, {memory / 2**30:.3g} GiB, {mem_bw / 1e9:.3g} GB/s memory"
                + (f" (fraction of peak reached: {reach[2:]})" if reach else "")
            )
        for (kind, bw, lat), count in sorted(
            Counter(
                (link.kind or "?", link.bandwidth, link.latency) for link in self._links
            ).items()
        ):
            lines.append(f"  {count} x {kind} link: {bw / 1e9:.3g} GB/s, {lat * 1e6:.3g} us")
        if self.num_devices > 1:
            lines.append(self._route_summary())
        return "\n".join(lines)

    def _route_summary(self) -> str:
        """One line: the range of the routes' bandwidth, latency and hops (over every pair;
        over device 0's routes only on a graph of more than `SUMMARY_PAIRS_DEVICES` devices
        whose costs follow no levels)."""
        n = self.num_devices
        whose = ""
        if self._pairs.small:
            off = ~np.eye(n, dtype=bool)
            t = self._pairs.tables()
            inv, lat, hops = t.inv_bandwidth[off], t.latency[off], t.hops[off]
        else:
            found = self._route_levels()
            everyone = n <= SUMMARY_PAIRS_DEVICES
            i, j = (
                (np.arange(n)[:, None], np.arange(n)[None, :]) if everyone else (0, np.arange(1, n))
            )
            keep = ~np.eye(n, dtype=bool) if everyone else slice(None)
            if found is not None:
                h, levels = found
                present = [k for k, size in enumerate(h.sizes) if size > 1]
                inv, lat = levels.inv_bandwidth[present], levels.latency[present]
            else:
                inv, lat = (x[keep] for x in self.pair_costs(i, j))
            if found is not None and found[1].hops is not None:
                hops = found[1].hops[present]
            else:
                hops = self.hops_of(i, j)[keep]
            if not everyone and (found is None or found[1].hops is None):
                whose = f" (from {self._devices[0].name})"
        route_bw = 1.0 / inv
        return (
            f"  routes{whose}: {route_bw.min() / 1e9:.3g}-{route_bw.max() / 1e9:.3g} GB/s, "
            f"{lat.min() * 1e6:.3g}-{lat.max() * 1e6:.3g} us, {hops.min()}-{hops.max()} hops"
        )


def _figures(d: Device) -> tuple[Any, ...]:
    """Everything a device computes and holds with (all but its name and host)."""
    return (d.kind, d.flops, d.mem_bandwidth, d.memory, d.message_overhead, d.flops16,
            d.flops_tf32, d.flops64, d.efficiency, d.flops8)  # fmt: skip


def _device_json(d: Device) -> dict[str, Any]:
    """A device's JSON fields; a zero message_overhead, peaks left to their defaults and an
    empty efficiency are left out (older files, same fingerprints)."""
    out = asdict(d) | {"flops": float(d.flops), "mem_bandwidth": float(d.mem_bandwidth)}
    if d.message_overhead:
        out["message_overhead"] = float(d.message_overhead)
    else:
        del out["message_overhead"]
    for field in _PEAKS:
        value = getattr(d, field)
        if value is None:
            del out[field]
        else:
            out[field] = float(value)
    if d.efficiency:
        out["efficiency"] = {c: float(f) for c, f in d.efficiency}
    else:
        del out["efficiency"]
    return out


_PEAKS = ("flops16", "flops_tf32", "flops64", "flops8")
_PEAK_DEFAULTS = {
    "flops16": "flops",
    "flops_tf32": "flops",
    "flops64": "flops / 2",
    "flops8": "the 16-bit peak",
}

# What to give for each field of a device's or a link's JSON entry (error messages say it).
_DEVICE_HINTS = {
    "name": 'a unique name, e.g. "gpu0"',
    "kind": f"one of {DEVICE_KINDS}",
    "flops": "its FP32 peak in FLOP/s, e.g. 1.06e13",
    "mem_bandwidth": "its memory bandwidth in bytes/s, e.g. 7.32e11",
    "memory": "its memory in bytes, e.g. 17179869184 (16 GiB)",
    "host": 'the machine it is in, e.g. "node0"',
    "message_overhead": "seconds per message (0 for a GPU)",
    "flops16": "its 16-bit peak in FLOP/s (or leave it out)",
    "flops_tf32": "its TF32 peak in FLOP/s (or leave it out)",
    "flops64": "its float64 peak in FLOP/s (or leave it out)",
    "flops8": "its FP8 peak in FLOP/s (or leave it out)",
}
_LINK_HINTS = {
    "a": "the name of a device or switch",
    "b": "the name of a device or switch",
    "bandwidth": "bytes/s in each direction, e.g. 1.2e10",
    "latency": "seconds, e.g. 5e-06",
    "kind": 'a free label, e.g. "pcie"',
}


def _json_kind(value: Any) -> str:
    """How a JSON value is named in an error message: "a list", "a string", "null", ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    kinds = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number"}
    return f"{value!r} ({kinds.get(type(value), type(value).__name__)})"


def _json_field(obj: Mapping[str, Any], key: str, kind: type, where: str, hint: str) -> Any:
    """obj[key] checked to be a string (`kind` str) or a JSON number (`kind` float, returned
    as a float); a DeviceGraphError naming `where`, the field and `hint` otherwise."""
    if key not in obj:
        raise DeviceGraphError(f'malformed device graph: {where} has no "{key}": give {hint}')
    value = obj[key]
    if kind is float:
        if type(value) not in (int, float):
            raise DeviceGraphError(
                f'malformed device graph: {where}: "{key}" must be a number ({hint}), '
                f"not {_json_kind(value)}"
            )
        return float(value)
    if not isinstance(value, kind):
        raise DeviceGraphError(
            f'malformed device graph: {where}: "{key}" must be a string ({hint}), '
            f"not {_json_kind(value)}"
        )
    return value


def _json_list(data: Mapping[str, Any], key: str, hint: str) -> list[Any]:
    if key not in data:
        raise DeviceGraphError(f'malformed device graph: it has no "{key}": give a list of {hint}')
    value = data[key]
    if not isinstance(value, list):
        raise DeviceGraphError(
            f'malformed device graph: "{key}" must be a list of {hint}, not {_json_kind(value)}'
        )
    return value


def _device_from_json(d: Any, i: int) -> Device:
    """devices[i] of a device file as a Device; one DeviceGraphError naming it otherwise."""
    where = f"devices[{i}]"
    if not isinstance(d, dict):
        raise DeviceGraphError(
            f"malformed device graph: {where} must be an object with {list(_DEVICE_HINTS)[:6]}, "
            f"not {_json_kind(d)}"
        )
    if isinstance(d.get("name"), str):
        where += f" ({d['name']})"
    fields = {
        key: _json_field(d, key, float if key in ("flops", "mem_bandwidth") else str, where, hint)
        for key, hint in _DEVICE_HINTS.items()
        if key in ("name", "kind", "flops", "mem_bandwidth", "host")
    }
    memory = _json_field(d, "memory", float, where, _DEVICE_HINTS["memory"])
    if not memory.is_integer() and math.isfinite(memory):
        raise DeviceGraphError(
            f'malformed device graph: {where}: "memory" must be a whole number of bytes, '
            f"not {memory}"
        )
    optional = {
        key: _json_field(d, key, float, where, _DEVICE_HINTS[key])
        for key in ("message_overhead", *_PEAKS)
        if d.get(key) is not None or (key == "message_overhead" and key in d)
    }
    try:
        return Device(
            memory=int(memory) if math.isfinite(memory) else memory,
            efficiency=_efficiency_json(d),
            **fields,
            **optional,
        )
    except DeviceGraphError as exc:  # its message names the device
        raise DeviceGraphError(f"devices[{i}]: {exc}") from None


def _efficiency_json(d: dict[str, Any]) -> tuple[tuple[str, float], ...]:
    """The optional efficiency of a device's JSON entry, as `Device.efficiency` pairs."""
    efficiency = d.get("efficiency", {})
    if not isinstance(efficiency, dict) or not all(
        type(f) in (int, float) for f in efficiency.values()
    ):
        raise DeviceGraphError(
            f"device {d.get('name')}: efficiency must be an object of op class: fraction of "
            f'peak, e.g. {{"matmul": 0.7}}, got {efficiency!r}'
        )
    return tuple(sorted((str(c), float(f)) for c, f in efficiency.items()))


def _link_from_json(e: Any, k: int) -> Link:
    """links[k] of a device file as a Link; one DeviceGraphError naming it otherwise."""
    where = f"links[{k}]"
    if not isinstance(e, dict):
        raise DeviceGraphError(
            f"malformed device graph: {where} must be an object with a, b, bandwidth and "
            f"latency, not {_json_kind(e)}"
        )
    if isinstance(e.get("a"), str) and isinstance(e.get("b"), str):
        where += f" ({e['a']}-{e['b']})"
    fields = {
        key: _json_field(e, key, float if key in ("bandwidth", "latency") else str, where, hint)
        for key, hint in _LINK_HINTS.items()
        if key != "kind" or key in e
    }
    try:
        return Link(**fields)
    except DeviceGraphError as exc:  # its message names the link's ends
        raise DeviceGraphError(f"links[{k}]: {exc}") from None
