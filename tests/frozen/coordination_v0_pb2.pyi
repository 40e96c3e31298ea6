from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    PREFILL: _ClassVar[Role]
    DECODE: _ClassVar[Role]

ROLE_UNSPECIFIED: Role
PREFILL: Role
DECODE: Role

class Register(_message.Message):
    __slots__ = (
        "agent_version",
        "endpoint",
        "incarnation",
        "node_id",
        "role",
        "running_max_req_size",
        "start_args",
    )
    class StartArgsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: str | None = ..., value: str | None = ...) -> None: ...

    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    RUNNING_MAX_REQ_SIZE_FIELD_NUMBER: _ClassVar[int]
    START_ARGS_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: Role
    endpoint: str
    running_max_req_size: int
    start_args: _containers.ScalarMap[str, str]
    agent_version: str
    incarnation: int
    def __init__(
        self,
        node_id: str | None = ...,
        role: Role | str | None = ...,
        endpoint: str | None = ...,
        running_max_req_size: int | None = ...,
        start_args: _Mapping[str, str] | None = ...,
        agent_version: str | None = ...,
        incarnation: int | None = ...,
    ) -> None: ...

class Load(_message.Message):
    __slots__ = ("kv_usage", "probe_ok", "running", "waiting")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    PROBE_OK_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_usage: float
    probe_ok: bool
    def __init__(
        self,
        running: int | None = ...,
        waiting: int | None = ...,
        kv_usage: float | None = ...,
        probe_ok: bool | None = ...,
    ) -> None: ...

class Report(_message.Message):
    __slots__ = ("load", "seq")
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    load: Load
    seq: int
    def __init__(self, load: Load | _Mapping | None = ..., seq: int | None = ...) -> None: ...

class Leaving(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: str | None = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("leaving", "register", "report")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    register: Register
    report: Report
    leaving: Leaving
    def __init__(
        self,
        register: Register | _Mapping | None = ...,
        report: Report | _Mapping | None = ...,
        leaving: Leaving | _Mapping | None = ...,
    ) -> None: ...

class Ack(_message.Message):
    __slots__ = ("active_slots", "applied_epoch", "master_id")
    MASTER_ID_FIELD_NUMBER: _ClassVar[int]
    APPLIED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    master_id: str
    applied_epoch: int
    active_slots: int
    def __init__(
        self, master_id: str | None = ..., applied_epoch: int | None = ..., active_slots: int | None = ...
    ) -> None: ...

class MasterMessage(_message.Message):
    __slots__ = ("ack",)
    ACK_FIELD_NUMBER: _ClassVar[int]
    ack: Ack
    def __init__(self, ack: Ack | _Mapping | None = ...) -> None: ...
