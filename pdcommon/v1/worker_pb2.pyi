from pdcommon.v1 import router_pb2 as _router_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "transfer_address", "num_blocks", "block_size", "model", "model_fingerprint", "kv_layout", "incarnation", "transfer_public_key")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    address: str
    transfer_address: str
    num_blocks: int
    block_size: int
    model: str
    model_fingerprint: str
    kv_layout: KVLayout
    incarnation: str
    transfer_public_key: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., transfer_address: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., model: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., kv_layout: _Optional[_Union[KVLayout, _Mapping]] = ..., incarnation: _Optional[str] = ..., transfer_public_key: _Optional[str] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("dtype", "block_shape")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    block_shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[str] = ..., block_shape: _Optional[_Iterable[int]] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("accepted", "message")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    message: str
    def __init__(self, accepted: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "status", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    status: _router_pb2.WorkerStatus
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., status: _Optional[_Union[_router_pb2.WorkerStatus, _Mapping]] = ..., incarnation: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker_id", "incarnation", "unfinished")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    UNFINISHED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    unfinished: int
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., unfinished: _Optional[int] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known", "drain")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    drain: bool
    def __init__(self, known: _Optional[bool] = ..., drain: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_transfer_address", "skip_blocks", "transfer_timeout_s", "attempt", "resume_token_ids", "transfer_key", "decode_transfer_public_key")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_KEY_FIELD_NUMBER: _ClassVar[int]
    DECODE_TRANSFER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _router_pb2.SamplingParams
    decode_transfer_address: str
    skip_blocks: int
    transfer_timeout_s: float
    attempt: int
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    transfer_key: bytes
    decode_transfer_public_key: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_router_pb2.SamplingParams, _Mapping]] = ..., decode_transfer_address: _Optional[str] = ..., skip_blocks: _Optional[int] = ..., transfer_timeout_s: _Optional[float] = ..., attempt: _Optional[int] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., transfer_key: _Optional[bytes] = ..., decode_transfer_public_key: _Optional[str] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs", "text", "finish_reason", "cached_tokens", "prefill_s", "prompt_logprobs", "prompt_top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _router_pb2.TopLogprobs
    text: str
    finish_reason: str
    cached_tokens: int
    prefill_s: float
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[_router_pb2.TopLogprobs]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Union[_router_pb2.TopLogprobs, _Mapping]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., prefill_s: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[_router_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first",)
    FIRST_FIELD_NUMBER: _ClassVar[int]
    first: FirstToken
    def __init__(self, first: _Optional[_Union[FirstToken, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "transfer_timeout_s", "attempt", "prefill_here", "resume_token_ids", "transfer_key", "token_port", "token_key")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HERE_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_PORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_KEY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _router_pb2.SamplingParams
    transfer_timeout_s: float
    attempt: int
    prefill_here: bool
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    transfer_key: bytes
    token_port: int
    token_key: bytes
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_router_pb2.SamplingParams, _Mapping]] = ..., transfer_timeout_s: _Optional[float] = ..., attempt: _Optional[int] = ..., prefill_here: _Optional[bool] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., transfer_key: _Optional[bytes] = ..., token_port: _Optional[int] = ..., token_key: _Optional[bytes] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("ok", "num_held_blocks", "free_blocks")
    OK_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    num_held_blocks: int
    free_blocks: int
    def __init__(self, ok: _Optional[bool] = ..., num_held_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ...) -> None: ...

class DecodeTokens(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "top_logprobs", "finish_reason", "kv_transfer_s", "kv_transfer_bytes", "index", "decode_batch")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DECODE_BATCH_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_router_pb2.TopLogprobs]
    finish_reason: str
    kv_transfer_s: float
    kv_transfer_bytes: int
    index: int
    decode_batch: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_router_pb2.TopLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., kv_transfer_s: _Optional[float] = ..., kv_transfer_bytes: _Optional[int] = ..., index: _Optional[int] = ..., decode_batch: _Optional[float] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("reservation", "tokens", "first")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    reservation: Reservation
    tokens: DecodeTokens
    first: FirstToken
    def __init__(self, reservation: _Optional[_Union[Reservation, _Mapping]] = ..., tokens: _Optional[_Union[DecodeTokens, _Mapping]] = ..., first: _Optional[_Union[FirstToken, _Mapping]] = ...) -> None: ...
