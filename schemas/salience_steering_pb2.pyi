from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Positions(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POSITIONS_UNSPECIFIED: _ClassVar[Positions]
    POSITIONS_PROMPT: _ClassVar[Positions]
    POSITIONS_GENERATED: _ClassVar[Positions]
    POSITIONS_BOTH: _ClassVar[Positions]
POSITIONS_UNSPECIFIED: Positions
POSITIONS_PROMPT: Positions
POSITIONS_GENERATED: Positions
POSITIONS_BOTH: Positions

class SteeringEntry(_message.Message):
    __slots__ = ("concept", "direction", "layer", "scale", "norm_match", "positions")
    CONCEPT_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    NORM_MATCH_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    concept: str
    direction: _containers.RepeatedScalarFieldContainer[float]
    layer: int
    scale: float
    norm_match: bool
    positions: Positions
    def __init__(self, concept: _Optional[str] = ..., direction: _Optional[_Iterable[float]] = ..., layer: _Optional[int] = ..., scale: _Optional[float] = ..., norm_match: _Optional[bool] = ..., positions: _Optional[_Union[Positions, str]] = ...) -> None: ...

class SetSteeringRequest(_message.Message):
    __slots__ = ("session_id", "entries")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    entries: _containers.RepeatedCompositeFieldContainer[SteeringEntry]
    def __init__(self, session_id: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[SteeringEntry, _Mapping]]] = ...) -> None: ...

class SetSteeringResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[SteeringEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[SteeringEntry, _Mapping]]] = ...) -> None: ...

class GetSteeringRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class GetSteeringResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[SteeringEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[SteeringEntry, _Mapping]]] = ...) -> None: ...
