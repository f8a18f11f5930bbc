from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class CountImageTokensRequest(_message.Message):
    __slots__ = ("image", "mime", "model")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    MIME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    image: bytes
    mime: str
    model: str
    def __init__(self, image: _Optional[bytes] = ..., mime: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class CountImageTokensResponse(_message.Message):
    __slots__ = ("n_pad_tokens", "vision_start_id", "image_pad_id", "vision_end_id", "block_length")
    N_PAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VISION_START_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_PAD_ID_FIELD_NUMBER: _ClassVar[int]
    VISION_END_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LENGTH_FIELD_NUMBER: _ClassVar[int]
    n_pad_tokens: int
    vision_start_id: int
    image_pad_id: int
    vision_end_id: int
    block_length: int
    def __init__(self, n_pad_tokens: _Optional[int] = ..., vision_start_id: _Optional[int] = ..., image_pad_id: _Optional[int] = ..., vision_end_id: _Optional[int] = ..., block_length: _Optional[int] = ...) -> None: ...
