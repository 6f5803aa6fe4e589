from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logprobs", "prompt_logprobs", "logit_bias", "json_schema", "json_object", "regex", "grammar", "structural_tag")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    ignore_eos: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    logprobs: int
    prompt_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    structural_tag: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "text", "token_ids", "sampling", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    text: str
    token_ids: TokenIds
    sampling: SamplingParams
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("token_ids", "text", "first_index", "server_times_s", "gaps_s", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIMES_S_FIELD_NUMBER: _ClassVar[int]
    GAPS_S_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    first_index: int
    server_times_s: _containers.RepeatedScalarFieldContainer[float]
    gaps_s: _containers.RepeatedScalarFieldContainer[float]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., first_index: _Optional[int] = ..., server_times_s: _Optional[_Iterable[float]] = ..., gaps_s: _Optional[_Iterable[float]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Latency(_message.Message):
    __slots__ = ("queue_s", "routing_s", "reservation_wait_s", "prefill_queue_s", "prefill_compute_s", "kv_transfer_s", "kv_transfer_exposed_s", "ttft_s", "decode_s", "e2e_s", "pickup_s", "kv_wait_s", "kv_accept_s", "prefill_pickup_s", "rank_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    ROUTING_S_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_EXPOSED_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    PICKUP_S_FIELD_NUMBER: _ClassVar[int]
    KV_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    KV_ACCEPT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PICKUP_S_FIELD_NUMBER: _ClassVar[int]
    RANK_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    routing_s: float
    reservation_wait_s: float
    prefill_queue_s: float
    prefill_compute_s: float
    kv_transfer_s: float
    kv_transfer_exposed_s: float
    ttft_s: float
    decode_s: float
    e2e_s: float
    pickup_s: float
    kv_wait_s: float
    kv_accept_s: float
    prefill_pickup_s: float
    rank_s: float
    def __init__(self, queue_s: _Optional[float] = ..., routing_s: _Optional[float] = ..., reservation_wait_s: _Optional[float] = ..., prefill_queue_s: _Optional[float] = ..., prefill_compute_s: _Optional[float] = ..., kv_transfer_s: _Optional[float] = ..., kv_transfer_exposed_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., pickup_s: _Optional[float] = ..., kv_wait_s: _Optional[float] = ..., kv_accept_s: _Optional[float] = ..., prefill_pickup_s: _Optional[float] = ..., rank_s: _Optional[float] = ...) -> None: ...

class Attempt(_message.Message):
    __slots__ = ("attempt", "prefill_rank", "delivered", "error", "prompt_tokens", "cached_tokens", "cached_tokens_by_tier", "kv_bytes", "kv_wait_s", "kv_accept_s", "prefill_pickup_s", "prefill_queue_s", "prefill_compute_s", "kv_transfer_s", "kv_transfer_exposed_s")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RANK_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    KV_ACCEPT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PICKUP_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_EXPOSED_S_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    prefill_rank: str
    delivered: bool
    error: str
    prompt_tokens: int
    cached_tokens: int
    cached_tokens_by_tier: CachedTokensByTier
    kv_bytes: int
    kv_wait_s: float
    kv_accept_s: float
    prefill_pickup_s: float
    prefill_queue_s: float
    prefill_compute_s: float
    kv_transfer_s: float
    kv_transfer_exposed_s: float
    def __init__(self, attempt: _Optional[int] = ..., prefill_rank: _Optional[str] = ..., delivered: _Optional[bool] = ..., error: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., cached_tokens_by_tier: _Optional[_Union[CachedTokensByTier, _Mapping]] = ..., kv_bytes: _Optional[int] = ..., kv_wait_s: _Optional[float] = ..., kv_accept_s: _Optional[float] = ..., prefill_pickup_s: _Optional[float] = ..., prefill_queue_s: _Optional[float] = ..., prefill_compute_s: _Optional[float] = ..., kv_transfer_s: _Optional[float] = ..., kv_transfer_exposed_s: _Optional[float] = ...) -> None: ...

class Bill(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "new_prompt_tokens", "output_tokens", "kv_bytes", "latency", "attempts", "preemptions", "migrations", "seed", "speculation", "cached_tokens_by_tier")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    LATENCY_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    new_prompt_tokens: int
    output_tokens: int
    kv_bytes: int
    latency: Latency
    attempts: _containers.RepeatedCompositeFieldContainer[Attempt]
    preemptions: int
    migrations: int
    seed: int
    speculation: Speculation
    cached_tokens_by_tier: CachedTokensByTier
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., new_prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., latency: _Optional[_Union[Latency, _Mapping]] = ..., attempts: _Optional[_Iterable[_Union[Attempt, _Mapping]]] = ..., preemptions: _Optional[int] = ..., migrations: _Optional[int] = ..., seed: _Optional[int] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ..., cached_tokens_by_tier: _Optional[_Union[CachedTokensByTier, _Mapping]] = ...) -> None: ...

class CachedTokensByTier(_message.Message):
    __slots__ = ("device", "host", "store")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    device: int
    host: int
    store: int
    def __init__(self, device: _Optional[int] = ..., host: _Optional[int] = ..., store: _Optional[int] = ...) -> None: ...

class Speculation(_message.Message):
    __slots__ = ("draft_tokens", "accepted_tokens", "steps", "acceptance_length")
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    draft_tokens: int
    accepted_tokens: int
    steps: int
    acceptance_length: float
    def __init__(self, draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., acceptance_length: _Optional[float] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("prefill_group", "prefill_rank", "decode_group", "decode_rank", "predicted_cached_tokens", "route_branch")
    PREFILL_GROUP_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RANK_FIELD_NUMBER: _ClassVar[int]
    DECODE_GROUP_FIELD_NUMBER: _ClassVar[int]
    DECODE_RANK_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_BRANCH_FIELD_NUMBER: _ClassVar[int]
    prefill_group: str
    prefill_rank: str
    decode_group: str
    decode_rank: str
    predicted_cached_tokens: int
    route_branch: str
    def __init__(self, prefill_group: _Optional[str] = ..., prefill_rank: _Optional[str] = ..., decode_group: _Optional[str] = ..., decode_rank: _Optional[str] = ..., predicted_cached_tokens: _Optional[int] = ..., route_branch: _Optional[str] = ...) -> None: ...

class Summary(_message.Message):
    __slots__ = ("finish_reason", "error", "bill", "placement", "token_ids", "text", "prompt_logprobs")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BILL_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    error: str
    bill: Bill
    placement: Placement
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, finish_reason: _Optional[str] = ..., error: _Optional[str] = ..., bill: _Optional[_Union[Bill, _Mapping]] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "summary")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: Chunk
    summary: Summary
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., summary: _Optional[_Union[Summary, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ("check_integrity",)
    CHECK_INTEGRITY_FIELD_NUMBER: _ClassVar[int]
    check_integrity: bool
    def __init__(self, check_integrity: _Optional[bool] = ...) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("name", "role", "queued", "running", "waiting_for_kv", "computing", "transferring", "free_pages", "total_pages", "cached_pages", "transfers_in_flight", "routed_prefill_tokens", "routed_requests", "indexed_blocks", "integrity", "incarnation", "kv_cache_usage_ratio", "sends_in_flight", "receives_in_flight", "kv_bytes_sent", "kv_bytes_received", "prefix_queried_tokens", "prefix_hit_tokens", "preemptions", "transfer_failures", "steps", "step_s", "place", "weight_bytes")
    class TransferFailuresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_KV_FIELD_NUMBER: _ClassVar[int]
    COMPUTING_FIELD_NUMBER: _ClassVar[int]
    TRANSFERRING_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ROUTED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_RATIO_FIELD_NUMBER: _ClassVar[int]
    SENDS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RECEIVES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    PLACE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    queued: int
    running: int
    waiting_for_kv: int
    computing: int
    transferring: int
    free_pages: int
    total_pages: int
    cached_pages: int
    transfers_in_flight: int
    routed_prefill_tokens: int
    routed_requests: int
    indexed_blocks: int
    integrity: str
    incarnation: int
    kv_cache_usage_ratio: float
    sends_in_flight: int
    receives_in_flight: int
    kv_bytes_sent: int
    kv_bytes_received: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    transfer_failures: _containers.ScalarMap[str, int]
    steps: int
    step_s: float
    place: ProcessPlace
    weight_bytes: int
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., queued: _Optional[int] = ..., running: _Optional[int] = ..., waiting_for_kv: _Optional[int] = ..., computing: _Optional[int] = ..., transferring: _Optional[int] = ..., free_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., cached_pages: _Optional[int] = ..., transfers_in_flight: _Optional[int] = ..., routed_prefill_tokens: _Optional[int] = ..., routed_requests: _Optional[int] = ..., indexed_blocks: _Optional[int] = ..., integrity: _Optional[str] = ..., incarnation: _Optional[int] = ..., kv_cache_usage_ratio: _Optional[float] = ..., sends_in_flight: _Optional[int] = ..., receives_in_flight: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., prefix_queried_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., preemptions: _Optional[int] = ..., transfer_failures: _Optional[_Mapping[str, int]] = ..., steps: _Optional[int] = ..., step_s: _Optional[float] = ..., place: _Optional[_Union[ProcessPlace, _Mapping]] = ..., weight_bytes: _Optional[int] = ...) -> None: ...

class ProcessPlace(_message.Message):
    __slots__ = ("node_id", "node_address", "node_labels", "pid")
    class NodeLabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODE_LABELS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    node_address: str
    node_labels: _containers.ScalarMap[str, str]
    pid: int
    def __init__(self, node_id: _Optional[str] = ..., node_address: _Optional[str] = ..., node_labels: _Optional[_Mapping[str, str]] = ..., pid: _Optional[int] = ...) -> None: ...

class FrontendStatus(_message.Message):
    __slots__ = ("name", "address", "metrics_address", "place")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PLACE_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    metrics_address: str
    place: ProcessPlace
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., place: _Optional[_Union[ProcessPlace, _Mapping]] = ...) -> None: ...

class GroupStatus(_message.Message):
    __slots__ = ("group_id", "role", "state", "incarnation", "ranks", "failure", "unplaceable")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    UNPLACEABLE_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    role: str
    state: str
    incarnation: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    failure: str
    unplaceable: bool
    def __init__(self, group_id: _Optional[str] = ..., role: _Optional[str] = ..., state: _Optional[str] = ..., incarnation: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., failure: _Optional[str] = ..., unplaceable: _Optional[bool] = ...) -> None: ...

class ClusterStatusResponse(_message.Message):
    __slots__ = ("model", "ready", "groups", "router_counters", "running_requests", "autoscaler_decisions", "deployment", "controller", "frontends", "clients")
    class RouterCountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_COUNTERS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALER_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    FRONTENDS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    ready: bool
    groups: _containers.RepeatedCompositeFieldContainer[GroupStatus]
    router_counters: _containers.ScalarMap[str, int]
    running_requests: int
    autoscaler_decisions: _containers.RepeatedCompositeFieldContainer[AutoscalerDecision]
    deployment: str
    controller: ProcessPlace
    frontends: _containers.RepeatedCompositeFieldContainer[FrontendStatus]
    clients: _containers.RepeatedCompositeFieldContainer[ClientUsage]
    def __init__(self, model: _Optional[str] = ..., ready: _Optional[bool] = ..., groups: _Optional[_Iterable[_Union[GroupStatus, _Mapping]]] = ..., router_counters: _Optional[_Mapping[str, int]] = ..., running_requests: _Optional[int] = ..., autoscaler_decisions: _Optional[_Iterable[_Union[AutoscalerDecision, _Mapping]]] = ..., deployment: _Optional[str] = ..., controller: _Optional[_Union[ProcessPlace, _Mapping]] = ..., frontends: _Optional[_Iterable[_Union[FrontendStatus, _Mapping]]] = ..., clients: _Optional[_Iterable[_Union[ClientUsage, _Mapping]]] = ...) -> None: ...

class ClientUsage(_message.Message):
    __slots__ = ("client", "requests", "prompt_tokens", "cached_prompt_tokens", "new_prompt_tokens", "output_tokens")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    client: str
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    new_prompt_tokens: int
    output_tokens: int
    def __init__(self, client: _Optional[str] = ..., requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., new_prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ...) -> None: ...

class AutoscalerDecision(_message.Message):
    __slots__ = ("unix_time", "pool", "action", "rule", "ready_groups", "desired_groups", "inputs_json")
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    READY_GROUPS_FIELD_NUMBER: _ClassVar[int]
    DESIRED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_JSON_FIELD_NUMBER: _ClassVar[int]
    unix_time: float
    pool: str
    action: str
    rule: str
    ready_groups: int
    desired_groups: int
    inputs_json: str
    def __init__(self, unix_time: _Optional[float] = ..., pool: _Optional[str] = ..., action: _Optional[str] = ..., rule: _Optional[str] = ..., ready_groups: _Optional[int] = ..., desired_groups: _Optional[int] = ..., inputs_json: _Optional[str] = ...) -> None: ...
