"""Client-server speculative decoding: `moa serve` hosts the target, `MoAClient` drafts locally (see docs/serving.md).

The server verifies each drafting cycle with one target forward and returns the LSA context vectors the client's
drafter needs; the client keeps generating with its drafter alone while the server is unreachable.
Needs the `serving` extras (fastapi, uvicorn, httpx): `pip install 'moa-hf[serving]'`. Names are imported lazily, so
that `moa --help` works without them.
"""

import importlib

__all__ = [
    "PROTOCOL_VERSION",
    "ClientDraftPolicy",
    "ClientSettings",
    "GenerationEvent",
    "GenerationResult",
    "MoAClient",
    "ServerLimits",
    "ServerThread",
    "ServingError",
    "ServingState",
    "VerifyResult",
    "create_app",
]

_WHERE = {
    "ClientDraftPolicy": "draft_policy",
    "ClientSettings": "client_types",
    "GenerationEvent": "client_types",
    "GenerationResult": "client_types",
    "MoAClient": "client",
    "ServingError": "client_types",
    "PROTOCOL_VERSION": "protocol",
    "VerifyResult": "protocol",
    "ServerLimits": "state",
    "ServerThread": "server",
    "ServingState": "state",
    "create_app": "server",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(f".{_WHERE[name]}", __name__)
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"moa_hf.serving needs the `serving` extras ({err.name} is missing): pip install 'moa-hf[serving]'",
            name=err.name,
        ) from err
    return getattr(module, name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
