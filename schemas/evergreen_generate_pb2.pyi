from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateConfig(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop_strings", "ignore_eos", "top_logprobs", "priority", "chat_template", "steering", "deterministic", "readout_encoding_format", "readout_dtype", "features", "logprobs_encoding_format", "logprobs_dtype")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    STEERING_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    READOUT_ENCODING_FORMAT_FIELD_NUMBER: _ClassVar[int]
    READOUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_ENCODING_FORMAT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    top_logprobs: int
    priority: int
    chat_template: bool
    steering: _containers.RepeatedCompositeFieldContainer[SteeringEntry]
    deterministic: bool
    readout_encoding_format: str
    readout_dtype: str
    features: FeatureConfig
    logprobs_encoding_format: str
    logprobs_dtype: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., priority: _Optional[int] = ..., chat_template: _Optional[bool] = ..., steering: _Optional[_Iterable[_Union[SteeringEntry, _Mapping]]] = ..., deterministic: _Optional[bool] = ..., readout_encoding_format: _Optional[str] = ..., readout_dtype: _Optional[str] = ..., features: _Optional[_Union[FeatureConfig, _Mapping]] = ..., logprobs_encoding_format: _Optional[str] = ..., logprobs_dtype: _Optional[str] = ...) -> None: ...

class FeatureConfig(_message.Message):
    __slots__ = ("top_k", "layers", "ids")
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    top_k: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, top_k: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., ids: _Optional[_Iterable[int]] = ...) -> None: ...

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
    positions: str
    gate: SteeringGate
    feature: int
    clamp: float
    def __init__(self, concept: _Optional[str] = ..., direction: _Optional[_Iterable[float]] = ..., layer: _Optional[int] = ..., scale: _Optional[float] = ..., norm_match: _Optional[bool] = ..., positions: _Optional[str] = ..., gate: _Optional[_Union[SteeringGate, _Mapping]] = ..., feature: _Optional[int] = ..., clamp: _Optional[float] = ...) -> None: ...

class SteeringGate(_message.Message):
    __slots__ = ("concept", "layer", "comparison", "threshold", "feature")
    CONCEPT_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    COMPARISON_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    concept: str
    layer: int
    comparison: str
    threshold: float
    feature: int
    def __init__(self, concept: _Optional[str] = ..., layer: _Optional[int] = ..., comparison: _Optional[str] = ..., threshold: _Optional[float] = ..., feature: _Optional[int] = ...) -> None: ...
