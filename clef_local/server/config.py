"""Settings of ``clef-local serve`` and the table of served model names (no web framework imported here)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from clef_local.errors import ApiUsageError
from clef_local.server.guard import allowed_host_names, check_origin_value, split_authority

# The names Jev clients send without being told otherwise: the official SDKs default to "jev-latest", and
# "jev-preview" is the other documented alias. Both answer with the first --model (the default model).
JEV_ALIASES: tuple[str, ...] = ("jev-latest", "jev-preview")
DEFAULT_NAME = "clef-local"
MAX_BODY_BYTES = 13 * 1024 * 1024  # the hosted API's limit; larger bodies get 413
# A client on this machine sends its headers in milliseconds and 13 MiB in well under a second; these bound how
# long a slow (or hostile) client can hold a connection, and how many it can hold.
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 128


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``serve`` needs besides the loaded models."""

    host: str = "127.0.0.1"
    port: int = 8077
    api_key: str | None = None
    max_batch: int = 8
    max_wait_ms: float = 5.0
    max_queue: int = 64
    confidence: Literal["jev", "reference"] = "jev"
    max_body_bytes: int = MAX_BODY_BYTES
    aliases: tuple[str, ...] = JEV_ALIASES
    graceful_timeout_s: float = 30.0
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted besides localhost, 127.0.0.1, [::1] and `host`
    cors_origins: tuple[str, ...] = ()  # web page origins allowed to call the API (CORS); none by default
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    threads: int | None = None  # intra-op threads of the inference thread (None: planning.hardware.thread_plan)
    state_cache: int | None = None  # bytes per served model (0: off; None: sized by the planner at load)

    def __post_init__(self) -> None:
        if self.state_cache is not None and self.state_cache < 0:
            raise ApiUsageError(f"--state-cache must be a size ≥ 0 (0: off), got {self.state_cache}")
        if self.max_batch < 1:
            raise ApiUsageError(f"--max-batch must be at least 1, got {self.max_batch}")
        if self.max_wait_ms < 0:
            raise ApiUsageError(f"--max-wait-ms must be at least 0, got {self.max_wait_ms}")
        if self.max_queue < 1:
            raise ApiUsageError(f"--max-queue must be at least 1, got {self.max_queue}")
        if self.confidence not in ("jev", "reference"):
            raise ApiUsageError(f"--confidence must be jev or reference, got {self.confidence!r}")
        if self.api_key is not None and (not self.api_key or not self.api_key.isascii() or " " in self.api_key):
            raise ApiUsageError("--api-key must be non-empty printable ASCII without spaces")
        for flag, seconds in (("--header-timeout", self.header_timeout_s), ("--body-timeout", self.body_timeout_s)):
            if not seconds > 0:
                raise ApiUsageError(f"{flag} must be a positive number of seconds, got {seconds}")
        if self.max_connections < 1:
            raise ApiUsageError(f"--max-connections must be at least 1, got {self.max_connections}")
        if self.threads is not None and self.threads < 1:
            raise ApiUsageError(f"--threads must be at least 1, got {self.threads}")
        for name in self.allowed_hosts:
            parsed = split_authority(name)
            if parsed is None or parsed[1] is not None:
                raise ApiUsageError(f"--allowed-host {name[:100]!r}: expected a host name or address without a port "
                                    "(any port is accepted), such as my-box.local or 192.168.1.4")
        try:
            object.__setattr__(self, "cors_origins", tuple(check_origin_value(o) for o in self.cors_origins))
        except ValueError as exc:
            raise ApiUsageError(str(exc)) from None

    @property
    def host_names(self) -> frozenset[str]:
        """The ``Host`` names this server answers (:mod:`clef_local.server.guard`)."""
        return allowed_host_names(self.host, self.allowed_hosts)


def parse_model_specs(specs: Sequence[str]) -> dict[str, Path]:
    """``["NAME=DIR", ...]`` as an ordered ``{name: path}``; a bare ``DIR`` is served as ``clef-local``."""
    out: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = DEFAULT_NAME, spec
        name = name.strip()
        if not name or not path:
            raise ApiUsageError(f"--model {spec!r}: expected NAME=DIR")
        if name in out:
            raise ApiUsageError(f"--model {spec!r}: the name {name!r} is given twice")
        out[name] = Path(path).expanduser()
    return out


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def bind_warning(host: str, api_key: str | None) -> str | None:
    """The warning printed when the server listens beyond this machine without a key, else ``None``."""
    if is_loopback(host) or api_key:
        return None
    return (f"WARNING: clef-local serve is listening on {host} without --api-key: anyone who can reach this "
            "machine can use the model. Pass --api-key KEY, or bind 127.0.0.1.")


@dataclass
class ModelTable:
    """Served names (and aliases) → loaded models; the first model is the default one."""

    models: Mapping[str, Any]
    aliases: tuple[str, ...] = JEV_ALIASES
    _names: dict[str, str] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if not self.models:
            raise ApiUsageError("no model to serve")
        default = next(iter(self.models))
        self._names = {alias: default for alias in self.aliases}
        self._names.update({name: name for name in self.models})  # an explicit --model name wins over an alias

    @property
    def default(self) -> str:
        return next(iter(self.models))

    def resolve(self, name: str) -> str:
        """The served model a request's ``model`` names; unknown names raise ``ApiUsageError`` (400)."""
        served = self._names.get(name)
        if served is None:
            known = ", ".join(sorted(self._names))
            raise ApiUsageError(f"model {name[:200]!r} is not served here; available: {known}")
        return served

    def get(self, name: str) -> Any:
        return self.models[name]

    def listing(self) -> list[dict[str, str]]:
        """The ``/v1/models`` entries: each served model, then each alias."""
        out = [{"name": n, "description": _describe(n, m), "release_date": _release_date(m)}
               for n, m in self.models.items()]
        for alias, target in self._names.items():
            if alias not in self.models:
                model = self.models[target]
                out.append({"name": alias, "description": f"alias of {target}: {_describe(target, model)}",
                            "release_date": _release_date(model)})
        return out


def _describe(name: str, model: Any) -> str:
    path = getattr(model, "path", None)
    where = f" from {Path(path).name}" if path else ""
    return f"Clef decision model {name}{where}, served locally by clef-local"


def _release_date(model: Any) -> str:
    """The release's date (its config.json's modification day, UTC), YYYY-MM-DD."""
    path = getattr(model, "path", None)
    try:
        stamp = (Path(path) / "config.json").stat().st_mtime if path else 0.0
    except OSError:
        stamp = 0.0
    return dt.datetime.fromtimestamp(stamp, tz=dt.UTC).date().isoformat()
