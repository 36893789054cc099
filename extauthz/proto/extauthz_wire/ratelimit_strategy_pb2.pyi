import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import wrappers_pb2 as _wrappers_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenBucket(_message.Message):
    __slots__ = ("max_tokens", "tokens_per_fill", "fill_interval")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_FILL_FIELD_NUMBER: _ClassVar[int]
    FILL_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    tokens_per_fill: _wrappers_pb2.UInt32Value
    fill_interval: _duration_pb2.Duration
    def __init__(self, max_tokens: _Optional[int] = ..., tokens_per_fill: _Optional[_Union[_wrappers_pb2.UInt32Value, _Mapping]] = ..., fill_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class RateLimitStrategy(_message.Message):
    __slots__ = ("blanket_rule", "token_bucket")
    class BlanketRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ALLOW_ALL: _ClassVar[RateLimitStrategy.BlanketRule]
        DENY_ALL: _ClassVar[RateLimitStrategy.BlanketRule]
    ALLOW_ALL: RateLimitStrategy.BlanketRule
    DENY_ALL: RateLimitStrategy.BlanketRule
    BLANKET_RULE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUCKET_FIELD_NUMBER: _ClassVar[int]
    blanket_rule: RateLimitStrategy.BlanketRule
    token_bucket: TokenBucket
    def __init__(self, blanket_rule: _Optional[_Union[RateLimitStrategy.BlanketRule, str]] = ..., token_bucket: _Optional[_Union[TokenBucket, _Mapping]] = ...) -> None: ...
