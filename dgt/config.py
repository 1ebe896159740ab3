"""Every dgt knob in one place.

``Config`` is the only reader of the environment in dgt.  Every field maps 1:1 onto one
``DGT_*`` variable (``block_elems`` <-> ``DGT_BLOCK_ELEMS``); a few MXNet/ps-lite rendezvous
variables (``DMLC_*``) are understood as fallbacks so that cluster launchers written for
``dist_sync`` can start dgt.  Values are validated once, at construction, and a bad value
raises :class:`~dgt.errors.ConfigError` naming the variable and its allowed range.

The table in the README is generated from :data:`KNOBS` (``python -m dgt config``), and a
test checks that the two agree.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Tuple

from .errors import ConfigError

__all__ = ["AUTO", "Config", "KNOBS", "Knob", "RECEIVE_MODES", "WEIGHTS_REPLIES", "WIRE_DTYPES",
           "markdown_table"]

RECEIVE_MODES = ("drop", "diff", "rescale")
WIRE_DTYPES = ("native", "bfloat16")
WEIGHTS_REPLIES = ("delta", "full")
# A knob whose best value depends on other knobs defaults to AUTO; Config resolves it once, at
# construction, so every reader sees a concrete value.
AUTO = "auto"
ROLES = ("worker", "server")


@dataclass(frozen=True)
class Knob:
    """Description of one configuration variable."""

    name: str  # Config field name
    env: str  # environment variable
    kind: type  # int, float, bool or str
    default: Any
    allowed: str  # human-readable range, used in errors and docs
    check: Optional[Callable[[Any], bool]]
    doc: str
    roles: str  # which processes read it


def _in(lo, hi):
    return lambda v: lo <= v <= hi


KNOBS: Tuple[Knob, ...] = (
    # --- algorithm -------------------------------------------------------------------------
    Knob("enable", "DGT_ENABLE", bool, True, "0 or 1", None,
         "1: differential transmission. 0: every block reliable over the same transport "
         "(A/B baseline).", "worker"),
    Knob("block_elems", "DGT_BLOCK_ELEMS", int, 1024, "64..16777216", _in(64, 1 << 24),
         "Block size in elements (1024 fp32 = 4096 bytes, the reference default). A tensor "
         "of one block is always reliable.", "worker"),
    Knob("score_alpha", "DGT_SCORE_ALPHA", float, 0.3, "0.0..1.0 (below 1)", lambda v: 0.0 <= v < 1.0,
         "Weight of the history in the contribution EMA: "
         "c = alpha*c_prev + (1-alpha)*mean|g|.", "worker"),
    Knob("threshold", "DGT_THRESHOLD", float, 0.8, "0.0..1.0", _in(0.0, 1.0),
         "k0: fraction of a tensor's blocks, by contribution rank, sent reliably.", "worker"),
    Knob("threshold_min", "DGT_THRESHOLD_MIN", float, 0.2, "0.0..1.0", _in(0.0, 1.0),
         "k_min: floor of the adaptive k.", "worker"),
    Knob("adaptive", "DGT_ADAPTIVE", bool, False, "0 or 1", None,
         "1: k = clamp(k0 * L_t / L_0, k_min, 1) with L the smoothed loss reported by "
         "dgt.report_loss(), or the smoothed gradient norm when no loss is reported: fewer "
         "bytes, less accuracy under heavy UDP loss (README, Receive modes). 0: k stays k0.",
         "worker"),
    Knob("adaptive_smoothing", "DGT_ADAPTIVE_SMOOTHING", float, 0.9, "0.0..1.0 (below 1)",
         lambda v: 0.0 <= v < 1.0,
         "EMA weight of the history for the adaptive-k signal (0 = raw signal).", "worker"),
    Knob("udp_channels", "DGT_UDP_CHANNELS", int, 3, "1..7", _in(1, 7),
         "Number C of lossy UDP channels; blocks below the threshold are split in C equal "
         "bands, most important on channel 1.", "all"),
    Knob("shared_ranking", "DGT_SHARED_RANKING", bool, False, "0 or 1", None,
         "1: every worker ranks blocks by the sum of all workers' contributions (each push "
         "carries its block scores, each reply their sum), so all pick the same reliable "
         "blocks: their sums are complete, and the reply (optimizer on the workers) carries "
         "little more than those blocks. 0: each worker ranks by its own contribution, as the "
         "reference does.", "worker"),
    Knob("random_order", "DGT_RANDOM_ORDER", bool, False, "0 or 1", None,
         "Ablation: rank blocks in a random order (seeded, new each step) instead of by "
         "contribution.", "worker"),
    Knob("send_drop", "DGT_SEND_DROP", bool, False, "0 or 1", None,
         "Ablation (Sender Dropping): UDP-class blocks are never sent.", "worker"),
    Knob("wire_dtype", "DGT_WIRE_DTYPE", str, AUTO, "|".join((AUTO,) + WIRE_DTYPES),
         lambda v: v in (AUTO,) + WIRE_DTYPES,
         "native: gradients travel in their own dtype. bfloat16: float32 gradients travel as "
         "bfloat16 (float32's range, 8 significant bits, rounded to nearest) on every channel "
         "and in the summed replies, half the bytes; the servers sum in float32, and weights "
         "from a server-side optimizer come back in float32. auto: bfloat16 with "
         "DGT_ENABLE=1, native with DGT_ENABLE=0 (the lossless A/B baseline stays exact). "
         "Every worker must use the same.",
         "worker"),
    Knob("weights_reply", "DGT_WEIGHTS_REPLY", str, "delta", "|".join(WEIGHTS_REPLIES),
         lambda v: v in WEIGHTS_REPLIES,
         "How a server-side optimizer's weights come back when the gradients came in "
         "bfloat16. delta: each reply is the bfloat16 step from the weights the workers hold "
         "(the server keeps a copy of them) to its float32 weights, half the bytes; rounding "
         "never accumulates, since the next step starts from what the workers hold. full: "
         "the float32 weights. Gradients in float32 always get float32 weights.", "server"),
    # --- receive side ----------------------------------------------------------------------
    Knob("receive_mode", "DGT_RECEIVE_MODE", str, AUTO, "|".join((AUTO,) + RECEIVE_MODES),
         lambda v: v in (AUTO,) + RECEIVE_MODES,
         "drop: what arrived by the step's close is merged, late blocks are discarded "
         "(Heuristic Dropping). diff: lost blocks are zero, a block one step late joins the "
         "next step (Diff-Reception). rescale: each block's sum is scaled by "
         "workers/deliverers (unbiased). auto: rescale, or drop with DGT_ERROR_FEEDBACK=1 "
         "(which needs it).", "server"),
    Knob("error_feedback", "DGT_ERROR_FEEDBACK", bool, False, "0 or 1", None,
         "1: the reply tells each worker which of its UDP blocks were not merged; the worker "
         "adds them to its next gradient, so nothing is lost for good. Needs "
         "DGT_RECEIVE_MODE=drop.", "all"),
    Knob("grace_ms", "DGT_GRACE_MS", float, 10.0, "0..60000", _in(0.0, 60000.0),
         "How long the server waits for missing UDP blocks after the last reliable part of "
         "a step arrived.", "server"),
    # --- transport -------------------------------------------------------------------------
    Knob("priority_order", "DGT_PRIORITY_ORDER", bool, True, "0 or 1", None,
         "1: reliable messages and replies leave most urgent first, by MXNet's priority "
         "(gluon and Module: the first layers first), so a first layer's push does not "
         "wait behind the last layers' big tensors. 0: in call order (A/B baseline).",
         "all"),
    Knob("udp_payload_bytes", "DGT_UDP_PAYLOAD_BYTES", int, 1400, "64..65000", _in(64, 65000),
         "Largest gradient payload of a UDP datagram (1400 + headers fit a 1500-byte MTU; "
         "above the MTU, IP fragments each datagram and one lost fragment loses all of it); "
         "servers size their receive rows with it, so set it alike everywhere.", "all"),
    Knob("udp_buffer_bytes", "DGT_UDP_BUFFER_BYTES", int, 16 << 20, "65536..1073741824",
         _in(1 << 16, 1 << 30), "SO_SNDBUF / SO_RCVBUF of the UDP sockets.", "all"),
    Knob("udp_drop", "DGT_UDP_DROP", float, 0.0, "0.0..1.0", _in(0.0, 1.0),
         "Seeded loss injection: probability that the sender drops a UDP datagram "
         "(tests and experiments).", "worker"),
    Knob("seed", "DGT_SEED", int, 0, "0..2**32-1", _in(0, 2 ** 32 - 1),
         "Seed of every random choice (random order, loss injection).", "all"),
    Knob("bigarray_elems", "DGT_BIGARRAY_ELEMS", int, 1_000_000, "1024..2**31-1",
         _in(1024, 2 ** 31 - 1),
         "Tensors at least this large are sliced across all servers (as "
         "MXNET_KVSTORE_BIGARRAY_BOUND); smaller ones go whole to one server, picked by a hash "
         "of the key (MXNet's `(key * 9973) % servers` is the key's parity with 2 servers, "
         "which put every Gluon weight on the same one).", "worker"),
    Knob("part_elems", "DGT_PART_ELEMS", int, 1 << 20, "0 or 1024..2**31-1",
         lambda v: v == 0 or 1024 <= v < 2 ** 31,
         "Tensors larger than this many elements are cut into parts merged and answered "
         "independently, so a big tensor's push and reply overlap (0: never cut).", "worker"),
    Knob("fusion_elems", "DGT_FUSION_ELEMS", int, 1 << 18, "0..2**30", _in(0, 2 ** 30),
         "Tensors smaller than this many elements are packed together, in the order they are "
         "pushed, into buckets of at most this size that travel as one key (tensor fusion; "
         "0: never).", "worker"),
    Knob("timeout_s", "DGT_TIMEOUT_S", float, 300.0, "1..86400", _in(1.0, 86400.0),
         "Longest wait for any reply or peer before failing with a clear error.", "all"),
    Knob("log_level", "DGT_LOG_LEVEL", str, "INFO", "DEBUG|INFO|WARNING|ERROR",
         lambda v: v in ("DEBUG", "INFO", "WARNING", "ERROR"),
         "Log level of the server process (workers log through the application's logging "
         "set-up).", "server"),
    Knob("stats", "DGT_STATS", str, "", "a file path, or empty", None,
         "Write one JSON line per step per worker (bytes and blocks per channel, loss, k, "
         "grace, latency). '{rank}' in the path is replaced by the worker rank.", "worker"),
    Knob("trace", "DGT_TRACE", str, "", "empty, or a file path with {role} and {index}",
         lambda v: v == "" or ("{role}" in v and "{index}" in v),
         "Write one JSON line per message event (a part pushed, arrived, closed, replied, "
         "its reply received), wall-clock stamped, to this path with {role} (worker or "
         "server) and {index} (rank or server index) filled in; `python -m "
         "benchmarks.timeline` reads them.", "all"),
    # --- job and rendezvous ----------------------------------------------------------------
    Knob("role", "DGT_ROLE", str, "worker", "worker|server", lambda v: v in ROLES,
         "Role of this process (set by dgt-launch). DMLC_ROLE is never read for this: "
         "MXNet starts its own server when it sees DMLC_ROLE=server.", "all"),
    Knob("rank", "DGT_RANK", int, -1, "-1..65534 (-1: assigned by server 0)", _in(-1, 65534),
         "Worker rank. Fallback: DMLC_WORKER_ID.", "worker"),
    Knob("num_workers", "DGT_NUM_WORKERS", int, 1, "1..65535", _in(1, 65535),
         "Number of workers. Fallback: DMLC_NUM_WORKER.", "all"),
    Knob("num_servers", "DGT_NUM_SERVERS", int, 1, "1..256", _in(1, 256),
         "Number of servers. Fallback: DMLC_NUM_SERVER.", "all"),
    Knob("server_addrs", "DGT_SERVER_ADDRS", str, "", "host:port[,host:port...]", None,
         "TCP endpoints of the servers, in server-index order; each server also receives "
         "UDP on the same port number. Fallback: DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT+i.", "all"),
    Knob("server_index", "DGT_SERVER_INDEX", int, 0, "0..255", _in(0, 255),
         "Index of this server in DGT_SERVER_ADDRS (servers only). Fallback: DMLC_SERVER_ID.",
         "server"),
    Knob("bind_host", "DGT_BIND_HOST", str, "0.0.0.0", "an IPv4 address", None,
         "Address a server binds to.", "server"),
    Knob("job_id", "DGT_JOB_ID", int, 0, "0..2**32-1", _in(0, 2 ** 32 - 1),
         "Identifies the job on the wire; datagrams of other jobs are dropped. Set by "
         "dgt-launch.", "all"),
)

_BY_ENV = {k.env: k for k in KNOBS}

# DMLC_* fallbacks: (dgt field, dmlc variable). Only consulted when the DGT_ variable is unset.
_DMLC_FALLBACKS = (
    ("rank", "DMLC_WORKER_ID"),
    ("num_workers", "DMLC_NUM_WORKER"),
    ("num_servers", "DMLC_NUM_SERVER"),
    ("server_index", "DMLC_SERVER_ID"),
)


def _parse(knob: Knob, raw: str, source: str) -> Any:
    text = raw.strip()
    try:
        if knob.kind is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if knob.kind is int:
            return int(text, 0)
        if knob.kind is float:
            value = float(text)
            if value != value:  # NaN
                raise ValueError(text)
            return value
        return text
    except ValueError:
        raise ConfigError(f"{source}={raw!r} is not valid: expected {knob.allowed}") from None


@dataclass(frozen=True)
class Config:
    """Immutable, validated configuration of one dgt process.

    Build it with :meth:`from_env` (what launched processes do) or directly with keyword
    arguments (tests, notebooks).  Field documentation lives in :data:`KNOBS`.
    """

    enable: bool = True
    block_elems: int = 1024
    score_alpha: float = 0.3
    threshold: float = 0.8
    threshold_min: float = 0.2
    adaptive: bool = False
    adaptive_smoothing: float = 0.9
    udp_channels: int = 3
    shared_ranking: bool = False
    random_order: bool = False
    send_drop: bool = False
    wire_dtype: str = AUTO
    weights_reply: str = "delta"
    receive_mode: str = AUTO
    error_feedback: bool = False
    grace_ms: float = 10.0
    priority_order: bool = True
    udp_payload_bytes: int = 1400
    udp_buffer_bytes: int = 16 << 20
    udp_drop: float = 0.0
    seed: int = 0
    bigarray_elems: int = 1_000_000
    part_elems: int = 1 << 20
    fusion_elems: int = 1 << 18
    timeout_s: float = 300.0
    log_level: str = "INFO"
    stats: str = ""
    trace: str = ""
    role: str = "worker"
    rank: int = -1
    num_workers: int = 1
    num_servers: int = 1
    server_addrs: str = ""
    server_index: int = 0
    bind_host: str = "0.0.0.0"
    job_id: int = 0
    # Where each value came from, for error messages ("DGT_THRESHOLD" or "Config(threshold=)").
    _sources: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)
    # Fields that were AUTO before resolution: to_env and replace hand AUTO on, so a child
    # process or a replaced config resolves them again against its own settings.
    _auto: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self):
        for knob in KNOBS:
            value = getattr(self, knob.name)
            source = self._sources.get(knob.name, knob.env)
            if knob.kind is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, knob.name, float(value))
                value = float(value)
            if knob.kind is bool and value in (0, 1) and not isinstance(value, bool):
                object.__setattr__(self, knob.name, bool(value))
                value = bool(value)
            if not isinstance(value, knob.kind) or (knob.kind is int and isinstance(value, bool)):
                raise ConfigError(f"{source}={value!r} has the wrong type: expected {knob.allowed}")
            if knob.check is not None and not knob.check(value):
                raise ConfigError(f"{source}={value!r} is out of range: allowed {knob.allowed}")
        self._resolve_auto()
        self._check_combinations()

    def _resolve_auto(self):
        # Measured on the emulated 1 Gbit/s testbed (benchmarks/RESULTS.md): bfloat16 halves
        # the bytes of push and reply, and rescale keeps the sums unbiased under UDP loss; with
        # both, AlexNet and VGG-11 reach their target accuracy in about half dist_sync's time.
        resolved = {
            "wire_dtype": "bfloat16" if self.enable else "native",
            "receive_mode": "drop" if self.error_feedback else "rescale",
        }
        auto = frozenset(name for name in resolved if getattr(self, name) == AUTO)
        for name in auto:
            object.__setattr__(self, name, resolved[name])
        object.__setattr__(self, "_auto", auto)

    def _check_combinations(self):
        if self.threshold_min > self.threshold:
            raise ConfigError(
                f"DGT_THRESHOLD_MIN={self.threshold_min} is above DGT_THRESHOLD={self.threshold}: "
                "the floor of the adaptive threshold must not exceed its start value")
        if self.error_feedback and self.receive_mode != "drop":
            raise ConfigError(
                f"DGT_ERROR_FEEDBACK=1 needs DGT_RECEIVE_MODE=drop (got {self.receive_mode!r}): "
                "with 'diff' a late block would be merged and also re-sent by the worker, with "
                "'rescale' a lost block would be compensated twice. Set DGT_ERROR_FEEDBACK=0 "
                "to use that mode.")
        if self.rank >= self.num_workers:
            raise ConfigError(
                f"DGT_RANK={self.rank} is out of range: allowed -1..{self.num_workers - 1} "
                f"for DGT_NUM_WORKERS={self.num_workers}")
        if self.server_index >= self.num_servers:
            raise ConfigError(
                f"DGT_SERVER_INDEX={self.server_index} is out of range: allowed "
                f"0..{self.num_servers - 1} for DGT_NUM_SERVERS={self.num_servers}")
        addrs = self.server_addr_list()
        if addrs and len(addrs) != self.num_servers:
            raise ConfigError(
                f"DGT_SERVER_ADDRS lists {len(addrs)} servers but DGT_NUM_SERVERS="
                f"{self.num_servers}")

    # ------------------------------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **overrides) -> "Config":
        """Read every ``DGT_*`` variable (and the ``DMLC_*`` fallbacks) from ``environ``."""
        env = os.environ if environ is None else environ
        values = {}
        sources = {}
        for knob in KNOBS:
            if knob.env in env and env[knob.env] != "":
                values[knob.name] = _parse(knob, env[knob.env], knob.env)
                sources[knob.name] = knob.env
        for name, dmlc in _DMLC_FALLBACKS:
            if name not in values and env.get(dmlc, "") != "":
                knob = next(k for k in KNOBS if k.name == name)
                values[name] = _parse(knob, env[dmlc], dmlc)
                sources[name] = dmlc
        if "server_addrs" not in values and env.get("DMLC_PS_ROOT_URI") and env.get("DMLC_PS_ROOT_PORT"):
            n = values.get("num_servers", 1)
            host = env["DMLC_PS_ROOT_URI"]
            port = _parse(Knob("p", "DMLC_PS_ROOT_PORT", int, 0, "1..65535", None, "", ""),
                          env["DMLC_PS_ROOT_PORT"], "DMLC_PS_ROOT_PORT")
            values["server_addrs"] = ",".join(f"{host}:{port + i}" for i in range(n))
            sources["server_addrs"] = "DMLC_PS_ROOT_URI/DMLC_PS_ROOT_PORT"
        for name, value in overrides.items():
            values[name] = value
            sources[name] = f"Config({name}=)"
        unknown = sorted(k for k in env if k.startswith("DGT_") and k not in _BY_ENV)
        if unknown:
            raise ConfigError(
                f"unknown setting(s) {', '.join(unknown)}: the DGT_ variables are "
                f"{', '.join(k.env for k in KNOBS)}")
        return cls(**values, _sources=sources)

    def to_env(self) -> dict:
        """The ``DGT_*`` variables that reproduce this configuration in a child process."""
        out = {}
        for knob in KNOBS:
            value = AUTO if knob.name in self._auto else getattr(self, knob.name)
            out[knob.env] = str(int(value)) if knob.kind is bool else str(value)
        return out

    def replace(self, **changes) -> "Config":
        sources = dict(self._sources)
        sources.update({k: f"Config({k}=)" for k in changes})
        still_auto = {name: AUTO for name in self._auto if name not in changes}
        return dataclasses.replace(self, _sources=sources, **still_auto, **changes)

    def server_addr_list(self):
        """``[(host, port), ...]`` parsed from ``server_addrs``."""
        if not self.server_addrs:
            return []
        out = []
        for item in self.server_addrs.split(","):
            host, sep, port = item.strip().rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
                raise ConfigError(
                    f"DGT_SERVER_ADDRS={self.server_addrs!r} is not valid: expected "
                    "host:port[,host:port...] with ports 0..65535 (0: any free port)")
            out.append((host, int(port)))
        return out

    def stats_path(self, rank: int) -> str:
        return self.stats.replace("{rank}", str(rank)) if self.stats else ""


def markdown_table() -> str:
    """The README's table of every knob."""
    lines = ["| Variable | Default | Allowed | Read by | Meaning |", "|---|---|---|---|---|"]
    for k in KNOBS:
        default = int(k.default) if k.kind is bool else k.default
        default = f"`{default}`" if default != "" else "(empty)"
        # A bare "|" would end the cell (drop|diff|rescale came out as three columns).
        allowed, doc = (text.replace("|", "\\|") for text in (k.allowed, k.doc))
        lines.append(f"| `{k.env}` | {default} | {allowed} | {k.roles} | {doc} |")
    return "\n".join(lines)
