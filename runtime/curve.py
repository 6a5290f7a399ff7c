"""``LinkCurve``: CURVE encryption and a key allow-list on the links between runtime nodes.

A cluster's links (head <-> node, and the child processes of each) are ROUTER/DEALER pairs
like the gateway's, so they are secured the same way (``transport/PROTOCOL.md`` section
9): every ROUTER is a CURVE server that admits only allow-listed client keys, checked by
a ZAP handler, and every DEALER is a CURVE client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from treeserve.transport.sockets import CurveClientConfig, CurveServerConfig

__all__ = ["LinkCurve"]

_Z85_KEY_LEN = 40
_KEYS = ("server_public_key", "server_secret_key", "public_key", "secret_key")


def _check_key(name: str, key: object) -> None:
    if not isinstance(key, bytes) or len(key) != _Z85_KEY_LEN:
        raise ValueError(f"LinkCurve.{name} must be a 40-byte Z85 CURVE key (see transport.sockets.generate_keypair)")


@dataclass(frozen=True, slots=True)
class LinkCurve:
    """The CURVE identity of one cluster member and the members it admits.

    Every ROUTER of the cluster presents one shared *server* key pair
    (``server_public_key`` / ``server_secret_key``); each member connects with its own
    *client* key pair (``public_key`` / ``secret_key``) and a member's ROUTERs admit only
    the client keys in ``allowed_public_keys``, plus its own ``public_key`` (its child
    processes inherit it). Give every member the same allow-list: all members' public keys.

    Why one server key: a node calls endpoints it learns at run time from refs (a child
    binds a fresh port on every start), and a ref on the wire carries no key, so a DEALER
    must be able to reach any member's ROUTER with one known server key. Admission is
    decided by the client allow-list; the server secret lets a member serve, not connect.
    """

    server_public_key: bytes
    server_secret_key: bytes = field(repr=False)  # secrets stay out of logs
    public_key: bytes
    secret_key: bytes = field(repr=False)
    allowed_public_keys: frozenset[bytes]

    def __post_init__(self) -> None:
        for name in _KEYS:
            _check_key(name, getattr(self, name))
        if not isinstance(self.allowed_public_keys, frozenset):
            raise ValueError("LinkCurve.allowed_public_keys must be a frozenset of public keys")
        for key in self.allowed_public_keys:
            _check_key("allowed_public_keys[...]", key)

    def server_config(self) -> CurveServerConfig:
        """What this member's ROUTERs present and whom they admit."""
        allowed = self.allowed_public_keys | {self.public_key}
        return CurveServerConfig(self.server_public_key, self.server_secret_key, allowed)

    def client_config(self) -> CurveClientConfig:
        """What this member's DEALERs present to any member's ROUTER."""
        return CurveClientConfig(self.server_public_key, self.public_key, self.secret_key)

    def to_map(self) -> dict[str, Any]:
        """A msgpack-able map (the launch spec of a child process carries it)."""
        return {**{name: getattr(self, name) for name in _KEYS},
                "allowed_public_keys": sorted(self.allowed_public_keys)}

    @classmethod
    def from_map(cls, raw: Any) -> LinkCurve:
        """Inverse of ``to_map``; raises ``ValueError`` on a malformed map."""
        if not isinstance(raw, dict) or set(raw) != {*_KEYS, "allowed_public_keys"}:
            raise ValueError("a LinkCurve map needs exactly the keys of LinkCurve")
        allowed = raw["allowed_public_keys"]
        if not isinstance(allowed, list):
            raise ValueError("LinkCurve map: allowed_public_keys must be a list")
        return cls(**{name: raw[name] for name in _KEYS}, allowed_public_keys=frozenset(allowed))
