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

class Comparison(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPARISON_UNSPECIFIED: _ClassVar[Comparison]
    COMPARISON_ABOVE: _ClassVar[Comparison]
    COMPARISON_BELOW: _ClassVar[Comparison]
POSITIONS_UNSPECIFIED: Positions
POSITIONS_PROMPT: Positions
POSITIONS_GENERATED: Positions
POSITIONS_BOTH: Positions
COMPARISON_UNSPECIFIED: Comparison
COMPARISON_ABOVE: Comparison
COMPARISON_BELOW: Comparison

class SteeringEntry(_message.Message):
    __slots__ = ("concept", "direction", "layer", "scale", "norm_match", "positions", "gate", "feature", "clamp")
    CONCEPT_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    NORM_MATCH_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    GATE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    CLAMP_FIELD_NUMBER: _ClassVar[int]
    concept: str
    direction: _containers.RepeatedScalarFieldContainer[float]
    layer: int
    scale: float
    norm_match: bool
    positions: Positions
    gate: Gate
    feature: int
    clamp: float
    def __init__(self, concept: _Optional[str] = ..., direction: _Optional[_Iterable[float]] = ..., layer: _Optional[int] = ..., scale: _Optional[float] = ..., norm_match: _Optional[bool] = ..., positions: _Optional[_Union[Positions, str]] = ..., gate: _Optional[_Union[Gate, _Mapping]] = ..., feature: _Optional[int] = ..., clamp: _Optional[float] = ...) -> None: ...

class Gate(_message.Message):
    __slots__ = ("concept", "layer", "comparison", "threshold", "feature")
    CONCEPT_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    COMPARISON_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    concept: str
    layer: int
    comparison: Comparison
    threshold: float
    feature: int
    def __init__(self, concept: _Optional[str] = ..., layer: _Optional[int] = ..., comparison: _Optional[_Union[Comparison, str]] = ..., threshold: _Optional[float] = ..., feature: _Optional[int] = ...) -> None: ...

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
