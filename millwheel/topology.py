"""The dataflow graph as plain frozen dataclasses; the runners are separate.

A :class:`Topology` is data: it can be built in Python, loaded from a YAML/JSON spec
(:mod:`millwheel.spec`) or received over gRPC, and every runner (local, service)
reads the same thing. :meth:`Topology.validate` is the one place graph errors are
found, with messages that name the computation and stream at fault.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping

from millwheel.connectors.spec import ConnectorSpec, SinkSpec
from millwheel.errors import InvalidSpecError
from millwheel.keys import KeyExtractor
from millwheel.limits import (
    MAX_COMPUTATIONS,
    MAX_DURATION_US,
    MAX_INJECTORS,
    MAX_KEY_RANGES,
    MAX_LOG_RETENTION_BYTES,
    MAX_LOG_RETENTION_US,
    MAX_LOG_STREAMS,
    MAX_STREAMS_PER_COMPUTATION,
    MIN_LOG_RETENTION_BYTES,
    MIN_LOG_RETENTION_US,
    check_name,
)
from millwheel.nodes import NodeKind, injector_node, is_injector, is_sink, name_of, sink_node


class LatePolicy(enum.StrEnum):
    PROCESS = "process"  # hand late records to user code with ctx.is_late set
    DROP = "drop"  # drop them and count them
    ROUTE = "route"  # send them unchanged to the computation's late stream


class ErrorPolicy(enum.StrEnum):
    """What happens to a record (or timer) whose user code keeps raising
    (:mod:`millwheel.runtime.poison`)."""

    FAIL = "fail"  # stop the key range and retry the batch until the code is fixed
    SKIP = "skip"  # after max_attempts, drop the record and count it
    DEAD_LETTER = "dead_letter"  # after max_attempts, write it to the dead-letter stream


class Productions(enum.StrEnum):
    STRONG = "strong"  # checkpoint productions before sending (default)
    WEAK = "weak"  # send first; checkpoint only what downstream is slow to ack


MIN_STATE_TTL_US = 1_000  # 1 ms
MAX_STATE_TTL_US = MAX_DURATION_US  # a century
#: How long a logged stream keeps a record, and how many bytes of records it keeps, by
#: default (millwheel.runtime.retention; docs/service.md, "Log retention"): a week, as
#: Kafka's retention.ms, so a subscriber that was away over a weekend still resumes;
#: and 256 MiB, so a deployment's logs are bounded by the number of logged streams
#: whatever their rate (the 25-minute run of issue 27 wrote ~0.5 MB a minute per sink:
#: 256 MiB is ~8 hours of it, a week of a sink writing ~25 KB a minute).
DEFAULT_LOG_RETENTION_US = 7 * 86_400 * 1_000_000
DEFAULT_LOG_RETENTION_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Options:
    exactly_once: bool = True
    productions: Productions = Productions.STRONG
    late_policy: LatePolicy = LatePolicy.PROCESS
    late_stream: str | None = None
    allowed_lateness_us: int = 0
    key_ranges: int = 4
    record_id_retention_us: int = 3_600_000_000  # one hour of processing time
    on_error: ErrorPolicy = ErrorPolicy.DEAD_LETTER
    max_attempts: int = 3
    dead_letter_stream: str | None = None  # None: "<computation>.dead_letters"
    max_batch_seconds: float = 60.0  # deadline on user code per batch (services/worker/watchdog.py)
    state_ttl_us: int | None = None  # per-key state expiry after its last write (millwheel.runtime.ttl)
    # Retention of the logged streams it writes (outputs, late and dead-letter stream); 0 = no limit
    log_retention_us: int = DEFAULT_LOG_RETENTION_US
    log_retention_bytes: int = DEFAULT_LOG_RETENTION_BYTES

    def validate(self, where: str) -> None:
        if not 1 <= self.key_ranges <= MAX_KEY_RANGES:
            raise InvalidSpecError(
                f"{where}.options.key_ranges: must be 1..{MAX_KEY_RANGES} (the limit of key "
                f"ranges per computation), got {self.key_ranges}")
        for name, low in (("allowed_lateness_us", 0), ("record_id_retention_us", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_DURATION_US:
                raise InvalidSpecError(
                    f"{where}.options.{name}: must be an integer {low}..{MAX_DURATION_US} "
                    f"(microseconds: at most a century), got {value!r}")
        if not 0 < self.max_batch_seconds <= 86_400:
            raise InvalidSpecError(
                f"{where}: max_batch_seconds must be > 0 and <= 86400, got {self.max_batch_seconds}")
        if self.late_policy is LatePolicy.ROUTE and not self.late_stream:
            raise InvalidSpecError(f"{where}: late_policy 'route' needs a late_stream")
        if not isinstance(self.on_error, ErrorPolicy):
            raise InvalidSpecError(f"{where}: on_error must be one of {[p.value for p in ErrorPolicy]}")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) \
                or not 1 <= self.max_attempts <= 1000:
            raise InvalidSpecError(f"{where}: max_attempts must be an integer 1..1000, got {self.max_attempts!r}")
        if self.state_ttl_us is not None and (
                isinstance(self.state_ttl_us, bool) or not isinstance(self.state_ttl_us, int)
                or not MIN_STATE_TTL_US <= self.state_ttl_us <= MAX_STATE_TTL_US):
            raise InvalidSpecError(
                f"{where}: state_ttl_us must be an integer {MIN_STATE_TTL_US}..{MAX_STATE_TTL_US} "
                f"(microseconds) or unset, got {self.state_ttl_us!r}")
        for name, low, high, unit in (
                ("log_retention_us", MIN_LOG_RETENTION_US, MAX_LOG_RETENTION_US, "microseconds"),
                ("log_retention_bytes", MIN_LOG_RETENTION_BYTES, MAX_LOG_RETENTION_BYTES, "bytes")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not (value == 0 or low <= value <= high):
                raise InvalidSpecError(
                    f"{where}: {name} must be 0 (no limit) or an integer {low}..{high} ({unit}), "
                    f"got {value!r}")
        if self.dead_letter_stream is not None and (
                not isinstance(self.dead_letter_stream, str) or not self.dead_letter_stream):
            raise InvalidSpecError(f"{where}: dead_letter_stream must be a non-empty stream name")


@dataclass(frozen=True)
class InputSpec:
    stream: str
    key_extractor: KeyExtractor = field(default_factory=KeyExtractor)


@dataclass(frozen=True)
class CodeRef:
    """The code of a computation: a built-in operator name or ``pkg.module:Class``."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_builtin(self) -> bool:
        return ":" not in self.name


@dataclass(frozen=True)
class ComputationSpec:
    name: str
    inputs: tuple[InputSpec, ...]
    outputs: tuple[str, ...]
    code: CodeRef
    options: Options = field(default_factory=Options)

    def all_outputs(self) -> tuple[str, ...]:
        """The streams user code may produce to: ``outputs`` and the late stream."""
        late = self.options.late_stream
        if late and late not in self.outputs:
            return (*self.outputs, late)
        return self.outputs

    @property
    def dead_letter_stream(self) -> str:
        return self.options.dead_letter_stream or f"{self.name}.dead_letters"

    def written_streams(self) -> tuple[str, ...]:
        """Every stream the computation writes: :meth:`all_outputs` plus, under the
        ``dead_letter`` error policy, its dead-letter stream (written by the runtime)."""
        outputs = self.all_outputs()
        if self.options.on_error is ErrorPolicy.DEAD_LETTER and self.dead_letter_stream not in outputs:
            return (*outputs, self.dead_letter_stream)
        return outputs


@dataclass(frozen=True)
class InjectorSpec:
    """A source of records: an injector writes to one stream and reports a watermark.
    With a ``source`` it pulls from an external system (millwheel.connectors) and
    writes entries that are not records to its dead-letter stream."""

    name: str
    stream: str
    source: ConnectorSpec | None = None
    #: Key ranges of the injector, placed on workers like a computation's: clients write
    #: each record straight to the worker owning its key's range (docs/service.md,
    #: "Parallel ingestion"). An injector with a ``source`` is pulled by one worker: 1.
    key_ranges: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.key_ranges <= MAX_KEY_RANGES:
            raise InvalidSpecError(f"injector {self.name!r}: key_ranges must be 1..{MAX_KEY_RANGES}, "
                                   f"got {self.key_ranges}")
        if self.source is not None and self.key_ranges != 1:
            raise InvalidSpecError(f"injector {self.name!r}: an injector with a source is read by one "
                                   f"worker and has 1 key range, not {self.key_ranges}")

    @property
    def dead_letter_stream(self) -> str:
        return f"{self.name}.dead_letters"

    def written_streams(self) -> tuple[str, ...]:
        return (self.stream, self.dead_letter_stream) if self.source is not None else (self.stream,)


@dataclass(frozen=True)
class Topology:
    computations: tuple[ComputationSpec, ...] = ()
    injectors: tuple[InjectorSpec, ...] = ()
    #: Streams also written to the durable stream log although a computation consumes
    #: them (a Spark stage's input, for backfill). Sink streams are always logged.
    log_streams: tuple[str, ...] = ()
    #: Streams written to external systems (millwheel.runtime.sink_runner); logged.
    sinks: tuple[SinkSpec, ...] = ()

    @cached_property
    def _by_name(self) -> dict[str, ComputationSpec]:
        """Computations by name (the first of a name, as a scan would find), built once:
        a registry holds up to 1,000 and the controller looks each up per heartbeat."""
        out: dict[str, ComputationSpec] = {}
        for spec in self.computations:
            out.setdefault(spec.name, spec)
        return out

    @cached_property
    def _injectors_by_name(self) -> dict[str, InjectorSpec]:
        out: dict[str, InjectorSpec] = {}
        for inj in self.injectors:
            out.setdefault(inj.name, inj)
        return out

    def injector(self, name: str) -> InjectorSpec | None:
        """The injector of that name, if any (looked up per injected batch by workers)."""
        return self._injectors_by_name.get(name)

    @cached_property
    def _producers(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for spec in self.computations:
            for stream in dict.fromkeys(spec.written_streams()):
                out.setdefault(stream, []).append(spec.name)
        for inj in self.injectors:
            for stream in dict.fromkeys(inj.written_streams()):  # a pulling source's dead letters too
                out.setdefault(stream, []).append(injector_node(inj.name))
        return out

    def computation(self, name: str) -> ComputationSpec:
        spec = self._by_name.get(name)
        if spec is None:
            raise InvalidSpecError(f"no computation named {name!r}")
        return spec

    def consumers(self, stream: str) -> list[tuple[ComputationSpec, InputSpec]]:
        return [
            (spec, inp) for spec in self.computations for inp in spec.inputs if inp.stream == stream
        ]

    def producers(self, stream: str) -> list[str]:
        """Names of computations and injectors (``injector:NAME``) writing ``stream``."""
        return list(self._producers.get(stream, ()))

    def upstream(self, name: str) -> list[str]:
        """Nodes whose output watermark bounds the input watermark of ``name``: a
        computation, or a connector sink's node (``sink:NAME``: whatever writes its stream)."""
        if is_sink(name):
            sink = next((s for s in self.sinks if sink_node(s.name) == name), None)
            if sink is None:
                raise InvalidSpecError(f"no sink {name_of(name)!r}")
            return self.producers(sink.stream)
        spec = self.computation(name)
        ups: list[str] = []
        for inp in spec.inputs:
            for producer in self.producers(inp.stream):
                if producer not in ups:
                    ups.append(producer)
        return ups

    def logged_streams(self) -> list[str]:
        """Every stream written to the durable stream log: sinks plus ``log_streams``."""
        return sorted(set(self.sink_streams()) | set(self.log_streams) | {s.stream for s in self.sinks})

    def sink_streams(self) -> list[str]:
        """Streams produced but consumed by no computation: written to the stream log."""
        produced = [s for spec in self.computations for s in spec.written_streams()]
        produced += [s for inj in self.injectors for s in inj.written_streams()]
        consumed = {inp.stream for spec in self.computations for inp in spec.inputs}
        return sorted({s for s in produced if s not in consumed})

    def with_computation(self, spec: ComputationSpec) -> Topology:
        return Topology((*self.computations, spec), self.injectors, self.log_streams, self.sinks)

    def validate(self) -> None:
        self._check_names()
        names: set[str] = set()
        for spec in self.computations:
            where = f"computation {spec.name!r}"
            if is_injector(spec.name):
                raise InvalidSpecError(
                    f"{where}: invalid name (the prefix {NodeKind.INJECTOR.value!r} names injectors)")
            if spec.name in names:
                raise InvalidSpecError(f"{where}: defined twice")
            names.add(spec.name)
            if not spec.inputs:
                raise InvalidSpecError(f"{where}: needs at least one input stream")
            spec.options.validate(where)
        injector_names: set[str] = set()
        for inj in self.injectors:
            if inj.name in injector_names:
                raise InvalidSpecError(f"injector {inj.name!r}: defined twice")
            injector_names.add(inj.name)
        produced = {s for spec in self.computations for s in spec.written_streams()}
        produced |= {s for inj in self.injectors for s in inj.written_streams()}
        sink_names: set[str] = set()
        for sink in self.sinks:
            if sink.name in sink_names:
                raise InvalidSpecError(f"sink {sink.name!r}: defined twice")
            sink_names.add(sink.name)
            if sink.stream not in produced:
                raise InvalidSpecError(f"sink {sink.name!r}: stream {sink.stream!r} is produced by no "
                                       "computation or injector")
        for spec in self.computations:
            for inp in spec.inputs:
                if inp.stream not in produced:
                    raise InvalidSpecError(
                        f"computation {spec.name!r}: input stream {inp.stream!r} is produced "
                        "by no computation or injector"
                    )
        self._check_acyclic()

    def _check_names(self) -> None:
        """Every name and count within :mod:`millwheel.limits` (before anything else
        looks at them: a name ends up in logs, metric labels and store keys)."""
        if len(self.computations) > MAX_COMPUTATIONS:
            raise InvalidSpecError(f"topology: {len(self.computations)} computations, over the "
                                   f"limit of {MAX_COMPUTATIONS}")
        if len(self.injectors) > MAX_INJECTORS:
            raise InvalidSpecError(f"topology: {len(self.injectors)} injectors, over the limit "
                                   f"of {MAX_INJECTORS}")
        for spec in self.computations:
            check_name(spec.name, "computation")
            where = f"computation {spec.name!r}"
            for kind, streams in (("inputs", [i.stream for i in spec.inputs]), ("outputs", spec.outputs)):
                if len(streams) > MAX_STREAMS_PER_COMPUTATION:
                    raise InvalidSpecError(f"{where}.{kind}: {len(streams)} streams, over the limit "
                                           f"of {MAX_STREAMS_PER_COMPUTATION}")
                for i, stream in enumerate(streams):
                    check_name(stream, f"{where}.{kind}[{i}] stream")
            if spec.options.late_stream:
                check_name(spec.options.late_stream, f"{where}.options.late_stream")
        for inj in self.injectors:
            check_name(inj.name, "injector")
            check_name(inj.stream, f"injector {inj.name!r} stream")
        if len(self.log_streams) > MAX_LOG_STREAMS:
            raise InvalidSpecError(f"topology: {len(self.log_streams)} log streams, over the limit "
                                   f"of {MAX_LOG_STREAMS}")
        for stream in self.log_streams:
            check_name(stream, "log stream")

    def _check_acyclic(self) -> None:
        visiting: set[str] = set()
        done: set[str] = set()

        def visit(name: str, path: list[str]) -> None:
            if name in done:
                return
            if name in visiting:
                raise InvalidSpecError(f"cycle in topology: {' -> '.join([*path, name])}")
            visiting.add(name)
            for up in self.upstream(name):
                if not is_injector(up):
                    visit(up, [*path, name])
            visiting.discard(name)
            done.add(name)

        for spec in self.computations:
            visit(spec.name, [])


