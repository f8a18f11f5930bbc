from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetFeatureManifestRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class FeatureManifest(_message.Message):
    __slots__ = ("layers", "widths", "labelled")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    WIDTHS_FIELD_NUMBER: _ClassVar[int]
    LABELLED_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    widths: _containers.RepeatedScalarFieldContainer[int]
    labelled: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layers: _Optional[_Iterable[int]] = ..., widths: _Optional[_Iterable[int]] = ..., labelled: _Optional[_Iterable[int]] = ...) -> None: ...

class GetFeaturesRequest(_message.Message):
    __slots__ = ("session_id", "start", "end", "top_k", "layers", "ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start: int
    end: int
    top_k: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., top_k: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Feature(_message.Message):
    __slots__ = ("id", "activation", "label")
    ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    id: int
    activation: float
    label: str
    def __init__(self, id: _Optional[int] = ..., activation: _Optional[float] = ..., label: _Optional[str] = ...) -> None: ...

class LayerFeatures(_message.Message):
    __slots__ = ("layer", "top", "watched")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    WATCHED_FIELD_NUMBER: _ClassVar[int]
    layer: int
    top: _containers.RepeatedCompositeFieldContainer[Feature]
    watched: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, layer: _Optional[int] = ..., top: _Optional[_Iterable[_Union[Feature, _Mapping]]] = ..., watched: _Optional[_Iterable[float]] = ...) -> None: ...

class PositionFeatures(_message.Message):
    __slots__ = ("position", "token_id", "layers")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    position: int
    token_id: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerFeatures]
    def __init__(self, position: _Optional[int] = ..., token_id: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerFeatures, _Mapping]]] = ...) -> None: ...
