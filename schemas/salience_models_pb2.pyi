from prismgate.schemas import salience_pb2 as _salience_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_STATE_UNSPECIFIED: _ClassVar[ModelState]
    MODEL_STATE_LOADING: _ClassVar[ModelState]
    MODEL_STATE_READY: _ClassVar[ModelState]
    MODEL_STATE_FAILED: _ClassVar[ModelState]
    MODEL_STATE_STOPPING: _ClassVar[ModelState]
MODEL_STATE_UNSPECIFIED: ModelState
MODEL_STATE_LOADING: ModelState
MODEL_STATE_READY: ModelState
MODEL_STATE_FAILED: ModelState
MODEL_STATE_STOPPING: ModelState

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[Model]
    def __init__(self, models: _Optional[_Iterable[_Union[Model, _Mapping]]] = ...) -> None: ...

class Model(_message.Message):
    __slots__ = ("name", "is_default", "state", "reason", "engine", "max_model_len", "has_concept_pack", "has_steering", "takes_images")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    HAS_CONCEPT_PACK_FIELD_NUMBER: _ClassVar[int]
    HAS_STEERING_FIELD_NUMBER: _ClassVar[int]
    TAKES_IMAGES_FIELD_NUMBER: _ClassVar[int]
    name: str
    is_default: bool
    state: ModelState
    reason: str
    engine: str
    max_model_len: int
    has_concept_pack: bool
    has_steering: bool
    takes_images: bool
    def __init__(self, name: _Optional[str] = ..., is_default: _Optional[bool] = ..., state: _Optional[_Union[ModelState, str]] = ..., reason: _Optional[str] = ..., engine: _Optional[str] = ..., max_model_len: _Optional[int] = ..., has_concept_pack: _Optional[bool] = ..., has_steering: _Optional[bool] = ..., takes_images: _Optional[bool] = ...) -> None: ...

class GetReadoutManifestRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...
