import datetime

from google.protobuf import any_pb2 as _any_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeFragment(_message.Message):
    __slots__ = ("id", "seq", "continued", "child_ids", "chunk_fragment")
    ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CONTINUED_FIELD_NUMBER: _ClassVar[int]
    CHILD_IDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    id: str
    seq: int
    continued: bool
    child_ids: _containers.RepeatedScalarFieldContainer[str]
    chunk_fragment: Chunk
    def __init__(self, id: _Optional[str] = ..., seq: _Optional[int] = ..., continued: _Optional[bool] = ..., child_ids: _Optional[_Iterable[str]] = ..., chunk_fragment: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("metadata", "ref", "data")
    METADATA_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    metadata: ChunkMetadata
    ref: str
    data: bytes
    def __init__(self, metadata: _Optional[_Union[ChunkMetadata, _Mapping]] = ..., ref: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class ChunkMetadata(_message.Message):
    __slots__ = ("mimetype", "role", "original_file_name", "capture_time", "experimental")
    MIMETYPE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_TIME_FIELD_NUMBER: _ClassVar[int]
    EXPERIMENTAL_FIELD_NUMBER: _ClassVar[int]
    mimetype: str
    role: str
    original_file_name: str
    capture_time: _timestamp_pb2.Timestamp
    experimental: _containers.RepeatedCompositeFieldContainer[_any_pb2.Any]
    def __init__(self, mimetype: _Optional[str] = ..., role: _Optional[str] = ..., original_file_name: _Optional[str] = ..., capture_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., experimental: _Optional[_Iterable[_Union[_any_pb2.Any, _Mapping]]] = ...) -> None: ...

class NamedParameter(_message.Message):
    __slots__ = ("name", "id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    id: str
    def __init__(self, name: _Optional[str] = ..., id: _Optional[str] = ...) -> None: ...

class TargetSpec(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class Action(_message.Message):
    __slots__ = ("name", "inputs", "outputs", "configs", "target_spec")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    CONFIGS_FIELD_NUMBER: _ClassVar[int]
    TARGET_SPEC_FIELD_NUMBER: _ClassVar[int]
    name: str
    inputs: _containers.RepeatedCompositeFieldContainer[NamedParameter]
    outputs: _containers.RepeatedCompositeFieldContainer[NamedParameter]
    configs: _containers.RepeatedCompositeFieldContainer[_any_pb2.Any]
    target_spec: TargetSpec
    def __init__(self, name: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[NamedParameter, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[NamedParameter, _Mapping]]] = ..., configs: _Optional[_Iterable[_Union[_any_pb2.Any, _Mapping]]] = ..., target_spec: _Optional[_Union[TargetSpec, _Mapping]] = ...) -> None: ...

class SessionMessage(_message.Message):
    __slots__ = ("node_fragments", "actions")
    NODE_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    node_fragments: _containers.RepeatedCompositeFieldContainer[NodeFragment]
    actions: _containers.RepeatedCompositeFieldContainer[Action]
    def __init__(self, node_fragments: _Optional[_Iterable[_Union[NodeFragment, _Mapping]]] = ..., actions: _Optional[_Iterable[_Union[Action, _Mapping]]] = ...) -> None: ...
