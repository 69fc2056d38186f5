"""Stand-in SRL modules for install() tests, hand-written to the shape of SRL's package layout.

They carry only what the adapter touches: the buffer module's ``make_buffer`` (unknown names
give None, as in openpsi-project/srl) and buffer classes, the config dataclasses, the sample
stream factories (distributed layout) or type registries (local layouts), names and an
in-memory name-resolve. Transports are the driver's real ZMQ producers and consumers. The
modules live in ``sys.modules`` only for the test that asks for them (monkeypatch removes them).
"""

from __future__ import annotations

import sys
import textwrap
import types
from collections.abc import Iterator

import conduit_srl
import pytest

CONFIG = """
import dataclasses
import enum
from typing import Any, Optional


@dataclasses.dataclass
class WorkerInformation:
    experiment_name: str = "exp"
    trial_name: str = "trial"
    worker_index: int = 0


@dataclasses.dataclass
class SampleStream:
    class Type(enum.Enum):
        NULL = 0
        IP = 1
        NAME = 2
        NAME_ROUND_ROBIN = 4
        SHARED_MEMORY = 7

    type_: Type = Type.NAME
    stream_name: str = ""
    address: str = ""
    serialization_method: str = "pickle"
    batch_size: Optional[int] = None
    worker_info: Optional[WorkerInformation] = None


@dataclasses.dataclass
class TrainerWorker:
    buffer_name: str = "priority_queue"
    buffer_args: dict = dataclasses.field(default_factory=dict)
    sample_stream: Any = None
    buffer_zero_copy: bool = False


@dataclasses.dataclass
class BufferWorker:
    from_sample_stream: Any = None
    to_sample_stream: Any = None
    buffer_name: str = "priority_queue"
    buffer_args: dict = dataclasses.field(default_factory=dict)
"""

BUFFER = """
class Buffer:
    pass


class SimpleQueueBuffer(Buffer):
    def __init__(self, batch_size=None, max_size=1e9):
        self.items = []

    def put(self, x):
        self.items.append(x)

    def empty(self):
        return not self.items


class PrioritizedReplayBuffer(Buffer):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("the stand-in prioritized buffer is never built")

    def update_priorities(self, idxes, priorities):
        raise RuntimeError("the stand-in prioritized buffer is never used")


def make_buffer(name, **buffer_args):
    if name == "simple_queue":
        return SimpleQueueBuffer(**buffer_args)
    # unknown names give None, as in the distributed layout
"""

NAMES = """
def sample_stream(experiment_name, trial_name, stream_name):
    return f"{experiment_name}/{trial_name}/sample_stream/{stream_name}"
"""

NAME_RESOLVE = """
_store = {}


def add_subentry(name, value, **kwargs):
    _store.setdefault(name, []).append(value)
    return name


def get_subtree(name):
    return list(_store.get(name, []))


def reset():
    _store.clear()
"""

DISTRIBUTED_STREAMS = """
import json

import api.config
import base.names as names
import distributed.base.name_resolve as name_resolve
from conduit_srl.testing.driver import ZmqSampleConsumer, ZmqSampleProducer

built = []


class IpSampleProducer(ZmqSampleProducer):
    def __init__(self, target_address, serialization_method="pickle"):
        super().__init__(target_address)


class IpSampleConsumer(ZmqSampleConsumer):
    def __init__(self, address=""):
        super().__init__()


class NameResolvingSampleProducer(ZmqSampleProducer):
    def __init__(self, experiment_name, trial_name, stream_name, rank, serialization_method):
        entries = sorted(name_resolve.get_subtree(names.sample_stream(experiment_name, trial_name, stream_name)))
        assert entries, "no consumer registered"
        self.target = json.loads(entries[rank % len(entries)])["address"]
        super().__init__(self.target)
        built.append(("producer", stream_name, rank))


class NameResolvingSampleConsumer(ZmqSampleConsumer):
    def __init__(self, experiment_name, trial_name, stream_name):
        super().__init__()
        name_resolve.add_subentry(names.sample_stream(experiment_name, trial_name, stream_name),
                                  json.dumps({"address": self.address}))
        built.append(("consumer", stream_name))


def make_producer(spec, worker_info=None):
    if isinstance(spec, str):
        spec = api.config.SampleStream(type_=api.config.SampleStream.Type.NAME, stream_name=spec)
    T = api.config.SampleStream.Type
    if spec.type_ == T.IP:
        return IpSampleProducer(spec.address, spec.serialization_method)
    if spec.type_ == T.NAME:
        return NameResolvingSampleProducer(worker_info.experiment_name, worker_info.trial_name, spec.stream_name,
                                           worker_info.worker_index, spec.serialization_method)
    raise NotImplementedError(spec.type_)


def make_consumer(spec, worker_info=None):
    if isinstance(spec, str):
        spec = api.config.SampleStream(type_=api.config.SampleStream.Type.NAME, stream_name=spec)
    T = api.config.SampleStream.Type
    if spec.type_ == T.IP:
        return IpSampleConsumer(spec.address)
    if spec.type_ == T.NAME:
        return NameResolvingSampleConsumer(worker_info.experiment_name, worker_info.trial_name, spec.stream_name)
    raise NotImplementedError(spec.type_)
"""

REGISTRY_STREAMS = """
import {config} as config_module
from conduit_srl.testing.driver import ZmqSampleConsumer, ZmqSampleProducer

ALL_SAMPLE_PRODUCER_CLS = {{}}
ALL_SAMPLE_CONSUMER_CLS = {{}}


def register_producer(type_, cls):
    ALL_SAMPLE_PRODUCER_CLS[type_] = cls


def register_consumer(type_, cls):
    ALL_SAMPLE_CONSUMER_CLS[type_] = cls


class IpProducer(ZmqSampleProducer):
    def __init__(self, spec):
        self.spec = spec
        super().__init__(spec.address)


class IpConsumer(ZmqSampleConsumer):
    def __init__(self, spec):
        self.spec = spec
        super().__init__()


register_producer(config_module.SampleStream.Type.IP, IpProducer)
register_consumer(config_module.SampleStream.Type.IP, IpConsumer)


def make_producer(spec, worker_info=None):
    if isinstance(spec, str):
        spec = config_module.SampleStream(type_=config_module.SampleStream.Type.NAME, stream_name=spec)
    if spec.worker_info is None:
        spec.worker_info = worker_info
    return ALL_SAMPLE_PRODUCER_CLS[spec.type_](spec)


def make_consumer(spec, worker_info=None):
    if isinstance(spec, str):
        spec = config_module.SampleStream(type_=config_module.SampleStream.Type.NAME, stream_name=spec)
    if spec.worker_info is None:
        spec.worker_info = worker_info
    return ALL_SAMPLE_CONSUMER_CLS[spec.type_](spec)
"""


class Layout:
    """A set of stand-in modules, registered in ``sys.modules`` for one test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, flavour: str) -> None:
        self.mp = monkeypatch
        self.flavour = flavour
        self.modules: dict[str, types.ModuleType] = {}
        if flavour == "srl-local":
            self._add("rlsrl", package=True)
            self._add("rlsrl.api", package=True)
            self._add("rlsrl.api.config", CONFIG)
            self._add("rlsrl.base", package=True)
            self._add("rlsrl.base.buffer", BUFFER)
            self._add("rlsrl.system", package=True)
            self._add("rlsrl.system.api", package=True)
            self._add("rlsrl.system.api.sample_stream", REGISTRY_STREAMS.format(config="rlsrl.api.config"))
            return
        self._add("api", package=True)
        self._add("api.config", CONFIG)
        self._add("base", package=True)
        self._add("base.buffer", BUFFER)
        self._add("base.names", NAMES)
        if flavour in ("distributed", "both"):
            self._add("distributed", package=True)
            self._add("distributed.base", package=True)
            self._add("distributed.base.name_resolve", NAME_RESOLVE)
            self._add("distributed.system", package=True)
            self._add("distributed.system.sample_stream", DISTRIBUTED_STREAMS)
        if flavour in ("local", "both"):
            self._add("local", package=True)
            self._add("local.system", package=True)
            self._add("local.system.sample_stream", REGISTRY_STREAMS.format(config="api.config"))

    def _add(self, name: str, source: str = "", package: bool = False) -> None:
        mod = types.ModuleType(name)
        if package:
            mod.__path__ = []  # type: ignore[attr-defined]
        self.mp.setitem(sys.modules, name, mod)  # removed again after the test
        self.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(self.modules[parent], child, mod)
        exec(compile(textwrap.dedent(source), f"<stand-in {name}>", "exec"), mod.__dict__)

    def __getitem__(self, name: str) -> types.ModuleType:
        return self.modules[name]


@pytest.fixture
def srl_layout(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[Layout]]:
    """``srl_layout(flavour)`` registers stand-in modules; everything is uninstalled and removed afterwards."""
    made: list[Layout] = []

    def make(flavour: str) -> Layout:
        layout = Layout(monkeypatch, flavour)
        made.append(layout)
        return layout

    try:
        yield make  # type: ignore[misc]
    finally:
        conduit_srl.uninstall()


@pytest.fixture
def closing() -> Iterator[object]:
    """``closing(**buffer_args)`` builds a :class:`conduit_srl.ConduitBuffer` that is closed after the test."""
    made: list[conduit_srl.ConduitBuffer] = []

    def make(**kw: object) -> conduit_srl.ConduitBuffer:
        b = conduit_srl.ConduitBuffer(**kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()
