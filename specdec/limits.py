"""Every bound of the gRPC contract, defined once: protos/specdec.proto documents them, the services
enforce them, and the coordinator's flags and policies stay inside them."""

MAX_DRAFT_TOKENS = 32  # draft tokens in one proposal: Propose.max_tokens, Verify.draft_tokens, a request's draft_length
MAX_VERIFY_POSITIONS = MAX_DRAFT_TOKENS + 1  # a verify forward's positions: a whole proposal plus the bonus token
MAX_TREE_NODES = 64  # nodes in one draft tree
MAX_TREE_TOP_K = 16  # children per expanded node (and the most nodes expanded per level)
MAX_TREE_DEPTH = 32  # levels of one draft tree
MAX_DECODE_AHEAD = 1024  # tokens (and passes) one Verify may decode after its verdict (VerifyRequest.decode_ahead)
MAX_STREAM_INTERVAL = 64  # tokens a decoding run's progress may hold before it is sent (DecodeRun.report_every)
MAX_REQUEST_ID = 128  # characters of a client request_id, which travels to the backends in gRPC metadata
MAX_LOOKUP_SOURCE = 32768  # tokens of a predicted output the target's prompt lookup drafts from (VerifyRequest.lookup_source)
MAX_LOGPROBS = 20  # alternatives reported per generated token (a request's logprobs / top_logprobs, as vLLM's default)
