from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    PREFILL: _ClassVar[Role]
    DECODE: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
PREFILL: Role
DECODE: Role

class Grant(_message.Message):
    __slots__ = ("capacity_share", "capacity_epoch", "token_share")
    CAPACITY_SHARE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_SHARE_FIELD_NUMBER: _ClassVar[int]
    capacity_share: int
    capacity_epoch: int
    token_share: int
    def __init__(self, capacity_share: _Optional[int] = ..., capacity_epoch: _Optional[int] = ..., token_share: _Optional[int] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("node_id", "role", "endpoint", "running_max_req_size", "start_args", "agent_version", "incarnation", "grant", "engine_down", "engine_reason", "stream_id", "kv_tokens")
    class StartArgsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    RUNNING_MAX_REQ_SIZE_FIELD_NUMBER: _ClassVar[int]
    START_ARGS_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_DOWN_FIELD_NUMBER: _ClassVar[int]
    ENGINE_REASON_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: Role
    endpoint: str
    running_max_req_size: int
    start_args: _containers.ScalarMap[str, str]
    agent_version: str
    incarnation: int
    grant: Grant
    engine_down: bool
    engine_reason: str
    stream_id: int
    kv_tokens: int
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., endpoint: _Optional[str] = ..., running_max_req_size: _Optional[int] = ..., start_args: _Optional[_Mapping[str, str]] = ..., agent_version: _Optional[str] = ..., incarnation: _Optional[int] = ..., grant: _Optional[_Union[Grant, _Mapping]] = ..., engine_down: _Optional[bool] = ..., engine_reason: _Optional[str] = ..., stream_id: _Optional[int] = ..., kv_tokens: _Optional[int] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("running", "waiting", "kv_usage", "probe_ok", "retractions", "prefill_backlog_tokens")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    PROBE_OK_FIELD_NUMBER: _ClassVar[int]
    RETRACTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BACKLOG_TOKENS_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_usage: float
    probe_ok: bool
    retractions: int
    prefill_backlog_tokens: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., probe_ok: _Optional[bool] = ..., retractions: _Optional[int] = ..., prefill_backlog_tokens: _Optional[int] = ...) -> None: ...

class Report(_message.Message):
    __slots__ = ("load", "grant", "seq", "engine_down", "engine_reason")
    LOAD_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ENGINE_DOWN_FIELD_NUMBER: _ClassVar[int]
    ENGINE_REASON_FIELD_NUMBER: _ClassVar[int]
    load: Load
    grant: Grant
    seq: int
    engine_down: bool
    engine_reason: str
    def __init__(self, load: _Optional[_Union[Load, _Mapping]] = ..., grant: _Optional[_Union[Grant, _Mapping]] = ..., seq: _Optional[int] = ..., engine_down: _Optional[bool] = ..., engine_reason: _Optional[str] = ...) -> None: ...

class Leaving(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("register", "report", "leaving")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    register: Register
    report: Report
    leaving: Leaving
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., report: _Optional[_Union[Report, _Mapping]] = ..., leaving: _Optional[_Union[Leaving, _Mapping]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("master_id", "applied_epoch", "active_slots", "wanted_slots", "seq", "draining", "kept_slots", "floor_slots", "active_tokens", "wanted_tokens", "kept_tokens")
    MASTER_ID_FIELD_NUMBER: _ClassVar[int]
    APPLIED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    WANTED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    KEPT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FLOOR_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WANTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    master_id: str
    applied_epoch: int
    active_slots: int
    wanted_slots: int
    seq: int
    draining: bool
    kept_slots: int
    floor_slots: int
    active_tokens: int
    wanted_tokens: int
    kept_tokens: int
    def __init__(self, master_id: _Optional[str] = ..., applied_epoch: _Optional[int] = ..., active_slots: _Optional[int] = ..., wanted_slots: _Optional[int] = ..., seq: _Optional[int] = ..., draining: _Optional[bool] = ..., kept_slots: _Optional[int] = ..., floor_slots: _Optional[int] = ..., active_tokens: _Optional[int] = ..., wanted_tokens: _Optional[int] = ..., kept_tokens: _Optional[int] = ...) -> None: ...

class MasterMessage(_message.Message):
    __slots__ = ("ack",)
    ACK_FIELD_NUMBER: _ClassVar[int]
    ack: Ack
    def __init__(self, ack: _Optional[_Union[Ack, _Mapping]] = ...) -> None: ...
