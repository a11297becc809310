"""Wire format of client-server speculative decoding (see docs/serving.md).

Requests are small JSON bodies (validated by the pydantic models below, which also make the OpenAPI schema).
Every verification answer is one safetensors blob: the LSA context vectors of the newly verified positions as
tensors (fp16, fp32, or int8 with one fp32 scale per vector) and the scalar fields as JSON in the safetensors
header's `__metadata__`. Weights (the drafter a client may download) travel as safetensors too; nothing is pickled.
What a client downloads (the drafter blob and the tokenizer's files) has a revision, `download_revision`, that the
server announces in /v1/info and the client's cache recomputes from the files it holds (see `cache`).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

__all__ = [
    "CONTENT_DIGEST_HEADER",
    "CONTEXT_FORMATS",
    "DRAFTER_FILE",
    "TOKENIZER_DIR",
    "JsonInt",
    "json_int",
    "PROTOCOL_VERSION",
    "CreateSessionRequest",
    "SparseDistribution",
    "VerifyRequest",
    "VerifyResult",
    "LOGIT_BOUND",
    "MAX_IDS",
    "MAX_SPARSE",
    "MAX_TEMPERATURE",
    "MIN_SAMPLING_TEMPERATURE",
    "bounded_request_models",
    "check_content_digest",
    "check_max_new_tokens",
    "check_sampling",
    "content_digest",
    "decode_context",
    "decode_drafter",
    "decode_result",
    "download_digests",
    "download_revision",
    "encode_context",
    "encode_drafter",
    "encode_result",
    "lsa_fingerprint",
    "read_safetensors_metadata",
    "sha256_hex",
    "tokenizer_file_bytes",
]

PROTOCOL_VERSION = 1
CONTEXT_FORMATS = ("fp16", "int8", "fp32")
ContextFormat = Literal["fp16", "int8", "fp32"]
# Hard upper bounds of the schema; the server's configured limits (smaller) are checked with clearer messages.
MAX_IDS = 1 << 20  # token ids in one request field
MAX_SPARSE = 1024  # the support of one drafted token's distribution
_META_KEY = "moa"
# what the server runs for the client (its LSA), and a sorted multi-target drafter's per-target parts (issue 20)
_LSA_PREFIXES = ("lsa_in_proj.", "layer_self_attention.", "Ekv2E.", "target_parts.")
# Where the files of a download live in a client's cache entry (and the names their revision is computed over).
DRAFTER_FILE = "drafter.safetensors"
TOKENIZER_DIR = "tokenizer"
# Create/verify answers carry the sha-256 of their body (RFC 9530): the client retries a corrupted answer.
CONTENT_DIGEST_HEADER = "Content-Digest"

# Sampling ranges, checked by `check_sampling` on both sides (the server's request models and the client's drafter).
# Sampling divides float32 logits by the temperature: for |logits| <= LOGIT_BOUND the quotient stays finite (so the
# softmax has no inf - inf = NaN) down to LOGIT_BOUND / float32 max = 2.94e-35, the lower bound. Below
# `moa_hf.speculative.MIN_TEMPERATURE` (1e-5) both sides sample greedily (the limit of temperature -> 0), so no
# accepted temperature ever reaches that division with an overflow.
LOGIT_BOUND = 1e4
MIN_SAMPLING_TEMPERATURE = LOGIT_BOUND / float(torch.finfo(torch.float32).max)
MAX_TEMPERATURE = 100.0


def _json_int(value):
    """JSON Schema integers include integral floats (5.0); strings and booleans stay invalid."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def json_int(**bounds):
    """An integer type with bounds (`ge`, `lt`, ...) that also takes integral floats (see `_json_int`)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_json_int)]


JsonInt = json_int()


def check_sampling(
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    do_sample: bool = True,
    vocab_size: int | None = None,
) -> None:
    """Raise `ValueError` (naming the field and its range) for sampling parameters the arithmetic cannot take;
    greedy decoding (`do_sample=False`) ignores them. The one check of both sides: the server's request models
    (a 422) and the client before it samples with its drafter."""
    if not do_sample:
        return
    lo, hi = MIN_SAMPLING_TEMPERATURE, MAX_TEMPERATURE
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not lo <= temperature <= hi:
        raise ValueError(
            f"temperature {temperature!r} is outside [{lo:.3g}, {hi:g}]: float32 logits / temperature overflow "
            f"below {lo:.3g} (|logits| <= {LOGIT_BOUND:g}); below 1e-05 sampling is greedy; for greedy decoding "
            "leave do_sample off"
        )
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p {top_p!r} is outside (0, 1]: 1 keeps every token")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k {top_k!r} must be an integer >= 0 (0: no top-k filtering)")
    if vocab_size is not None and top_k > vocab_size:
        raise ValueError(f"top_k {top_k} is outside [0, {vocab_size}]: the vocabulary has {vocab_size} tokens")


def check_max_new_tokens(max_new_tokens: int, prompt_tokens: int | None = None, max_tokens: int | None = None) -> None:
    """Raise `ValueError` unless 1 <= max_new_tokens and the prompt plus the generation (and the target's token
    after it) fit in `max_tokens` (the server's `max_tokens_per_session`; None: no limit known)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens {max_new_tokens!r} must be an integer >= 1")
    if max_tokens is None or prompt_tokens is None:
        return
    if prompt_tokens + 1 > max_tokens:
        raise ValueError(
            f"the prompt has {prompt_tokens} tokens, more than the server's {max_tokens - 1} (it holds "
            f"{max_tokens} tokens per session): shorten the prompt"
        )
    if prompt_tokens + max_new_tokens + 1 > max_tokens:
        raise ValueError(
            f"max_new_tokens {max_new_tokens} is outside [1, {max_tokens - prompt_tokens - 1}] for this "
            f"{prompt_tokens}-token prompt: the server holds {max_tokens} tokens per session"
        )


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


def _request_models(token_id) -> tuple[type[BaseModel], type[BaseModel], type[BaseModel]]:
    """The request models (`SparseDistribution`, `CreateSessionRequest`, `VerifyRequest`) with token ids of type
    `token_id`: each token-id field is declared here once, for this module's models (any id >= 0) and for a server's
    (`bounded_request_models`: ids below its vocabulary size, in its OpenAPI schema too)."""

    class SparseDistribution(_Strict):
        """The drafter's distribution for one drafted token, restricted to its support (speculative sampling)."""

        ids: list[token_id] = Field(min_length=1, max_length=MAX_SPARSE, description="token ids of the support")
        probs: list[Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]] = Field(
            min_length=1, max_length=MAX_SPARSE, description="their probabilities (sum ~ 1)"
        )

    class _Drafts(_Strict):
        draft_ids: list[token_id] = Field(
            default_factory=list, max_length=MAX_IDS, description="tokens to verify, in order"
        )
        draft_probs: list[SparseDistribution] | None = Field(
            default=None, max_length=MAX_IDS, description="with do_sample: one distribution per drafted token"
        )
        context_from: json_int(ge=0) | None = Field(
            default=None, description="first position whose context vector to return (default: the first new one)"
        )
        want_context: bool = Field(default=True, description="false: return no context vectors (plain decoding)")
        context_format: ContextFormat = "fp16"

    class CreateSessionRequest(_Drafts):
        """Start a generation: `input_ids` are all verified (a prompt, or a verified prefix after a lost session)."""

        input_ids: list[token_id] = Field(min_length=1, max_length=MAX_IDS)
        max_new_tokens: json_int(ge=1, le=MAX_IDS) | None = Field(
            default=None,
            description="the most tokens the client will generate (the server reserves cache memory for the prompt, "
            "them and the drafts); None: up to the server's tokens per session",
        )
        do_sample: bool = False
        temperature: float = Field(
            default=1.0,
            gt=0.0,
            le=MAX_TEMPERATURE,
            allow_inf_nan=False,
            description=f"with do_sample: in [{MIN_SAMPLING_TEMPERATURE:.3g}, {MAX_TEMPERATURE:g}] "
            "(`check_sampling`); below 1e-5 sampling is greedy (moa_hf.speculative.MIN_TEMPERATURE)",
        )
        top_k: json_int(ge=0) = Field(default=0, description="0: no top-k filtering of the target's distribution")
        top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
        seed: json_int(ge=0, lt=1 << 63) | None = None

        @field_validator("temperature", "top_k", "top_p")
        @classmethod
        def _sampling_range(cls, value, info: ValidationInfo):
            """With do_sample (validated before these fields), the shared range check (`check_sampling`)."""
            check_sampling(**{info.field_name: value}, do_sample=bool(info.data.get("do_sample")))
            return value

    class VerifyRequest(_Drafts):
        """One drafting cycle: verify `draft_ids` after the first `num_verified` tokens of the session."""

        num_verified: json_int(ge=1, le=MAX_IDS) = Field(description="how many verified tokens the client holds")
        last_token: token_id = Field(description="the client's last verified token (consistency check)")

    return SparseDistribution, CreateSessionRequest, VerifyRequest


SparseDistribution, CreateSessionRequest, VerifyRequest = _request_models(json_int(ge=0))


def bounded_request_models(vocab_size: int) -> tuple[type[BaseModel], type[BaseModel]]:
    """(CreateSessionRequest, VerifyRequest) whose token ids are below `vocab_size`, in their validation and their
    schema (so the OpenAPI schema documents, and a fuzzer explores, the valid range): the server's models."""
    _, create, verify = _request_models(json_int(ge=0, lt=vocab_size))
    return create, verify


@dataclass
class VerifyResult:
    """Answer to a create or verify call.

    `accepted` drafted tokens were accepted and `next_token` (the target's correction, or its bonus token when all
    were accepted) follows them; the session now holds `num_verified` tokens. `context` [T, d] float32 holds the
    context vectors of positions `context_start .. context_start+T-1` (None when not asked for); those before
    `context_valid_from` are zero vectors with no context (a sliding-window layer had dropped them when they were
    read), which the client keeps out of its CA memory.
    """

    session_id: str
    num_verified: int
    accepted: int
    next_token: int
    context_start: int
    server_s: float
    context: torch.Tensor | None = None
    payload_bytes: int = 0
    context_valid_from: int = 0  # positions before it have no context (dropped by a sliding-window layer): zeros

    def metadata(self) -> dict:
        meta = asdict(self)
        meta.pop("context")
        meta.pop("payload_bytes")
        return meta


def encode_context(context: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """[T, d] context vectors -> safetensors tensors in `fmt` (fp16, fp32, or int8 with one fp32 scale per row)."""
    if fmt == "fp16":
        return {"context": context.to(torch.float16).contiguous()}
    if fmt == "fp32":
        return {"context": context.to(torch.float32).contiguous()}
    if fmt == "int8":
        x = context.float()
        scale = (x.abs().amax(dim=-1) / 127.0).clamp_min(1e-12)  # [T]
        q = torch.round(x / scale[:, None]).clamp(-127, 127).to(torch.int8)  # [T, d]
        return {"context_int8": q.contiguous(), "context_scale": scale.contiguous()}
    raise ValueError(f"Unknown context format {fmt!r}; use one of {CONTEXT_FORMATS}.")


def decode_context(tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Inverse of `encode_context` -> [T, d] float32 (None if the blob carries no context)."""
    if "context" in tensors:
        return tensors["context"].float()
    if "context_int8" in tensors:
        return tensors["context_int8"].float() * tensors["context_scale"].float()[:, None]  # [T, d]
    return None


def encode_result(result: VerifyResult, fmt: str) -> bytes:
    tensors = encode_context(result.context, fmt) if result.context is not None else {}
    return st_save(tensors, metadata={_META_KEY: json.dumps(result.metadata())})


def content_digest(body: bytes) -> str:
    """The `Content-Digest` header value of an answer body (RFC 9530): `sha-256=:<base64 of the sha-256>:`."""
    return "sha-256=:" + base64.b64encode(hashlib.sha256(body).digest()).decode("ascii") + ":"


def check_content_digest(body: bytes, header: str | None) -> None:
    """Raise `ValueError` when a `Content-Digest` header's sha-256 does not match `body` (no header, or no sha-256
    in it: nothing to check)."""
    if not header:
        return
    for item in header.split(","):
        name, _, value = item.strip().partition("=")
        if name.strip().lower() == "sha-256":
            if value.strip() != content_digest(body).partition("=")[2]:
                raise ValueError(f"the answer's body ({len(body)} bytes) does not match its Content-Digest")
            return


def read_safetensors_metadata(blob: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors blob (an 8-byte little-endian header length, then a JSON header)."""
    if len(blob) < 8:
        raise ValueError(f"Not a safetensors blob: {len(blob)} bytes, fewer than its 8-byte header length.")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        raise ValueError(f"Not a safetensors blob: header length {n} exceeds the {len(blob)} bytes received.")
    header = json.loads(blob[8 : 8 + n])
    return header.get("__metadata__") or {}


def decode_result(blob: bytes) -> VerifyResult:
    """Parse a create/verify answer; `ValueError` for anything that is not one (e.g. a corrupted body)."""
    meta = read_safetensors_metadata(blob)
    if _META_KEY not in meta:
        raise ValueError("The server's answer carries no MoA metadata: is the URL a `moa serve` server?")
    try:
        fields = json.loads(meta[_META_KEY])
        known = {f.name for f in dataclasses.fields(VerifyResult)} - {"context", "payload_bytes"}
        fields = {key: value for key, value in fields.items() if key in known}  # a newer server may send more
        result = VerifyResult(**fields, context=decode_context(st_load(blob)), payload_bytes=len(blob))
    except Exception as err:  # a truncated tensor, a field missing or of the wrong type: not a valid answer
        raise ValueError(f"The server's answer does not parse ({type(err).__name__}: {err})") from err
    ints = ("num_verified", "accepted", "next_token", "context_start", "context_valid_from")
    if not isinstance(result.session_id, str) or any(type(getattr(result, name)) is not int for name in ints):
        raise ValueError(f"The server's answer has fields of the wrong type: {fields}")
    if result.context is not None and result.context.dim() != 2:
        raise ValueError(f"The server's context vectors have shape {tuple(result.context.shape)}, not [T, d]")
    return result


def lsa_fingerprint(drafter: torch.nn.Module) -> str:
    """A short hash of the drafter's LSA weights (the part the server runs for the client); dtype-insensitive
    between float32 and bfloat16 copies (every tensor is hashed in bfloat16)."""
    h = hashlib.sha256()
    for name, tensor in sorted(drafter.state_dict().items()):
        if name.startswith(_LSA_PREFIXES):
            h.update(name.encode())
            h.update(str(tuple(tensor.shape)).encode())
            h.update(tensor.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def encode_drafter(drafter, target=None) -> bytes:
    """The drafter as one safetensors blob with its config in the metadata, always with its own embedding and
    LM head (copied from `target` when the drafter borrows them), so that a client can run it alone."""
    config = drafter.config.to_dict()
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    if not drafter.config.own_embeddings:
        if target is None:
            raise ValueError("This drafter borrows the target's embedding and LM head: pass the target to copy them.")
        dtype = next(v.dtype for v in state.values() if v.is_floating_point())  # not an integer buffer's
        state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().to("cpu", dtype).contiguous()
        state["lm_head.weight"] = target.get_output_embeddings().weight.detach().to("cpu", dtype).contiguous()
        config["own_embeddings"] = True
    # tied weights may share storage: safetensors refuses shared tensors, so give each its own copy
    state = {k: v.clone() for k, v in state.items()}
    return st_save(state, metadata={"config": json.dumps(config)})


def decode_drafter(blob: bytes, dtype: torch.dtype = torch.float32):
    """Inverse of `encode_drafter` -> a `MoADrafterModel` with its own embeddings, in eval mode."""
    from ..modeling import MoADrafterConfig, MoADrafterModel

    meta = read_safetensors_metadata(blob)
    if "config" not in meta:
        raise ValueError("The drafter blob carries no config in its metadata.")
    config_dict = json.loads(meta["config"])
    for key in ("model_type", "transformers_version", "architectures", "auto_map"):
        config_dict.pop(key, None)
    config = MoADrafterConfig(**config_dict)
    # from_pretrained builds the model without initialising weights that the state dict then replaces (a plain
    # MoADrafterModel(config) spends seconds drawing random embeddings for a large vocabulary)
    drafter, loading = MoADrafterModel.from_pretrained(
        None, config=config, state_dict=st_load(blob), dtype=dtype, output_loading_info=True
    )
    missing = sorted(k for k in loading["missing_keys"] if not k.endswith("inv_freq"))
    unexpected, mismatched = sorted(loading["unexpected_keys"]), loading.get("mismatched_keys") or []
    if missing or unexpected or mismatched:
        raise ValueError(
            f"The drafter blob does not match its config (missing {missing}, unexpected {unexpected}, "
            f"mismatched shapes {sorted(mismatched)})."
        )
    return drafter.eval()


# ---------------------------------------------------------------------------------------------------------------------
def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tokenizer_file_bytes(answer: dict) -> dict[str, bytes]:
    """A /v1/tokenizer answer ({"files": {name: text}, "binary_files": {name: base64}}) -> {file name: bytes}.
    Names must be plain file names (no folders): a server cannot make the client write elsewhere."""
    out = {}
    for key, decode in (("files", lambda v: v.encode("utf-8")), ("binary_files", base64.b64decode)):
        for name, value in (answer.get(key) or {}).items():
            if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
                raise ValueError(f"The tokenizer answer names a file {name!r}: only plain file names are accepted.")
            out[name] = decode(value)
    return out


def download_digests(drafter_blob: bytes, tokenizer_files: Mapping[str, bytes] | None) -> dict[str, str]:
    """{path in a cache entry: sha256} of what a client downloads: the drafter blob and the tokenizer's files."""
    digests = {DRAFTER_FILE: sha256_hex(drafter_blob)}
    for name, data in (tokenizer_files or {}).items():
        digests[f"{TOKENIZER_DIR}/{name}"] = sha256_hex(data)
    return digests


def download_revision(digests: Mapping[str, str]) -> str:
    """The revision of a download: a short hash of its files' paths and sha256 digests (`download_digests`). The
    server announces it in /v1/info; the client names its cache folder after it and recomputes it on every load."""
    h = hashlib.sha256()
    for path in sorted(digests):
        h.update(f"{path}\0{digests[path]}\n".encode())
    return h.hexdigest()[:16]
